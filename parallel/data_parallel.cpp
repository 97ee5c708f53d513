// Gradient buckets, their reduction over the data-parallel group and the parameter all-gather of
// the distributed optimizer.
#include "parallel/data_parallel.h"

#include <algorithm>

#include "lib/core/error.h"

namespace mpigpt {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

// ---- ranges ---------------------------------------------------------------------------------

std::vector<Range> normalize_ranges(std::vector<Range> r) {
  std::erase_if(r, [](const Range& x) { return x.empty(); });
  std::sort(r.begin(), r.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Range> out;
  for (const Range& x : r) {
    if (!out.empty() && x.begin <= out.back().end)
      out.back().end = std::max(out.back().end, x.end);
    else
      out.push_back(x);
  }
  return out;
}

std::vector<Range> intersect_ranges(const std::vector<Range>& a, const std::vector<Range>& b) {
  const std::vector<Range> x = normalize_ranges(a), y = normalize_ranges(b);
  std::vector<Range> out;
  for (size_t i = 0, j = 0; i < x.size() && j < y.size();) {
    const Range r{std::max(x[i].begin, y[j].begin), std::min(x[i].end, y[j].end)};
    if (!r.empty()) out.push_back(r);
    if (x[i].end < y[j].end)  // drop the one that ends first
      ++i;
    else
      ++j;
  }
  return normalize_ranges(std::move(out));  // pieces of one range can touch across the other's gaps
}

int64_t total_size(const std::vector<Range>& r) {
  int64_t n = 0;
  for (const Range& x : r) n += std::max<int64_t>(x.size(), 0);
  return n;
}

// ---- the buffer plan ------------------------------------------------------------------------

std::vector<Range> BufferLayout::param_ranges() const {
  std::vector<Range> r;
  for (size_t i = 0; i < offsets.size(); ++i) r.push_back(param_range(int(i)));
  return normalize_ranges(std::move(r));
}

Range BufferLayout::slice(int b, int r) const {
  const Bucket& k = buckets[b];
  const int64_t n = k.numel() / dp;
  return {k.begin + r * n, k.begin + (r + 1) * n};
}

BufferLayout plan_buffer(const std::vector<int64_t>& numels, int64_t bucket_elems, int dp, int64_t align) {
  MPIGPT_CHECK(dp >= 1 && align >= 1, "plan_buffer: dp {} and align {} must be positive", dp, align);
  BufferLayout L;
  L.numels = numels;
  L.offsets.assign(numels.size(), 0);
  L.dp = dp;
  L.align = align;
  const int n = int(numels.size());
  for (int i = 0; i < n; ++i)
    MPIGPT_CHECK(numels[i] >= 0, "plan_buffer: parameter {} has {} elements", i, numels[i]);

  // Form buckets walking backwards: (first, last) pairs, the last parameters' bucket first.
  std::vector<std::pair<int, int>> formed;
  int64_t acc = 0;
  int last = n - 1;
  for (int i = n - 1; i >= 0; --i) {
    acc += numels[i];
    if (bucket_elems > 0 && acc >= bucket_elems) {
      formed.push_back({i, last});
      last = i - 1;
      acc = 0;
    }
  }
  if (last >= 0) {
    if (acc == 0 && !formed.empty())
      formed.back().first = 0;  // only empty parameters left: no bucket of zero elements
    else
      formed.push_back({0, last});
  }

  // Lay them out in buffer order; every bucket begins on a multiple of dp * align.
  int64_t off = 0;
  for (auto it = formed.rbegin(); it != formed.rend(); ++it) {
    Bucket k;
    k.begin = off;
    k.first_param = it->first;
    k.last_param = it->second;
    for (int p = k.first_param; p <= k.last_param; ++p) {
      off = round_up(off, align);
      L.offsets[p] = off;
      off += numels[p];
    }
    k.end = off = round_up(off, int64_t(dp) * align);
    L.buckets.push_back(k);
  }
  L.total = off;
  return L;
}

std::vector<Range> owned_ranges(const BufferLayout& layout, bool distributed_optimizer, int rank) {
  if (!distributed_optimizer) return normalize_ranges({{0, layout.total}});
  MPIGPT_CHECK(rank >= 0 && rank < layout.dp, "owned_ranges: rank {} outside dp {}", rank, layout.dp);
  std::vector<Range> r;
  for (int b = 0; b < int(layout.buckets.size()); ++b) r.push_back(layout.slice(b, rank));
  return normalize_ranges(std::move(r));
}

DpMemory dp_memory(const BufferLayout& layout, bool distributed_optimizer, int rank) {
  const std::vector<Range> own = owned_ranges(layout, distributed_optimizer, rank);
  return {layout.total * 4, layout.total * 4, total_size(intersect_ranges(own, layout.param_ranges())) * 8};
}

// ---- gradient reduction and parameter gather ------------------------------------------------

GradSync::GradSync(const Comm& group, BufferLayout layout, Tensor params, Tensor grads, GradSyncOptions opts,
                   Tensor gather)
    : comm_(group), layout_(std::move(layout)), params_(params), grads_(grads), gather_(gather.ptr ? gather : params),
      opts_(opts) {
  for (const Tensor* t : {&params_, &grads_})
    MPIGPT_CHECK(t->dtype == DType::F32 && t->numel() == layout_.total,
                 "GradSync: params/grads must be f32 of the layout's {} elements, got {}", layout_.total, t->str());
  MPIGPT_CHECK(gather_.numel() == layout_.total && gather_.device == params_.device,
               "GradSync: the gather buffer {} must hold the layout's {} elements where params {} live", gather_.str(),
               layout_.total, params_.str());
  MPIGPT_CHECK(group.size() >= 1, "GradSync: this rank is not in the data-parallel group");
  if (opts_.distributed_optimizer)
    MPIGPT_CHECK(layout_.dp == group.size(),
                 "GradSync: the buffer was planned for dp {} but the group has {} ranks; plan_buffer with the "
                 "size of the gradient-reduction group (dp x cp)", layout_.dp, group.size());
  active_ = group.size() > 1;
  owned_ = mpigpt::owned_ranges(layout_, opts_.distributed_optimizer, opts_.distributed_optimizer ? group.rank() : 0);
  state_.resize(layout_.buckets.size());
  reset_marks();
}

DpMemory GradSync::memory() const {
  return dp_memory(layout_, opts_.distributed_optimizer, opts_.distributed_optimizer ? comm_.rank() : 0);
}

double GradSync::sum_over_owners(double local) const {
  if (active_ && opts_.distributed_optimizer) comm_.allreduce_sum(&local, 1);
  return local;
}

// Padding is never written by backward: it starts out counted as final.
void GradSync::reset_marks() {
  for (size_t b = 0; b < state_.size(); ++b) {
    const Bucket& k = layout_.buckets[b];
    std::vector<Range>& ready = state_[b].ready;
    ready.clear();
    int64_t at = k.begin;
    for (int p = k.first_param; p <= k.last_param; ++p) {
      ready.push_back({at, layout_.offsets[p]});
      at = std::max(at, layout_.offsets[p] + layout_.numels[p]);
    }
    ready.push_back({at, k.end});
    ready = normalize_ranges(std::move(ready));
  }
  next_ = int(state_.size()) - 1;
}

bool GradSync::complete(int b) const {
  const Bucket& k = layout_.buckets[b];
  const std::vector<Range>& r = state_[b].ready;
  return k.numel() == 0 || (r.size() == 1 && r[0] == Range{k.begin, k.end});
}

// Starts buckets in the one fixed order (last to first) while the next one is complete, or all.
void GradSync::start_ready(bool all) {
  for (; next_ >= 0 && (all || complete(next_)); --next_) {
    const Bucket& k = layout_.buckets[next_];
    if (k.numel() == 0) continue;
    Tensor t = grads_.flat_slice(k.begin, k.numel());
    state_[next_].grads = opts_.distributed_optimizer ? comm_.ireduce_scatter_sum_inplace(t) : comm_.iallreduce_sum(t);
  }
}

// Lets MPI advance the collectives in flight (it has no progress thread of its own); NCCL's run
// on their own, so for them this only notes which have finished.
void GradSync::progress() {
  for (BucketState& s : state_) {
    if (!s.grads.done()) s.grads.test();
    if (!s.params.done()) s.params.test();
  }
}

void GradSync::grads_ready(int64_t begin, int64_t end) {
  MPIGPT_CHECK(0 <= begin && begin <= end && end <= layout_.total, "grads_ready: [{}, {}) outside the buffer of {}",
               begin, end, layout_.total);
  if (!active_ || !opts_.overlap_grad_reduce) return;  // nothing to overlap: finish_grad_sync does it all
  for (int b = 0; b < int(state_.size()); ++b) {
    const Bucket& k = layout_.buckets[b];
    const Range r{std::max(begin, k.begin), std::min(end, k.end)};
    if (r.empty()) continue;
    state_[b].ready.push_back(r);
    state_[b].ready = normalize_ranges(std::move(state_[b].ready));
  }
  start_ready(false);
  progress();
}

void GradSync::finish_grad_sync() {
  if (!active_) return;
  wait_all_params();
  start_ready(true);
  for (BucketState& s : state_) s.grads.wait();
  reset_marks();
}

void GradSync::gather_params() {
  if (!active_ || !opts_.distributed_optimizer) return;
  wait_all_params();  // a gather still in flight would race with the one we start
  for (size_t b = 0; b < state_.size(); ++b) {
    const Bucket& k = layout_.buckets[b];
    if (k.numel() > 0) state_[b].params = comm_.iall_gather_inplace(gather_.flat_slice(k.begin, k.numel()));
  }
  masters_stale_ = gather_.ptr != params_.ptr;
  if (!opts_.overlap_param_gather) wait_all_params();
}

void GradSync::gather_masters() {
  if (!masters_stale_) return;
  for (const Bucket& k : layout_.buckets)
    if (k.numel() > 0) comm_.all_gather_inplace(params_.flat_slice(k.begin, k.numel()));
  masters_stale_ = false;
}

void GradSync::wait_params(int64_t begin, int64_t end) {
  if (!active_ || !opts_.distributed_optimizer) return;
  for (size_t b = 0; b < state_.size(); ++b) {
    const Bucket& k = layout_.buckets[b];
    if (k.begin < end && begin < k.end) state_[b].params.wait();
  }
  progress();
}

void GradSync::wait_all_params() {
  for (BucketState& s : state_) s.params.wait();
}

bool GradSync::params_pending() const {
  return std::any_of(state_.begin(), state_.end(), [](const BucketState& s) { return !s.params.done(); });
}

}  // namespace mpigpt
