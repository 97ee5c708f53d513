// Pipeline parallelism: the executor that runs one rank's action list (schedule.h) over the
// pipeline group, and the stage interface through which it drives the model. parallel/ never
// knows the GPT: the trainer implements PipelineStage for its model chunks, and one executor
// runs any schedule.
#pragma once
#include <vector>

#include "lib/core/tensor.h"
#include "parallel/comm.h"
#include "parallel/schedule.h"

namespace mpigpt {

// The part of the model one pipeline rank holds (its vpp chunks), as the executor sees it.
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
// MPI's in-order matching pair them correctly); throws mpigpt::Error otherwise. Host memory
// only, like Comm's MPI backend.
void run_schedule(const std::vector<Action>& mine, PipelineStage& stage, const Comm& pp_group);

// Messages use MPI tags kPipelineTagBase + 2 * (lower virtual stage of the pair) + direction;
// the offset keeps them apart from other point-to-point traffic on the pipeline communicator
// that uses Comm's default tag 0 or other small tags.
constexpr int kPipelineTagBase = 1000;

}  // namespace mpigpt
