// The Mesh: this rank's place in the rank grid and one communicator per group a GPT trainer
// needs, each an MPI_Comm_split of the world (colour = group index, key = position). Built once
// in main and passed explicitly (DESIGN principle 1): no global accessors.
#pragma once
#include <mpi.h>

#include <string>
#include <vector>

#include "parallel/comm.h"
#include "parallel/rank_grid.h"

namespace mpigpt {

struct Coords {
  int tp = 0, cp = 0, ep = 0, dp = 0, pp = 0;  // dense grid
  int etp = 0, edp = 0;                        // expert grid (its ep coordinate is `ep`)
};

// How device (CUDA) tensors cross ranks: engine.comm = nccl or mpi (staged through the host); with
// NCCL, engine.nccl_init says how each group's communicator is made: its own ncclCommInitRank
// (Nccl) or ncclCommSplit of the world's (NcclSplit).
enum class CommBackend { Mpi, Nccl, NcclSplit };

class Mesh {
 public:
  Mesh(MPI_Comm world, const MeshSizes& sizes);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const MeshSizes& sizes() const { return sizes_; }
  int dp_size() const { return dense_.size("dp"); }
  int expert_dp_size() const { return expert_.size("dp"); }
  const Coords& coords() const { return coords_; }
  const RankGrid& dense() const { return dense_; }
  const RankGrid& expert() const { return expert_; }

  const Comm& world() const { return world_; }
  const Comm& tp() const { return tp_; }
  const Comm& cp() const { return cp_; }
  const Comm& dp() const { return dp_; }
  const Comm& dp_cp() const { return dp_cp_; }      // gradient reduction of dense parameters
  const Comm& pp() const { return pp_; }
  const Comm& mp() const { return mp_; }            // tensor x pipeline (model-parallel)
  const Comm& tp_dp_cp() const { return tp_dp_cp_; }
  const Comm& tp_cp() const { return tp_cp_; }      // tensor x context (the tokens of one micro-batch)
  // First and last pipeline stage of this rank's pipeline (tied embeddings); only valid on
  // those stages (`in_embedding_group()`).
  const Comm& embedding() const { return embd_; }
  bool in_embedding_group() const { return embd_.mpi() != MPI_COMM_NULL; }
  const Comm& expert_tp() const { return etp_; }
  const Comm& ep() const { return ep_; }
  const Comm& expert_dp() const { return edp_; }
  // expert_tp x ep: the ranks that hold one copy of every expert between them (the allgather
  // dispatcher's group); ep_of_member()[i] is the ep rank of its member i.
  const Comm& expert_tp_ep() const { return etp_ep_; }
  std::vector<int> ep_of_member() const;

  // "TP2-CP1-EP1-DP2-PP2 rank 5 = (tp 1, cp 0, ep 0, dp 0, pp 1)"
  std::string describe() const;

  // Every communicator of this rank moves device tensors with `backend`, ordered against
  // `compute_stream` (the CUDA ops' Ops::stream()); call it once the CUDA ops exist (their
  // device is current). Nccl bootstraps one NCCL communicator per group, in one fixed order on
  // every rank (collective over the world), plus point-to-point links in the pipeline and
  // context-parallel groups; NcclSplit bootstraps the world's alone and splits every other group's
  // (and the links) from it, in the same order; Mpi stages through pinned host memory. Calling
  // again rebinds the stream.
  void enable_device_comm(CommBackend backend, void* compute_stream);

 private:
  MPI_Comm split(const RankGrid& g, const std::string& group);
  MPI_Comm split(int colour, int key, const std::string& name);
  MeshSizes sizes_;
  int rank_ = 0, world_size_ = 1;
  RankGrid dense_, expert_;
  Coords coords_;
  std::vector<MPI_Comm> owned_;
  Comm world_, tp_, cp_, dp_, dp_cp_, pp_, mp_, tp_dp_cp_, tp_cp_, embd_, etp_, ep_, edp_, etp_ep_;
};

}  // namespace mpigpt
