// Formatting and recording of training metrics.
#include "lib/train/metrics.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lib/core/error.h"

namespace mpigpt {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m{:02}s", t / 3600, t / 60 % 60, t % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

std::string format_step(const StepMetrics& m) {
  const int w = int(std::to_string(m.total_iters).size());
  return fmt::format(
      "iter {:>{}}/{} | samples {} | lr {:.3e} | loss {:.4f}{} | grad norm {:.3f} | {:.1f} ms/iter | "
      "{:.0f} tok/s | {:.3f} TFLOP/s{} | mem {:.0f} MiB | eta {}",
      m.iter, w, m.total_iters, m.consumed_samples, m.lr, m.loss,
      m.has_aux ? fmt::format(" | aux {:.4f} | load {:.2f}", m.aux_loss, m.expert_load) : std::string(), m.grad_norm, m.ms_per_iter, m.tokens_per_s,
      m.tflops, std::isfinite(m.mfu) ? fmt::format(" | MFU {:.1f}%", 100.0 * m.mfu) : std::string(), m.peak_mem_mib,
      format_duration(m.eta_s));
}

MetricsWriter::MetricsWriter(const std::string& path) {
  if (path.empty()) return;
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec)
    fail("training.metrics_file = '{}': cannot create its folder {} ({}); choose a writable path", path,
         parent.string(), ec.message());
  try {
    out_ = std::make_unique<NewFile>(path);
  } catch (const Error& e) {
    fail("training.metrics_file = '{}' cannot be written: {}; choose a writable path", path, e.what());
  }
}

void MetricsWriter::start(int64_t resumed_iter) {
  if (!out_) return;
  std::ifstream old(resumed_iter > 0 ? out_->path() : std::string());
  for (std::string line; std::getline(old, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);  // a line cut short: discarded
    if (!j.is_discarded() && j.is_object() && j.value("iter", resumed_iter + 1) <= resumed_iter) out_->write(line + "\n");
  }
  out_->commit();
}

void MetricsWriter::put(const std::string& record) {
  out_->write(record + "\n");
  out_->flush();
}

void MetricsWriter::step(const StepMetrics& m) {
  if (!out_) return;
  nlohmann::json j = {{"iter", m.iter},
                      {"consumed_samples", m.consumed_samples},
                      {"lr", m.lr},
                      {"loss", m.loss},
                      {"grad_norm", m.grad_norm},
                      {"ms_per_iter", m.ms_per_iter},
                      {"tokens_per_s", m.tokens_per_s},
                      {"tflops", m.tflops},
                      {"peak_mem_mib", m.peak_mem_mib}};
  if (std::isfinite(m.mfu)) j["mfu"] = m.mfu;
  if (m.has_aux) j["aux_loss"] = m.aux_loss, j["expert_load_imbalance"] = m.expert_load;
  put(j.dump());
}

void MetricsWriter::eval(int64_t iter, double val_loss) {
  if (out_) put(nlohmann::json{{"iter", iter}, {"val_loss", val_loss}}.dump());
}

double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // Linux reports KiB
}

}  // namespace mpigpt
