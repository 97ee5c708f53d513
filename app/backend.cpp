// The compute backend beside the Mesh (see backend.h).
#include "app/backend.h"

#include <fmt/format.h>

#include <chrono>

#include "lib/core/error.h"
#include "lib/core/log.h"
#include "lib/kernels/device_select.h"

namespace mpigpt::app {

std::unique_ptr<Ops> make_backend(const Config& cfg, const NodeRanks& node) {
  if (cfg.engine.backend == "cpu") {
    if (cfg.training.precision != "fp32")
      fail("training.precision = '{}' needs the CUDA backend; use training.precision = fp32 on the CPU",
           cfg.training.precision);
    return make_cpu_ops();
  }
  if (cfg.engine.backend != "cuda")
    fail("engine.backend = '{}' is not available in this build; use engine.backend = cpu", cfg.engine.backend);
  // One rank per GPU, chosen by the rank's place on its node (errors: no GPU, too few).
  const int dev = choose_device(node.local_rank, node.local_size, visible_cuda_devices(),
                                cfg.engine.allow_device_sharing, node.host);
  CudaOptions options;
  options.gemm_autotune = cfg.engine.gemm_autotune;
  const std::string& a = cfg.engine.attention_backend;
  options.attention = a == "cudnn"     ? CudaOptions::Attention::Cudnn
                      : a == "builtin" ? CudaOptions::Attention::Builtin
                                       : CudaOptions::Attention::Default;
  return make_cuda_ops(dev, options);
}

void bind_device_comm(const Config& cfg, Mesh& mesh, const Ops& ops, bool quiet) {
  if (ops.device() != Device::CUDA) return;
  const CommBackend comm = cfg.engine.comm == "mpi"              ? CommBackend::Mpi
                           : cfg.engine.nccl_init == "split" ? CommBackend::NcclSplit
                                                             : CommBackend::Nccl;
  const auto t0 = std::chrono::steady_clock::now();
  mesh.enable_device_comm(comm, ops.stream());
  if (comm != CommBackend::Mpi && mesh.rank() == 0 && !quiet)
    log_line("comm: NCCL communicators of every group made in {:.3f} s ({})",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
             comm == CommBackend::NcclSplit ? "engine.nccl_init = split: ncclCommSplit of the world's"
                                            : "engine.nccl_init = init_rank: one ncclCommInitRank per group");
}

std::string describe_attention(const Config& cfg, Ops& ops) {
  const ParallelConfig& p = cfg.parallel;
  if (p.cp > 1) return fmt::format("the blockwise kernels (parallel.cp = {}: ring attention)", p.cp);
  if (cfg.engine.sequence_packing) return "the blockwise kernels (engine.sequence_packing: masked documents)";
  const ModelConfig& m = cfg.model;
  const int kv = m.num_kv_heads > 0 ? m.num_kv_heads : m.num_heads;
  const DType dt = cfg.training.precision == "bf16" ? DType::BF16 : DType::F32;
  return ops.attention_kernels(cfg.training.micro_batch, m.seq_len, m.num_heads / p.tp, kv / p.tp,
                               m.hidden / m.num_heads, dt);
}

}  // namespace mpigpt::app
