// The pipeline executor: runs one rank's schedule over the pipeline group's Comm.
#include "parallel/pipeline_parallel.h"

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "lib/core/error.h"
#include "lib/kernels/buffer.h"

namespace mpigpt {

namespace {

bool is_compute(ActionType t) { return t == ActionType::Forward || t == ActionType::Backward; }

// The tag names the link: the virtual-stage boundary the message crosses and its direction.
// Both ends compute it from their own chunk, so no micro-batch goes into it and it stays far
// below MPI_TAG_UB; the micro-batches of one link are told apart by their order (checked).
int tag_of(const Action& a, int rank, int pp) {
  const int s = virtual_stage(pp, rank, a.chunk);
  switch (a.type) {
    case ActionType::SendForward: return kPipelineTagBase + 2 * s;
    case ActionType::RecvForward: return kPipelineTagBase + 2 * (s - 1);
    case ActionType::SendBackward: return kPipelineTagBase + 2 * (s - 1) + 1;
    case ActionType::RecvBackward: return kPipelineTagBase + 2 * s + 1;
    default: return -1;
  }
}

// The pipeline rank at the other end of a message of this type: activations go to the next
// rank, gradients to the previous one (the ring wraps for interleaved chunks).
int neighbour(ActionType t, int rank, int pp) {
  const bool to_next = t == ActionType::SendForward || t == ActionType::RecvBackward;
  return to_next ? (rank + 1) % pp : (rank + pp - 1) % pp;
}

int mpi_tag_ub() {
  void* value = nullptr;
  int found = 0;
  MPIGPT_MPI(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &found));
  return found ? *static_cast<int*>(value) : 32767;  // 32767: the least the MPI standard allows
}

// Everything that can be checked locally before the first message, so that a malformed list
// fails on every rank that holds one instead of leaving its peers waiting.
void check_actions(const std::vector<Action>& mine, int rank, int pp) {
  const int tag_ub = mpi_tag_ub();
  std::map<std::pair<bool, int>, int> last_mb;  // (is send, tag) -> the last micro-batch on that link
  for (const Action& a : mine) {
    if (a.mb < 0 || a.chunk < 0)
      fail("run_schedule: pipeline rank {} got {} with a negative micro-batch or chunk", rank, to_string(a));
    if (is_compute(a.type)) continue;
    const int peer = neighbour(a.type, rank, pp);
    if (a.peer != peer)
      fail("run_schedule: pipeline rank {} got {}, but that message goes to or comes from rank {}", rank,
           to_string(a), peer);
    const int tag = tag_of(a, rank, pp);
    if (tag < kPipelineTagBase)
      fail("run_schedule: pipeline rank {} got {} on virtual stage 0, which has no previous stage", rank,
           to_string(a));
    if (tag > tag_ub)
      fail("run_schedule: {} needs MPI tag {}, above this MPI's MPI_TAG_UB = {}; reduce parallel.pp * "
           "parallel.vpp", to_string(a), tag, tag_ub);
    const bool send = a.type == ActionType::SendForward || a.type == ActionType::SendBackward;
    auto [it, first] = last_mb.try_emplace({send, tag}, a.mb);
    if (!first) {
      if (a.mb <= it->second)
        fail("run_schedule: pipeline rank {} runs {} after micro-batch {} on the same link; MPI pairs the "
             "messages of one link in order, so a schedule must send and receive them in increasing "
             "micro-batch order",
             rank, to_string(a), it->second);
      it->second = a.mb;
    }
  }
}

// A send in flight and the copy it sends from, in host or in device memory. The copies are
// declared first so that they are destroyed last: Request's destructor waits for the send before
// the memory goes (on the device: the compute stream waits for the send, and the allocator hands
// the memory only to work queued after that).
struct PendingSend {
  std::unique_ptr<std::byte[]> host;
  Buffer device;
  Request request;
};

PendingSend post_send(const Comm& comm, Ops* ops, Tensor t, int peer, int tag, const Action& a) {
  MPIGPT_CHECK(t.defined() || t.numel() == 0, "{}: the stage gave an undefined tensor", to_string(a));
  PendingSend p;
  Tensor copy;
  if (t.device == Device::CPU) {
    p.host = std::make_unique_for_overwrite<std::byte[]>(t.nbytes());
    if (t.nbytes() > 0) std::memcpy(p.host.get(), t.ptr, t.nbytes());
    copy = Tensor(p.host.get(), t.shape, t.dtype);
  } else {
    MPIGPT_CHECK(ops && ops->device() == t.device,
                 "{}: the stage gave {} on the device; run_schedule needs the stage's ops to copy it (pass them)",
                 to_string(a), t.str());
    p.device = Buffer(*ops, t.nbytes());
    copy = p.device.tensor(t.shape, t.dtype);
    if (t.numel() > 0) ops->copy(copy, t);  // on the compute stream, which the send waits for
  }
  p.request = comm.isend(copy, peer, tag);
  return p;
}

void recv_into(const Comm& comm, Tensor t, int peer, int tag, const Action& a) {
  MPIGPT_CHECK(t.defined() || t.numel() == 0, "{}: the stage gave an undefined tensor", to_string(a));
  comm.recv(t, peer, tag);
}

bool is_send(ActionType t) { return t == ActionType::SendForward || t == ActionType::SendBackward; }
bool is_recv(ActionType t) { return t == ActionType::RecvForward || t == ActionType::RecvBackward; }

}  // namespace

