// `mpigpt bench --profile-ops --profile-out FILE.json`: a device profile for the planner's time
// model (lib/plan/profile.h) from the profiled step, GEMM and masked-attention timings and the links.
#include <fmt/format.h>
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <thread>

#include "app/commands.h"
#include "lib/core/log.h"
#include "lib/kernels/buffer.h"
#include "lib/plan/step_work.h"
#include "lib/train/trainer.h"
#include "parallel/context_parallel.h"

namespace mpigpt::app {

namespace {

using Clock = std::chrono::steady_clock;

// Best of three timed calls after one warm-up.
template <class F>
double best_of(Ops& ops, F&& f) {
  f();
  ops.synchronize();
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    f();
    ops.synchronize();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// The GEMM shapes of the profiled model under tensor- and context-parallel splits of 1, 2 and 4
// (what the planner asks about), each timed as linear layers call it (b transposed).
std::vector<GemmSample> sweep_gemms(const Config& cfg, const GptDims& d, Ops& ops) {
  std::vector<GemmCall> shapes;
  for (int tp : {1, 2, 4})
    for (int cp : {1, 2, 4}) {
      Config c = cfg;
      c.parallel.tp = tp, c.parallel.cp = cp, c.parallel.pp = 1, c.parallel.vpp = 1, c.parallel.pipeline_layout.clear();
      c.engine.recompute = "none";
      const Work w = step_work(c, d, 0, 1, 0, 0);
      for (const GemmCall& g : w.gemms)
        if (std::none_of(shapes.begin(), shapes.end(), [&](const GemmCall& s) { return s.m == g.m && s.n == g.n && s.k == g.k; }))
          shapes.push_back(g);
    }
  const DType dt = ops.device() == Device::CUDA ? DType::BF16 : DType::F32;
  std::vector<GemmSample> out;
  for (const GemmCall& g : shapes) {
    Buffer a(ops, size_t(g.m * g.k) * dtype_size(dt)), b(ops, size_t(g.n * g.k) * dtype_size(dt)),
        c(ops, size_t(g.m * g.n) * dtype_size(dt));
    Tensor ta = a.tensor({g.m, g.k}, dt), tb = b.tensor({g.n, g.k}, dt), tc = c.tensor({g.m, g.n}, dt);
    ops.fill(ta, 0.5f);
    ops.fill(tb, 0.25f);
    out.push_back({g.m, g.n, g.k, best_of(ops, [&] { ops.gemm(tc, ta, tb, false, true, 1.0f, 0.0f); })});
  }
  return out;
}

// Context parallelism's attention as rank 0 of cp 2 runs it (parallel/context_parallel.cpp's ring,
// load-balanced tokens: its own and the other K/V block, merged, then both blocks' backward) against
// the plain causal attention of the whole sequence, each best of 3: the ratios of their seconds per
// causal FLOP, forward and backward. Ratios, so that the profiled step's rates set the scale.
std::pair<double, double> masked_attention_ratio(const Config& cfg, const GptDims& d, Ops& ops) {
  const int B = cfg.training.micro_batch, T = d.T, cp = 2, NH = d.NH, NKV = d.NKV, HD = d.HD();
  const int64_t Tl = T / cp, R = d.qkv_dim(), RK = 2 * int64_t(NKV) * HD, C = int64_t(NH) * HD;
  const DType dt = ops.device() == Device::CUDA ? DType::BF16 : DType::F32;
  const std::vector<int32_t> index = cp_token_index(B, T, cp, nullptr);  // (cp, B, Tl) flat b*T + s
  std::vector<int32_t> pos(index.size()), seg(index.size(), 0);
  for (size_t i = 0; i < index.size(); ++i) pos[i] = index[i] % T;
  std::vector<Buffer> bufs;
  bufs.reserve(32);
  auto make = [&](Shape s, DType t) {
    bufs.emplace_back(ops, size_t(s.numel()) * dtype_size(t));
    return bufs.back().tensor(s, t);
  };
  auto host_block = [&](std::vector<int32_t>& v, int r) {
    Tensor t = make({B, Tl}, DType::I32);
    ops.copy(t, Tensor(v.data() + size_t(r) * B * Tl, {B, Tl}, DType::I32));
    return t;
  };
  const Tensor qkv = make({B, Tl, R}, dt), out = make({B, Tl, C}, dt), lse = make({B, NH, Tl}, DType::F32),
               bo = make({B, Tl, C}, dt), bl = make({B, NH, Tl}, DType::F32), dout = make({B, Tl, C}, dt),
               dqkv = make({B, Tl, R}, dt), dkv = make({B, Tl, RK}, dt);
  const Tensor kv[2] = {make({B, Tl, RK}, dt), make({B, Tl, RK}, dt)};
  const Tensor qpos = host_block(pos, 0), qseg = host_block(seg, 0);
  const Tensor kpos[2] = {qpos, host_block(pos, 1)}, kseg[2] = {qseg, host_block(seg, 1)};
  const Tensor fqkv = make({B, T, R}, dt), fout = make({B, T, C}, dt), fdout = make({B, T, C}, dt),
               fdqkv = make({B, T, R}, dt), saved = make({ops.attention_saved_numel(B, T, NH)}, DType::F32);
  for (const Tensor& t : {qkv, kv[0], kv[1], dout, fqkv, fdout}) ops.fill(t, 0.1f);
  const double masked_fwd = best_of(ops, [&] {
    ops.attention_block_forward(out, lse, qkv, kv[0], qpos, qseg, kpos[0], kseg[0], NH, NKV, HD);
    ops.attention_block_forward(bo, bl, qkv, kv[1], qpos, qseg, kpos[1], kseg[1], NH, NKV, HD);
    ops.attention_merge(out, lse, bo, bl);
  });
  const double masked_bwd = best_of(ops, [&] {
    for (int j = 0; j < 2; ++j)
      ops.attention_block_backward(dqkv, dkv, dout, qkv, kv[j], out, lse, qpos, qseg, kpos[j], kseg[j], NH, NKV, HD);
  });
  const double plain_fwd = best_of(ops, [&] { ops.attention_forward(fout, saved, fqkv, NH, NKV, HD); });
  const double plain_bwd =
      best_of(ops, [&] { ops.attention_backward(fdqkv, fdout, fqkv, fout, saved, NH, NKV, HD); });
  // Causal FLOPs as step_work counts them: rank 0's queries are half of the sequence's.
  return {cp * masked_fwd / plain_fwd, cp * masked_bwd / plain_bwd};
}

// Latency and bandwidth between world ranks 0 and 1 (ping-pong, least squares over sizes), and the
// reduction's cost per element from an all-reduce of the largest size. Collective over the world.
void measure_link(DeviceProfile& p, const MpiEnv& mpi) {
  const std::vector<int> sizes = {1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24};
  std::vector<char> buf(size_t(sizes.back()));
  std::vector<double> xs, ys;
  for (int n : sizes) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = Clock::now();
      if (mpi.rank() == 0) {
        MPI_Send(buf.data(), n, MPI_BYTE, 1, 7, MPI_COMM_WORLD);
        MPI_Recv(buf.data(), n, MPI_BYTE, 1, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (mpi.rank() == 1) {
        MPI_Recv(buf.data(), n, MPI_BYTE, 0, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf.data(), n, MPI_BYTE, 0, 7, MPI_COMM_WORLD);
      }
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / 2);
    }
    xs.push_back(n), ys.push_back(best);
  }
  double mx = 0, my = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < xs.size(); ++i) mx += xs[i] / xs.size(), my += ys[i] / ys.size();
  for (size_t i = 0; i < xs.size(); ++i) sxx += (xs[i] - mx) * (xs[i] - mx), sxy += (xs[i] - mx) * (ys[i] - my);
  const double per_byte = sxy / sxx;
  p.intra_node = {std::max(ys.front() - xs.front() * per_byte, 0.0), 1.0 / per_byte};
  // An all-reduce of n floats over the world: beyond the ring's messages, the additions.
  const int n = sizes.back() / 4, world = mpi.size();
  std::vector<float> v(size_t(n), 1.0f);
  double t = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    MPI_Allreduce(MPI_IN_PLACE, v.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    t = std::min(t, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const double share = double(world - 1) / world, wire = 2 * share * sizes.back();
  p.reduce_rate = std::max(0.0, (t - 2 * (world - 1) * p.intra_node.latency - wire / p.intra_node.bandwidth) /
                                    (share * n));
  p.inter_node = p.intra_node;
}

}  // namespace

void write_device_profile(const Config& cfg, const TrainResult& r, Ops& ops, const MpiEnv& mpi,
                          const std::string& path) {
  if (mpi.size() < 2) fail("--profile-out measures the link between two ranks: run it under mpirun -np 2 (or more)");
  if (cfg.parallel.pp != 1) fail("--profile-out prices the ops of a whole model on one rank: use parallel.pp = 1");
  DeviceProfile p;
  measure_link(p, mpi);
  if (mpi.rank() != 0) return;
  const GptDims d = make_dims(cfg, cfg.model.vocab_size > 0 ? cfg.model.vocab_size : 50257);
  const int dp = cfg.dp(mpi.size());
  const int m = cfg.training.global_batch / (dp * cfg.training.micro_batch);
  const Work w = step_work(cfg, d, 0, m, double(r.memory.params) / 4, double(r.memory.optimizer) / 8);
  // The profiled step's op times by the unit that prices them.
  double gemm = 0, ew = 0, af = 0, ab = 0, ce = 0, opt = 0, zero = 0;
  for (const OpTime& o : r.op_times) {
    const std::string& n = o.op;
    if (n.find("linear") != std::string::npos || n == "gemm") gemm += o.seconds;
    else if (n == "attention_forward" || n == "attention_block_forward" || n == "attention_merge") af += o.seconds;
    else if (n == "attention_backward" || n == "attention_block_backward") ab += o.seconds;
    else if (n.find("crossentropy") != std::string::npos || n.find("softmax_shard") != std::string::npos) ce += o.seconds;
    else if (n == "adamw" || n == "sum_squares" || n == "scale") opt += o.seconds;
    else if (n == "fill") zero += o.seconds;
    else ew += o.seconds;
  }
  auto per = [](double t, double units) { return units > 0 ? t / units : 0.0; };
  p.ops = {per(ew, w.elementwise), per(af, w.attention_fwd), per(ab, w.attention_bwd), per(ce, w.crossentropy),
           per(opt, w.optimizer), per(zero, w.grad_zero)};
  const auto [masked_fwd, masked_bwd] = masked_attention_ratio(cfg, d, ops);
  p.ops.masked_attention_fwd = p.ops.attention_fwd * masked_fwd, p.ops.masked_attention_bwd = p.ops.attention_bwd * masked_bwd;
  p.gemm = sweep_gemms(cfg, d, ops);
  p.gemm_in_model = gemm / w.gemm_seconds(p);
  for (const GemmSample& s : p.gemm) p.peak_flops = std::max(p.peak_flops, s.flops() / s.seconds);
  const bool cpu = ops.device() == Device::CPU;
  p.shared_cores = cpu ? int(std::thread::hardware_concurrency()) : 0;
  p.name = cpu ? fmt::format("cpu_{}core", p.shared_cores) : ops.name();
  const std::time_t now = std::time(nullptr);
  char date[16];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::localtime(&now));
  p.source = fmt::format("mpigpt bench --profile-ops --profile-out on {} ({}), {} ranks, {} thread(s) per rank, {}: ops "
                         "from the profiled step of {} layers x {} channels, micro-batch {} x {}; GEMMs timed alone "
                         "(best of 3); links by ping-pong between ranks 0 and 1 (inter_node = intra_node: one node)",
                         ops.name(), dtype_name(d.act), mpi.size(), omp_get_max_threads(),
                         date, d.L, d.C, cfg.training.micro_batch, d.T);
  std::ofstream(path) << to_json(p);
  log_line("bench: device profile written to {} (GEMMs in the model at {:.2f} x the plain GEMMs' time)", path,
           p.gemm_in_model);
}

}  // namespace mpigpt::app
