// Communicator construction for the mesh.
#include "parallel/mesh.h"

#include "lib/core/watchdog.h"

namespace mpigpt {

static int world_size_of(MPI_Comm c) {
  int n = 1;
  MPIGPT_MPI(MPI_Comm_size(c, &n));
  return n;
}

static int world_rank_of(MPI_Comm c) {
  int r = 0;
  MPIGPT_MPI(MPI_Comm_rank(c, &r));
  return r;
}

Mesh::Mesh(MPI_Comm world, const MeshSizes& sizes)
    : sizes_(sizes),
      rank_(world_rank_of(world)),
      world_size_(world_size_of(world)),
      dense_(dense_grid(sizes, world_size_)),
      expert_(expert_grid(sizes, world_size_)),
      world_(world),
      tp_(split(dense_, "tp")),
      cp_(split(dense_, "cp")),
      dp_(split(dense_, "dp")),
      dp_cp_(split(dense_, "dp-cp")),
      pp_(split(dense_, "pp")),
      mp_(split(dense_, "tp-pp")),
      tp_dp_cp_(split(dense_, "tp-dp-cp")),
      tp_cp_(split(dense_, "tp-cp")),
      embd_(MPI_COMM_NULL),
      etp_(split(expert_, "tp")),
      ep_(split(expert_, "ep")),
      edp_(split(expert_, "dp")),
      etp_ep_(split(expert_, "tp-ep")) {
  coords_ = {dense_.coord(rank_, "tp"), dense_.coord(rank_, "cp"), expert_.coord(rank_, "ep"),
             dense_.coord(rank_, "dp"), dense_.coord(rank_, "pp"), expert_.coord(rank_, "tp"),
             expert_.coord(rank_, "dp")};
  // Embedding group: the first and the last stage of this rank's pipeline.
  const bool edge = coords_.pp == 0 || coords_.pp == sizes_.pp - 1;
  const MPI_Comm e = split(edge ? dense_.group_index(rank_, "pp") : MPI_UNDEFINED, rank_, "embedding");
  if (e != MPI_COMM_NULL) embd_ = Comm(e);
}

Mesh::~Mesh() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Comm& c : owned_) MPI_Comm_free(&c);
}

MPI_Comm Mesh::split(const RankGrid& g, const std::string& group) {
  return split(g.group_index(rank_, group), g.group_rank(rank_, group), (&g == &expert_ ? "expert " : "") + group);
}

// One MPI_Comm_split of the world, a wait the watchdog watches; the communicator (MPI_COMM_NULL
// for colour MPI_UNDEFINED) is named for messages ("dp", "expert tp-ep"; Comm::label()).
MPI_Comm Mesh::split(int colour, int key, const std::string& name) {
  MPI_Comm c = MPI_COMM_NULL;
  {
    const Waiting w([&name] { return "MPI_Comm_split of the world into the " + name + " groups"; });
    MPIGPT_MPI(MPI_Comm_split(world_.mpi(), colour, key, &c));
  }
  if (c == MPI_COMM_NULL) return c;
  MPIGPT_MPI(MPI_Comm_set_name(c, name.c_str()));
  owned_.push_back(c);
  return c;
}

std::vector<int> Mesh::ep_of_member() const {
  std::vector<int> out;
  for (int r : expert_.members(rank_, "tp-ep")) out.push_back(expert_.coord(r, "ep"));
  return out;
}

std::string Mesh::describe() const { return describe_rank(sizes_, world_size_, rank_); }

void Mesh::enable_device_comm(CommBackend backend, void* compute_stream) {
  // Member order: the same on every rank, which is what keeps the NCCL bootstraps (each
  // blocking until its whole group joins) from waiting on each other.
  Comm* all[] = {&world_, &tp_,    &cp_,  &dp_, &dp_cp_, &pp_, &mp_,
                 &tp_dp_cp_, &tp_cp_, &embd_, &etp_, &ep_, &edp_, &etp_ep_};
  for (Comm* c : all) {
    const bool p2p = c == &pp_ || c == &cp_;  // the groups that send point to point
    if (backend == CommBackend::Mpi)
      c->use_staging(compute_stream);
    else if (backend == CommBackend::Nccl || c == &world_)
      c->use_nccl(compute_stream, p2p);
    else
      c->use_nccl_split(compute_stream, p2p, world_);
  }
}

}  // namespace mpigpt
