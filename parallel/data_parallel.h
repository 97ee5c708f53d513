// Data parallelism: the flat parameter/gradient buffer cut into buckets, the gradient reduction
// over the data-parallel group (all-reduce, or reduce-scatter for the distributed optimizer)
// overlapped with the backward pass, and the all-gather of the updated parameters.
#pragma once
#include <cstdint>
#include <vector>

#include "lib/core/tensor.h"
#include "parallel/comm.h"

namespace mpigpt {

// Elements [begin, end) of a flat buffer.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool operator==(const Range&) const = default;
};

// Sorted, without empty ranges, overlapping or touching ranges merged.
std::vector<Range> normalize_ranges(std::vector<Range> r);
// The elements in both a and b (inputs in any order), normalised.
std::vector<Range> intersect_ranges(const std::vector<Range>& a, const std::vector<Range>& b);
int64_t total_size(const std::vector<Range>& r);  // elements, counting overlaps twice

// Parameters [first_param, last_param] (inclusive) live in elements [begin, end) of the buffer.
struct Bucket {
  int64_t begin = 0, end = 0;
  int first_param = 0, last_param = -1;
  int64_t numel() const { return end - begin; }
};

struct BufferLayout {
  std::vector<int64_t> offsets;  // per parameter: its first element
  std::vector<int64_t> numels;   // per parameter
  std::vector<Bucket> buckets;   // in buffer order; backward completes the last one first
  int64_t total = 0;             // elements of the buffer, padding included
  int dp = 1;                    // every bucket's length is a multiple of dp * align
  int64_t align = 16;            // parameter starts and slices are multiples of this
  // The elements that belong to parameters (everything but padding).
  std::vector<Range> param_ranges() const;
  Range param_range(int i) const { return {offsets[i], offsets[i] + numels[i]}; }
  // Rank r's contiguous 1/dp slice of bucket b.
  Range slice(int b, int r) const;
};

// The buffer of one rank. Parameters keep their order; none is split over buckets. Buckets form
// from the LAST parameter backwards (backward produces gradients roughly last-to-first, so the
// bucket with the last parameters completes first and its reduction starts earliest), a bucket
// closing once its parameters hold >= bucket_elems elements (<= 0: one bucket for everything);
// the first bucket takes what is left. Every parameter starts on a multiple of `align` elements
// and every bucket is padded at its end to a multiple of dp * align, so each rank's slice of a
// bucket is equally long and aligned. Padding belongs to no parameter and stays zero.
BufferLayout plan_buffer(const std::vector<int64_t>& numels, int64_t bucket_elems, int dp, int64_t align = 16);

// What one rank updates and keeps optimizer state for: the whole buffer, or with the
// distributed optimizer its slice of every bucket.
std::vector<Range> owned_ranges(const BufferLayout& layout, bool distributed_optimizer, int rank);

// Bytes one rank holds for the fp32 parameters (also the master weights on the fp32 path), the
// fp32 gradients and AdamW's two fp32 moments (only for the parameter elements it owns).
struct DpMemory {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};
DpMemory dp_memory(const BufferLayout& layout, bool distributed_optimizer, int rank);

struct GradSyncOptions {
  bool distributed_optimizer = false;  // reduce-scatter grads, update a slice, all-gather params
  bool overlap_grad_reduce = false;    // start a bucket's reduction as soon as its grads are final
  bool overlap_param_gather = false;   // gather_params() only starts; wait_params() completes
};