std::vector<std::pair<int, int>> p2p_sequence(const std::vector<Action>& mine, int rank, int pp, int peer,
                                              bool sends) {
  std::vector<std::pair<int, int>> out;
  for (const Action& a : mine)
    if ((sends ? is_send(a.type) : is_recv(a.type)) && a.peer == peer) out.emplace_back(tag_of(a, rank, pp), a.mb);
  return out;
}

void check_p2p_order(const std::vector<Action>& mine, const Comm& pp_group) {
  const int rank = pp_group.rank(), pp = pp_group.size();
  if (pp <= 1) return;
  const MPI_Comm comm = pp_group.mpi();
  constexpr int kTag = kPipelineTagBase - 1;
  std::string error;
  // Ring shifts to the next rank, then to the previous one (the same rank when pp = 2): each
  // rank hands a neighbour the list of what it sends it and compares what it gets with what it
  // receives from that neighbour.
  for (int shift : pp == 2 ? std::vector<int>{1} : std::vector<int>{1, pp - 1}) {
    const int to = (rank + shift) % pp, from = (rank + pp - shift) % pp;
    std::vector<int> out;
    for (const auto& [tag, mb] : p2p_sequence(mine, rank, pp, to, true)) out.insert(out.end(), {tag, mb});
    int n_out = int(out.size()), n_in = 0;
    MPIGPT_MPI(MPI_Sendrecv(&n_out, 1, MPI_INT, to, kTag, &n_in, 1, MPI_INT, from, kTag, comm, MPI_STATUS_IGNORE));
    std::vector<int> in(size_t(n_in) + 1);  // + 1: a valid pointer when empty
    MPIGPT_MPI(MPI_Sendrecv(out.data(), n_out, MPI_INT, to, kTag, in.data(), n_in, MPI_INT, from, kTag, comm,
                            MPI_STATUS_IGNORE));
    const std::vector<std::pair<int, int>> want = p2p_sequence(mine, rank, pp, from, false);
    const size_t n = std::max(want.size(), size_t(n_in / 2));
    for (size_t i = 0; i < n && error.empty(); ++i) {
      const std::string sent = 2 * i < size_t(n_in) ? fmt::format("tag {} micro-batch {}", in[2 * i], in[2 * i + 1])
                                                     : std::string("nothing");
      const std::string got = i < want.size() ? fmt::format("tag {} micro-batch {}", want[i].first, want[i].second)
                                              : std::string("nothing");
      if (sent != got)
        error = fmt::format("run_schedule: message {} from pipeline rank {} to rank {}: the sender sends {}, the "
                            "receiver expects {}; NCCL pairs a pair's messages by order, not by tag, so the schedule "
                            "must receive them in the order they are sent (or use engine.comm = mpi)",
                            i, from, rank, sent, got);
    }
  }
  int bad = error.empty() ? 0 : 1, any = 0;
  MPIGPT_MPI(MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, comm));
  if (any)
    fail("{}", bad ? error
                   : std::string("run_schedule: another pipeline rank receives its messages in another order than "
                                 "they are sent (its message says which); NCCL pairs them by order"));
}

void run_schedule(const std::vector<Action>& mine, PipelineStage& stage, const Comm& pp_group, Ops* ops) {
  const int rank = pp_group.rank(), pp = pp_group.size();
  MPIGPT_CHECK(pp >= 1, "run_schedule: this rank is not in the pipeline group");
  check_actions(mine, rank, pp);
  if (pp_group.uses_nccl()) check_p2p_order(mine, pp_group);

  // An activation's send has surely completed once the gradient for it came back (the peer
  // received it before its forward), so its copy is freed then; the copies held at once are
  // thus bounded by the activations in flight. A gradient's copy is freed once its send tests
  // complete (checked at every gradient send): the previous stage receives it at its next
  // backward, so only the latest few are held, not one per micro-batch of the step.
  std::map<std::pair<int, int>, PendingSend> activations;  // (mb, chunk) -> its forward send
  std::vector<PendingSend> gradients;
  for (const Action& a : mine) {
    const int tag = tag_of(a, rank, pp);
    switch (a.type) {
      case ActionType::Forward: stage.forward(a.mb, a.chunk); break;
      case ActionType::Backward: stage.backward(a.mb, a.chunk); break;
      case ActionType::RecvForward: recv_into(pp_group, stage.forward_input(a.mb, a.chunk), a.peer, tag, a); break;
      case ActionType::SendForward: {
        PendingSend p = post_send(pp_group, ops, stage.forward_output(a.mb, a.chunk), a.peer, tag, a);
        activations.insert_or_assign({a.mb, a.chunk}, std::move(p));
        break;
      }
      case ActionType::RecvBackward: {
        recv_into(pp_group, stage.backward_input(a.mb, a.chunk), a.peer, tag, a);
        if (auto it = activations.find({a.mb, a.chunk}); it != activations.end()) {
          it->second.request.wait();
          activations.erase(it);
        }
        break;
      }
      case ActionType::SendBackward:
        std::erase_if(gradients, [](PendingSend& p) { return p.request.test(); });
        gradients.push_back(post_send(pp_group, ops, stage.backward_output(a.mb, a.chunk), a.peer, tag, a));
        break;
    }
  }
  for (auto& [key, p] : activations) p.request.wait();
  for (PendingSend& p : gradients) p.request.wait();
}

}  // namespace mpigpt
