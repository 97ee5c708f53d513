// The compute backend of a run, made once in app/ beside the Mesh and passed down as the Mesh is.
#pragma once
#include <memory>
#include <string>

#include "io/config/config.h"
#include "lib/kernels/ops.h"
#include "parallel/mesh.h"
#include "parallel/mpi_env.h"

namespace mpigpt::app {

// engine.backend's ops: the CPU backend, or the CUDA backend on this rank's GPU (chosen by its place
// on `node`) with engine.gemm_autotune and engine.attention_backend.
std::unique_ptr<Ops> make_backend(const Config& cfg, const NodeRanks& node);

// The CUDA backend's device communication (engine.comm, engine.nccl_init) for every group of the
// mesh, ordered against the ops' stream; nothing for the CPU backend. Rank 0 logs how long NCCL took
// unless quiet.
void bind_device_comm(const Config& cfg, Mesh& mesh, const Ops& ops, bool quiet);

// Which kernels run the model's causal attention and why, for the start-up log; fails where
// engine.attention_backend = cudnn cannot be honoured.
std::string describe_attention(const Config& cfg, Ops& ops);

}  // namespace mpigpt::app