// The gradient reduction and parameter gather of one group, the one gradients are summed over
// (dp x cp ranks for dense parameters). The distributed optimizer is ZeRO-1 as in Megatron-Core's:
// every rank keeps all parameters and gradients but optimizer state, and updates, only for its
// 1/dp slice of every bucket.
//
// One step with the distributed optimizer, as the trainer drives it:
//   forward  : wait_params(chunk range) before a model chunk's first use
//   backward : grads_ready(range) in the LAST micro-batch whenever a range of gradients is final
//   finish_grad_sync()                      owned ranges of grads now hold the sum over the group
//   norm² = sum_over_owners(sum_squares_of(grads, intersect_ranges(owned, counted params)))
//   optimizer step on owned_ranges()
//   gather_params()                         every rank gets every slice back
// In bf16 mixed precision the gather moves the bf16 compute copy instead of the f32 masters (half
// the bytes, as Megatron-Core's distributed optimizer gathers the bf16 parameters): the caller
// converts its owned slices into that copy before gather_params(), and the f32 masters outside
// them are stale until gather_masters() (a checkpoint save calls it).
//
// Device buffers: with NCCL every call here only queues work (comm.h). A bucket's reduction
// starts on the communication stream once the compute work queued before grads_ready() is done,
// so it runs while backward continues on the compute stream; every wait makes the compute
// stream, not the host, wait, so the optimizer step, the gradient norm and the next forward are
// queued behind the reductions and gathers they read. Nothing here touches the buffers from the
// host, and no request carries host work: NCCL's in-place reduce-scatter leaves the result in
// block rank() itself (MPI's detour through block 0 is a host `then` that only the host and
// staged paths take, before the data returns to the device).
class GradSync {
 public:
  // params and grads: this rank's flat f32 buffers (host or device) of layout.total elements,
  // padding zero.
  // With the distributed optimizer layout.dp must equal the group size. `group` must outlive this.
  // gather: what gather_params() moves, in params' layout: params itself (an empty tensor), or a
  // copy of params in a narrower dtype (the bf16 compute weights) that the caller fills at
  // owned_ranges() before each gather_params().
  GradSync(const Comm& group, BufferLayout layout, Tensor params, Tensor grads, GradSyncOptions opts,
           Tensor gather = {});
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  const BufferLayout& layout() const { return layout_; }
  const GradSyncOptions& options() const { return opts_; }
  const std::vector<Range>& owned_ranges() const { return owned_; }
  const Comm& group() const { return comm_; }
  DpMemory memory() const;
  // A sum over owned_ranges() (this rank's part of the squared gradient norm, say) made a sum
  // over the whole buffer: an all-reduce over the group when ownership is split, the value
  // itself otherwise (every rank owns everything, an all-reduce would count it dp times).
  double sum_over_owners(double local) const;

  // Gradient elements [begin, end) are final (last micro-batch): with overlap_grad_reduce each
  // bucket that is now complete starts its reduction. Buckets start strictly last-to-first, so
  // that every rank issues the same collectives in the same order whatever order its calls
  // come in (MPI and NCCL match collectives by order); a bucket completed early waits for the
  // later ones. The grads of a started bucket must not be written again this step.
  void grads_ready(int64_t begin, int64_t end);
  // Starts what has not started, waits for all; afterwards the owned ranges of grads hold the sum
  // over the group (the loss is already divided by the global token count). With the
  // distributed optimizer the other elements of grads hold scratch. Also waits for any
  // parameter gather still in flight (the optimizer step comes next) and clears the ready marks.
  void finish_grad_sync();

  // Distributed optimizer only (no-ops otherwise): after the step, every rank's updated slices
  // go back to all ranks. With overlap_param_gather this only starts the gathers (first bucket
  // first, the order forward needs them) and wait_params must come before the parameters
  // [begin, end) are read; wait_all_params completes everything.
  void gather_params();
  void wait_params(int64_t begin, int64_t end);
  void wait_all_params();
  // Some gather has not been waited for (its parameters must not be read or updated yet).
  bool params_pending() const;
  // A narrow gather (see the constructor) left the f32 params outside owned_ranges() stale.
  bool masters_stale() const { return masters_stale_; }
  // Brings every rank's owned slices of the f32 params to all ranks (blocking), when a narrow
  // gather left them stale: before the whole f32 buffer is read (a checkpoint save).
  void gather_masters();

 private:
  struct BucketState {
    std::vector<Range> ready;  // final gradient elements, padding counted as final
    Request grads, params;     // the reduction and the gather in flight
  };
  bool complete(int b) const;
  void start_ready(bool all);
  void progress();
  void reset_marks();

  const Comm& comm_;
  BufferLayout layout_;
  Tensor params_, grads_, gather_;
  GradSyncOptions opts_;
  std::vector<Range> owned_;
  std::vector<BucketState> state_;
  int next_ = -1;  // the next bucket to start (they start from the last down to 0)
  bool active_ = false;  // more than one rank
  bool masters_stale_ = false;
};

}  // namespace mpigpt
