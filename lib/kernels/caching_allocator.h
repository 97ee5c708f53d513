// CachingAllocator: a device-memory cache in front of a slow raw allocator (cudaMalloc/cudaFree),
// in the manner of PyTorch's CUDA caching allocator, so that a training step that allocates and
// releases the same pattern of temporaries every iteration calls the raw allocator only during the
// first one. Plain C++ (the raw allocator is two callbacks), so it is tested on any machine.
//
// Layout: the raw allocator hands out "segments"; a segment is cut into blocks (a doubly linked
// list in address order). release() returns a block to a free set and merges it with free
// neighbours, so a segment whose blocks are all released becomes one free block again.
//   - Sizes are rounded up to kRound (512 B), so every block is 512-byte aligned relative to its
//     segment (cudaMalloc segments are 256-byte aligned, so blocks are too).
//   - Two pools: requests of up to kSmallRequest (1 MiB) are served from 2 MiB segments of the
//     small pool; larger ones from the large pool (20 MiB segments for requests under 10 MiB,
//     otherwise a segment of the request rounded up to 2 MiB). Keeping the small, short-lived
//     blocks apart stops them from pinning pieces of the big segments.
//   - allocate() takes the best fit (the smallest free block that is large enough, lowest
//     address on ties) of its pool and splits off the rest when the rest is worth keeping
//     (>= 512 B in the small pool, > 1 MiB in the large pool).
//   - When the raw allocator fails (returns nullptr), the cache is emptied (every fully free
//     segment handed back) and the raw allocation retried; if the segment was padded beyond the
//     request (a 20 MiB segment for a 2 MiB request), the exact size is tried last. allocate()
//     returns nullptr only when all of that fails, and the caller reports out of memory.
//
// The cache assumes that a released block may be reused immediately, i.e. that all work on the
// memory is ordered on one stream (the CUDA backend's) or has been synchronised by the caller.
// Thread-safe (one mutex); the raw callbacks are called with it held.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

namespace mpigpt {

class CachingAllocator {
 public:
  using RawAlloc = std::function<void*(size_t)>;  // nullptr when out of memory
  using RawFree = std::function<void(void*)>;

  static constexpr size_t kRound = 512;                      // block granularity
  static constexpr size_t kSmallRequest = size_t(1) << 20;   // <= this: small pool
  static constexpr size_t kSmallSegment = size_t(2) << 20;   // small-pool segment size
  static constexpr size_t kMediumRequest = size_t(10) << 20; // < this: one kLargeSegment
  static constexpr size_t kLargeSegment = size_t(20) << 20;
  static constexpr size_t kLargeRound = size_t(2) << 20;     // bigger requests: rounded to this

  struct Stats {
    size_t in_use = 0;       // bytes of blocks handed out (rounded sizes)
    size_t cached = 0;       // bytes of free blocks held in reserve (reserved - in_use)
    size_t reserved = 0;     // bytes obtained from the raw allocator and not yet given back
    size_t peak_in_use = 0;  // high-water mark of in_use
    size_t peak_reserved = 0;
    int64_t raw_allocs = 0;  // successful raw allocations (segments created)
    int64_t raw_frees = 0;   // segments given back
    int64_t raw_failures = 0;  // raw allocations that returned nullptr
    int64_t allocations = 0;   // successful allocate() calls
    int64_t cache_hits = 0;    // of which served without a raw allocation
    int64_t blocks_in_use = 0;
    int64_t segments = 0;      // segments currently held
  };

  CachingAllocator(RawAlloc raw_alloc, RawFree raw_free);
  // Hands every segment back, including blocks still in use (their owner outlived the cache).
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` (a distinct pointer also for 0 bytes), or nullptr when the raw
  // allocator cannot supply one even after emptying the cache. Contents are undefined.
  void* allocate(size_t bytes);
  // Return a block from allocate() to the cache; nullptr is ignored. Throws mpigpt::Error for a
  // pointer this allocator did not hand out (or already took back).
  void release(void* p);
  // Hand every fully free segment back to the raw allocator.
  void empty_cache();
  Stats stats() const;
  // The usable size of a live block (>= what was asked for); throws for an unknown pointer.
  size_t block_size(const void* p) const;

  // The block size a request of `bytes` is rounded to, and the segment size created for it.
  static size_t round_size(size_t bytes);
  static size_t segment_size(size_t rounded);

 private:
  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    bool allocated = false;
    bool small = false;     // which pool
    Block* prev = nullptr;  // neighbours within the segment, in address order
    Block* next = nullptr;
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  using FreeSet = std::set<Block*, BySize>;

  FreeSet& pool(bool small) { return small ? small_free_ : large_free_; }
  Block* take_free(size_t rounded, bool small);
  Block* new_segment(size_t rounded, bool small);
  void* raw_alloc_or_null(size_t bytes);
  void split(Block* b, size_t rounded);
  void empty_cache_locked();

  RawAlloc raw_alloc_;
  RawFree raw_free_;
  mutable std::mutex mu_;
  FreeSet small_free_, large_free_;
  std::unordered_map<const void*, Block*> live_;
  std::vector<Block*> segments_;  // first block of each segment (it is never merged away)
  Stats stats_;
};

}  // namespace mpigpt
