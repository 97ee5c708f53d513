#include "lib/kernels/attention_backend.h"

#include <fmt/format.h>

#include <array>
#include <sstream>

#include "lib/core/error.h"

namespace mpigpt {

namespace {
constexpr std::array<const char*, 3> kNames = {"builtin", "wgmma", "cudnn"};
}

AttentionBackendSpec parse_attention_backend(const std::string& value) {
  using Kind = AttentionBackendSpec::Kind;
  if (value == "auto") return {Kind::Auto, true, true};
  std::array<bool, kNames.size()> listed{};
  std::istringstream in(value);
  std::string name;
  size_t count = 0;
  auto empty_name = [&] {
    fail("engine.attention_backend = '{}' has an empty name; set it to builtin | wgmma | cudnn | auto, or a "
         "comma-separated list of those three (e.g. builtin,cudnn)", value);
  };
  if (value.empty() || value.back() == ',') empty_name();
  while (std::getline(in, name, ',')) {
    if (name.empty()) empty_name();
    size_t i = 0;
    while (i < kNames.size() && name != kNames[i]) ++i;
    if (i == kNames.size())
      fail("engine.attention_backend = '{}' is not one of builtin | wgmma | cudnn | auto, nor a comma-separated "
           "list of builtin, wgmma and cudnn for auto to choose among{}; set it to one of these (e.g. auto, or "
           "builtin,cudnn)", value, value.find(',') == std::string::npos ? "" : fmt::format(" ('{}' is none)", name));
    if (listed[i])
      fail("engine.attention_backend = '{}' names {} twice; name each of auto's candidates once (e.g. "
           "builtin,cudnn)", value, kNames[i]);
    listed[i] = true;
    ++count;
  }
  if (count == 1) return {listed[1] ? Kind::Wgmma : listed[2] ? Kind::Cudnn : Kind::Builtin, false, false};
  if (!listed[0])
    fail("engine.attention_backend = '{}' lists auto's candidates without builtin, the kernels auto checks the "
         "others against and that run the calls they do not take; add it (builtin,{})", value, value);
  return {Kind::Auto, listed[1], listed[2]};
}

std::string attention_backend_str(const AttentionBackendSpec& spec) {
  using Kind = AttentionBackendSpec::Kind;
  switch (spec.kind) {
    case Kind::Builtin: return "builtin";
    case Kind::Wgmma: return "wgmma";
    case Kind::Cudnn: return "cudnn";
    case Kind::Auto: break;
  }
  if (spec.wgmma && spec.cudnn) return "auto";
  return fmt::format("builtin{}{}", spec.wgmma ? ",wgmma" : "", spec.cudnn ? ",cudnn" : "");
}

}  // namespace mpigpt
