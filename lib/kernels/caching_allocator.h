// CachingAllocator: a device-memory cache in front of a slow raw allocator (cudaMalloc/cudaFree), in
// the manner of PyTorch's CUDA caching allocator, so that a training step's temporaries reach the raw
// allocator only in the first step. Plain C++ (the raw allocator is two callbacks): tested anywhere.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

namespace mpigpt {

// The raw allocator hands out "segments"; a segment is cut into blocks (a doubly linked list in
// address order), and a released block merges with its free neighbours, so a segment whose blocks
// are all released becomes one free block again. Sizes round up to kRound, so every block is
// 512-byte aligned relative to its segment (cudaMalloc segments are 256-byte aligned, so blocks are
// too). Two pools: requests up to kSmallRequest come from kSmallSegment segments, larger ones from
// the large pool (a kLargeSegment for requests under kMediumRequest, else the request rounded to
// kLargeRound); keeping the small, short-lived blocks apart stops them pinning pieces of big segments.
// A released block may be reused at once: all work on the memory must be ordered on one stream (the
// CUDA backend's) or synchronised by the caller. Thread-safe (one mutex, held during the raw calls).
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
  // The best fit of its pool (smallest large-enough free block, lowest address on ties), with the
  // rest split off when worth keeping (>= 512 B in the small pool, > 1 MiB in the large). When the
  // raw allocator fails, every fully free segment is handed back and the raw allocation retried,
  // and a segment padded beyond the request (20 MiB for 2 MiB) is tried at the exact size last.
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
