// `mpigpt bench-attention`: the causal attention of a configuration alone, forward and backward on
// random data of its shape: median time per call and TFLOP/s, one process.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <vector>

#include "app/backend.h"
#include "app/commands.h"
#include "io/config/config.h"
#include "lib/core/log.h"
#include "lib/core/rng.h"
#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "lib/train/trainer.h"
#include "parallel/mpi_env.h"

namespace mpigpt::app {

namespace {

// n standard normal values from a fixed seed (lib/core/rng.h; the timing does not depend on them,
// varied finite scores keep the softmax honest).
std::vector<float> random_values(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = normal_at(seed, 0, i);
  return v;
}

// A tensor of the ops' device in dtype dt holding host values (converted on the device for bf16).
Tensor upload(Ops& ops, Buffer& buf, Buffer& stage, const std::vector<float>& host, Shape s, DType dt) {
  std::vector<float> tmp(host);
  const Tensor src(tmp.data(), s, DType::F32, Device::CPU);
  const Tensor t = buf.tensor(s, dt);
  if (dt == DType::F32) {
    ops.copy(t, src);
  } else {
    const Tensor f = stage.tensor(s, DType::F32);
    ops.copy(f, src);
    ops.copy(t, f);
  }
  ops.synchronize();
  return t;
}

// Median seconds of `runs` calls of f after `warmup` calls, the backend synchronised around each.
template <class F>
double median_seconds(Ops& ops, int warmup, int runs, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  ops.synchronize();
  std::vector<double> s;
  for (int i = 0; i < runs; ++i) {
    const double t0 = MPI_Wtime();
    f();
    ops.synchronize();
    s.push_back(MPI_Wtime() - t0);
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

}  // namespace

// The shape is the configuration's (training.micro_batch sequences of model.seq_len tokens, the
// model's query and key/value heads and head dim), run on the configured backend, precision and
// engine.attention_backend.
int cmd_bench_attention(const std::vector<std::string>& args, const MpiEnv& mpi) {
  ParsedArgs parsed = parse_config_args(args, {"bench-steps", "bench-warmup"});
  if (parsed.help) {
    if (mpi.rank() == 0)
      fmt::print("usage: mpigpt bench-attention [--bench-steps 10] [--bench-warmup 3] [--config FILE.ini ...] "
                 "[--section.key value ...]\n\n{}", parsed.help_text);
    return 0;
  }
  reject_positional(parsed, "see mpigpt bench-attention --help");
  if (mpi.size() != 1) fail("mpigpt bench-attention runs on one rank (it got {}); start it without mpirun", mpi.size());
  int steps = 10, warmup = 3;
  for (const auto& [k, v] : parsed.flags) {
    int* dst = k == "bench-steps" ? &steps : &warmup;
    try {
      *dst = std::stoi(v);
    } catch (...) {
      fail("--{} = '{}' is not an integer", k, v);
    }
    if (*dst < (k == "bench-steps" ? 1 : 0)) fail("--{} = {} must be positive", k, v);
  }
  Config& cfg = parsed.config;
  cfg.validate(1);
  const GptDims d = make_dims(cfg, cfg.model.vocab_size > 0 ? cfg.model.vocab_size : 50257);
  const int64_t B = cfg.training.micro_batch, T = d.T;
  const int NH = d.NH, NKV = d.NKV, HD = d.HD();

  const std::unique_ptr<Ops> ops = make_backend(cfg, node_ranks());
  const DType dt = cfg.training.precision == "bf16" ? DType::BF16 : DType::F32;
  const std::string kernels = describe_attention(cfg, *ops);

  const Shape sqkv{B, T, int64_t(NH + 2 * NKV) * HD}, sout{B, T, int64_t(NH) * HD};
  const int64_t nsaved = ops->attention_saved_numel(B, T, NH);
  const size_t el = dtype_size(dt);
  Buffer qkv_buf(*ops, size_t(sqkv.numel()) * el), dqkv_buf(*ops, size_t(sqkv.numel()) * el),
      out_buf(*ops, size_t(sout.numel()) * el), dout_buf(*ops, size_t(sout.numel()) * el),
      saved_buf(*ops, size_t(nsaved) * 4), stage(*ops, size_t(sqkv.numel()) * 4);
  const Tensor qkv = upload(*ops, qkv_buf, stage, random_values(size_t(sqkv.numel()), 1), sqkv, dt);
  const Tensor dout = upload(*ops, dout_buf, stage, random_values(size_t(sout.numel()), 2), sout, dt);
  const Tensor out = out_buf.tensor(sout, dt), dqkv = dqkv_buf.tensor(sqkv, dt);
  const Tensor saved = saved_buf.tensor({nsaved}, DType::F32);

  const double fwd = median_seconds(*ops, warmup, steps, [&] { ops->attention_forward(out, saved, qkv, NH, NKV, HD); });
  const double bwd = median_seconds(*ops, warmup, steps, [&] {
    ops->attention_backward(dqkv, dout, qkv, out, saved, NH, NKV, HD);
  });
  // Causal FLOPs: the two products of the forward over half the T x T scores; the backward's five
  // (FlashAttention's count: 2.5 times the forward's, whatever an implementation recomputes).
  const double flops = 4.0 * double(B) * NH * double(T) * double(T) * HD / 2.0;
  log_line("bench-attention: {} {}; B {} T {} heads {}/{} head dim {}", ops->name(), dtype_name(dt), B, T, NH, NKV,
           HD);
  log_line("bench-attention: attention: {}", kernels);
  log_line("bench-attention: forward {:.3f} ms ({:.4g} TFLOP/s), backward {:.3f} ms ({:.4g} TFLOP/s); median of {}",
           fwd * 1e3, flops / fwd / 1e12, bwd * 1e3, 2.5 * flops / bwd / 1e12, steps);
  return 0;
}

}  // namespace mpigpt::app
