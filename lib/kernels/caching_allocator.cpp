// CachingAllocator (see caching_allocator.h): segments from a raw allocator cut into blocks,
// best-fit reuse with splitting, merging of free neighbours, empty-and-retry on exhaustion.
#include "lib/kernels/caching_allocator.h"

#include <algorithm>
#include <utility>

#include "lib/core/error.h"

// In a sanitizer build of the host emulator (MPIGPT_POISON_CACHED_BLOCKS: `make test-sanitize`,
// where "device" memory is host memory) every byte of a segment that is not part of a live
// allocation is poisoned for AddressSanitizer: the free blocks and the rounding tail of each live
// one. A kernel that reads or writes past its tensor, into a neighbour's block or a cached one, is
// then reported where it happens; on a GPU it would silently use another tensor's bytes. Not with
// real device memory, whose addresses may lie where AddressSanitizer keeps no shadow.
#if MPIGPT_POISON_CACHED_BLOCKS
#include <sanitizer/asan_interface.h>
#define MPIGPT_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define MPIGPT_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define MPIGPT_POISON(p, n) ((void)(p), (void)(n))
#define MPIGPT_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace mpigpt {

CachingAllocator::CachingAllocator(RawAlloc raw_alloc, RawFree raw_free)
    : raw_alloc_(std::move(raw_alloc)), raw_free_(std::move(raw_free)) {
  MPIGPT_CHECK(raw_alloc_ && raw_free_, "CachingAllocator needs both a raw alloc and a raw free callback");
}

CachingAllocator::~CachingAllocator() {
  for (Block* head : segments_) {
    // A destructor must not throw: a failing raw free (a dead CUDA context at exit) is ignored.
    try {
      size_t seg_bytes = 0;  // the segment's blocks, live ones included, add up to it
      for (const Block* b = head; b; b = b->next) seg_bytes += b->size;
      MPIGPT_UNPOISON(head->ptr, seg_bytes);
      raw_free_(head->ptr);
    } catch (...) {
    }
    for (Block* b = head; b;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes <= kRound) return kRound;  // 0 bytes still gets a block of its own
  return (bytes + kRound - 1) / kRound * kRound;
}

size_t CachingAllocator::segment_size(size_t rounded) {
  if (rounded <= kSmallRequest) return kSmallSegment;
  if (rounded < kMediumRequest) return kLargeSegment;
  return (rounded + kLargeRound - 1) / kLargeRound * kLargeRound;
}

CachingAllocator::Block* CachingAllocator::take_free(size_t rounded, bool small) {
  FreeSet& free = pool(small);
  Block key;
  key.size = rounded;
  key.ptr = nullptr;
  auto it = free.lower_bound(&key);  // smallest block >= rounded, lowest address first
  if (it == free.end()) return nullptr;
  Block* b = *it;
  free.erase(it);
  return b;
}

void* CachingAllocator::raw_alloc_or_null(size_t bytes) {
  void* p = raw_alloc_(bytes);
  if (!p) ++stats_.raw_failures;
  return p;
}

CachingAllocator::Block* CachingAllocator::new_segment(size_t rounded, bool small) {
  const size_t seg = segment_size(rounded);
  size_t got = seg;
  void* p = raw_alloc_or_null(seg);
  if (!p) {
    // Cached free segments may be what fills the device: give them back and try again.
    empty_cache_locked();
    p = raw_alloc_or_null(seg);
  }
  if (!p && seg > rounded) {
    // The padding of a medium/small segment may be what does not fit; the exact size might.
    got = rounded;
    p = raw_alloc_or_null(rounded);
  }
  if (!p) return nullptr;
  MPIGPT_POISON(p, got);
  Block* b = new Block;
  b->ptr = static_cast<char*>(p);
  b->size = got;
  b->small = small;
  segments_.push_back(b);
  ++stats_.raw_allocs;
  ++stats_.segments;
  stats_.reserved += got;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  return b;
}

// Cut b down to `rounded` bytes when the remainder is worth a block of its own; the remainder
// goes back to the free set of b's pool.
void CachingAllocator::split(Block* b, size_t rounded) {
  const size_t rest = b->size - rounded;
  const bool worth = b->small ? rest >= kRound : rest > kSmallRequest;
  if (!worth) return;
  Block* r = new Block;
  r->ptr = b->ptr + rounded;
  r->size = rest;
  r->small = b->small;
  r->prev = b;
  r->next = b->next;
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = rounded;
  pool(r->small).insert(r);
}

void* CachingAllocator::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t rounded = round_size(bytes);
  const bool small = rounded <= kSmallRequest;
  Block* b = take_free(rounded, small);
  if (b) {
    ++stats_.cache_hits;
  } else {
    b = new_segment(rounded, small);
    if (!b) return nullptr;
  }
  split(b, rounded);
  MPIGPT_UNPOISON(b->ptr, bytes);
  b->allocated = true;
  live_.emplace(b->ptr, b);
  ++stats_.allocations;
  ++stats_.blocks_in_use;
  stats_.in_use += b->size;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
  return b->ptr;
}

void CachingAllocator::release(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  if (it == live_.end())
    fail("CachingAllocator::release: pointer {} was not handed out by this allocator or was already released", p);
  Block* b = it->second;
  live_.erase(it);
  MPIGPT_POISON(b->ptr, b->size);
  b->allocated = false;
  --stats_.blocks_in_use;
  stats_.in_use -= b->size;
  FreeSet& free = pool(b->small);
  // Merge with free neighbours. The earlier block of a pair survives, so a segment's first block
  // (the one segments_ points to) is never deleted.
  if (b->next && !b->next->allocated) {
    Block* n = b->next;
    free.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  if (b->prev && !b->prev->allocated) {
    Block* pr = b->prev;
    free.erase(pr);  // its size changes: re-insert below
    pr->size += b->size;
    pr->next = b->next;
    if (b->next) b->next->prev = pr;
    delete b;
    b = pr;
  }
  free.insert(b);
}

void CachingAllocator::empty_cache_locked() {
  // A segment whose blocks are all free has been merged back into its first block alone.
  std::vector<Block*> idle;
  for (Block* head : segments_)
    if (!head->allocated && !head->next) idle.push_back(head);
  for (Block* head : idle) {
    MPIGPT_UNPOISON(head->ptr, head->size);
    raw_free_(head->ptr);  // first: if it throws, the bookkeeping still describes every segment
    pool(head->small).erase(head);
    segments_.erase(std::find(segments_.begin(), segments_.end(), head));
    ++stats_.raw_frees;
    --stats_.segments;
    stats_.reserved -= head->size;
    delete head;
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  empty_cache_locked();
}

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s = stats_;
  s.cached = s.reserved - s.in_use;
  return s;
}

size_t CachingAllocator::block_size(const void* p) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  if (it == live_.end()) fail("CachingAllocator::block_size: pointer {} is not a live block of this allocator", p);
  return it->second->size;
}

}  // namespace mpigpt
