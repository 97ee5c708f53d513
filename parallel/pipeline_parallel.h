// Pipeline parallelism: the executor that runs one rank's action list (schedule.h) over the
// pipeline group, and the stage interface through which it drives the model.
#pragma once
#include <utility>
#include <vector>

#include "lib/core/tensor.h"
#include "parallel/comm.h"
#include "parallel/schedule.h"

namespace mpigpt {

class Ops;

// The part of the model one pipeline rank holds (its vpp chunks), as the executor sees it.
// parallel/ never knows the GPT: the trainer implements PipelineStage for its model chunks, and
// one executor runs any schedule.
// Every call names the micro-batch and this rank's model chunk. The stage keeps, per
// (micro-batch, chunk), whatever its backward needs; the executor only moves tensors between
// neighbouring stages. Virtual stage 0 reads its own tokens (no forward_input) and the last
// virtual stage computes the loss and starts the backward itself (no backward_input).
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // Where the activation received for (mb, chunk) is written; it must stay valid until
  // backward(mb, chunk), because the backward needs its input.
  virtual Tensor forward_input(int mb, int chunk) = 0;
  // Run the chunk forward for micro-batch mb (its input has arrived, or it is virtual stage 0).
  virtual void forward(int mb, int chunk) = 0;
  // The activation forward(mb, chunk) produced, to send to the next virtual stage. The executor
  // copies it before the stage's next forward or backward, which may reuse that memory.
  virtual Tensor forward_output(int mb, int chunk) = 0;
  // Where the gradient of (mb, chunk)'s output is written, received from the next stage.
  virtual Tensor backward_input(int mb, int chunk) = 0;
  // Run the chunk backward for micro-batch mb, accumulating its weight gradients.
  virtual void backward(int mb, int chunk) = 0;
  // The gradient of (mb, chunk)'s input, to send to the previous stage; copied like
  // forward_output.
  virtual Tensor backward_output(int mb, int chunk) = 0;
};

// Run this rank's actions in order (`mine` = make_schedule(...)[pp_group.rank()]): compute
// calls the stage, a send copies the stage's tensor into a buffer of the executor and sends it
// without blocking, a receive blocks with the stage's buffer as destination. Returns when every
// send has completed. Checks first, without communicating, that the list names its neighbours
// as peers and sends and receives each link's micro-batches in increasing order (what makes
// MPI's in-order matching pair them correctly); throws mpigpt::Error otherwise. When the group
// moves device tensors with NCCL, check_p2p_order runs too.
// The stage's tensors live on the host or on the device; device tensors need `ops` (their
// backend), which makes the send copies on its stream. With NCCL "blocking" and "completed"
// are in stream order (comm.h): the compute stream waits, the host does not.
void run_schedule(const std::vector<Action>& mine, PipelineStage& stage, const Comm& pp_group, Ops* ops = nullptr);

// The messages (tag, micro-batch) that this pipeline rank sends to `peer` (sends) or receives
// from it (!sends), in the order of its action list.
std::vector<std::pair<int, int>> p2p_sequence(const std::vector<Action>& mine, int rank, int pp, int peer,
                                              bool sends);
// NCCL pairs the messages between two ranks by their order, not by tag (comm.h), so a schedule
// it runs must send each pair's messages in the order the receiver receives them. Checks that
// with the neighbours (a few small MPI messages, collective over the group); every rank of the
// group throws when one pair differs.
void check_p2p_order(const std::vector<Action>& mine, const Comm& pp_group);

// Messages use MPI tags kPipelineTagBase + 2 * (lower virtual stage of the pair) + direction;
// the offset keeps them apart from other point-to-point traffic on the pipeline communicator
// that uses Comm's default tag 0 or other small tags. check_p2p_order uses kPipelineTagBase - 1.
constexpr int kPipelineTagBase = 1000;

}  // namespace mpigpt
