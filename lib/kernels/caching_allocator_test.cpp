// Tests of the CachingAllocator over a malloc-backed raw allocator with a byte budget: rounding, reuse,
// splitting and merging, statistics, empty-cache-and-retry, pointers it does not own, and a
// randomised run checked against an interval model.
#include "lib/kernels/caching_allocator.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "lib/core/error.h"
#include "lib/core/rng.h"

#if MPIGPT_POISON_CACHED_BLOCKS
#include <sanitizer/asan_interface.h>
#endif

using namespace mpigpt;

namespace {

constexpr size_t KiB = size_t(1) << 10, MiB = size_t(1) << 20;

// The raw allocator the cache sits on: aligned_alloc with a budget (beyond it: nullptr, as
// cudaMalloc fails when the device is full), and a record of what it holds so that the tests can
// compare the cache's statistics with the truth.
struct RawHeap {
  size_t budget = SIZE_MAX;
  size_t held = 0;
  int64_t allocs = 0, frees = 0, failures = 0;
  std::vector<size_t> requests;  // every raw request, in order (also failed ones)
  std::map<void*, size_t> live;

  void* alloc(size_t n) {
    requests.push_back(n);
    if (n > budget || held + n > budget) {
      ++failures;
      return nullptr;
    }
    void* p = std::aligned_alloc(512, n);
    REQUIRE(p != nullptr);
    live[p] = n;
    held += n;
    ++allocs;
    return p;
  }
  void free(void* p) {
    auto it = live.find(p);
    REQUIRE_MESSAGE(it != live.end(), "raw free of a pointer the raw heap did not hand out");
    held -= it->second;
    live.erase(it);
    ++frees;
    std::free(p);
  }
  CachingAllocator make() {
    return CachingAllocator([this](size_t n) { return alloc(n); }, [this](void* p) { free(p); });
  }
};

// Checks the statistics against the raw heap and a list of live (pointer, block size) pairs.
void check_consistent(const CachingAllocator& a, const RawHeap& raw, size_t live_bytes, int64_t live_blocks) {
  const auto s = a.stats();
  CHECK(s.reserved == raw.held);
  CHECK(s.segments == int64_t(raw.live.size()));
  CHECK(s.raw_allocs == raw.allocs);
  CHECK(s.raw_frees == raw.frees);
  CHECK(s.raw_failures == raw.failures);
  CHECK(s.in_use == live_bytes);
  CHECK(s.blocks_in_use == live_blocks);
  CHECK(s.cached == s.reserved - s.in_use);
  CHECK(s.peak_in_use >= s.in_use);
  CHECK(s.peak_reserved >= s.reserved);
}

}  // namespace

TEST_CASE("caching allocator: sizes round to 512 B blocks and 2 MiB / 20 MiB / 2 MiB-multiple segments") {
  CHECK(CachingAllocator::round_size(0) == 512);
  CHECK(CachingAllocator::round_size(1) == 512);
  CHECK(CachingAllocator::round_size(512) == 512);
  CHECK(CachingAllocator::round_size(513) == 1024);
  CHECK(CachingAllocator::round_size(MiB + 1) == MiB + 512);
  CHECK(CachingAllocator::segment_size(512) == 2 * MiB);
  CHECK(CachingAllocator::segment_size(MiB) == 2 * MiB);           // the largest small request
  CHECK(CachingAllocator::segment_size(MiB + 512) == 20 * MiB);    // the smallest large one
  CHECK(CachingAllocator::segment_size(10 * MiB - 512) == 20 * MiB);
  CHECK(CachingAllocator::segment_size(10 * MiB) == 10 * MiB);
  CHECK(CachingAllocator::segment_size(10 * MiB + 512) == 12 * MiB);
  CHECK(CachingAllocator::segment_size(100 * MiB + 512) == 102 * MiB);
}

TEST_CASE("caching allocator: distinct aligned blocks, block sizes, statistics and peak") {
  RawHeap raw;
  {
    CachingAllocator a = raw.make();
    void* z0 = a.allocate(0);
    void* z1 = a.allocate(0);
    REQUIRE(z0 != nullptr);
    REQUIRE(z1 != nullptr);
    CHECK(z0 != z1);  // a zero-byte request still gets a pointer of its own
    CHECK(a.block_size(z0) == 512);
    void* s = a.allocate(1000);
    void* m = a.allocate(3 * MiB + 7);
    void* l = a.allocate(33 * MiB);
    for (void* p : {z0, z1, s, m, l}) CHECK(reinterpret_cast<uintptr_t>(p) % 512 == 0);
    CHECK(a.block_size(s) == 1024);
    CHECK(a.block_size(m) == 3 * MiB + 512);
    // 33 MiB gets a 34 MiB segment; the 1 MiB rest is not worth a large-pool block of its own.
    CHECK(a.block_size(l) == 34 * MiB);
    // Three segments: one small (2 MiB) for the three small blocks, a 20 MiB one for m, 34 MiB for l.
    CHECK(raw.allocs == 3);
    CHECK(raw.held == 2 * MiB + 20 * MiB + 34 * MiB);
    const size_t live = 512 + 512 + 1024 + (3 * MiB + 512) + 34 * MiB;
    check_consistent(a, raw, live, 5);
    CHECK(a.stats().allocations == 5);
    CHECK(a.stats().cache_hits == 2);  // z1 and s came out of the first small segment

    a.release(l);
    a.release(s);
    check_consistent(a, raw, live - 34 * MiB - 1024, 3);
    CHECK(a.stats().peak_in_use == live);
    CHECK(raw.frees == 0);  // released blocks stay cached
    // The requested bytes are usable (the rounding tail is not: a sanitizer build poisons it).
    std::memset(m, 0xab, 3 * MiB + 7);
    a.release(z0);
    a.release(z1);
    a.release(m);
    check_consistent(a, raw, 0, 0);
    a.empty_cache();
    CHECK(raw.held == 0);
    CHECK(raw.frees == 3);
    check_consistent(a, raw, 0, 0);
    CHECK(a.stats().peak_in_use == live);
    CHECK(a.stats().peak_reserved == 56 * MiB);
  }
  CHECK(raw.live.empty());
}

TEST_CASE("caching allocator: a steady-state loop does no raw allocation after its first iteration") {
  RawHeap raw;
  CachingAllocator a = raw.make();
  // One "training step": parameters-like long-lived blocks, activations of several sizes released
  // in reverse order (as backward does), scratch allocated and released inside, interleaved.
  const std::vector<size_t> act = {3 * MiB, 700 * KiB, 12 * MiB + 100, 4096, 25 * MiB, 1, 9 * MiB, 64 * KiB};
  void* params = a.allocate(48 * MiB);
  int64_t raw_after_first = -1;
  size_t reserved_after_first = 0;
  for (int step = 0; step < 20; ++step) {
    std::vector<void*> saved;
    for (size_t i = 0; i < act.size(); ++i) {
      saved.push_back(a.allocate(act[i]));
      void* scratch = a.allocate(act[(i + 3) % act.size()] / 2);
      a.release(scratch);
    }
    for (size_t i = act.size(); i-- > 0;) {
      void* grad = a.allocate(act[i]);
      a.release(saved[i]);
      a.release(grad);
    }
    if (step == 0) {
      raw_after_first = raw.allocs;
      reserved_after_first = a.stats().reserved;
    } else {
      CAPTURE(step);
      CHECK(raw.allocs == raw_after_first);
      CHECK(a.stats().reserved == reserved_after_first);
    }
  }
  CHECK(raw.frees == 0);
  CHECK(a.stats().cache_hits > 20 * int64_t(act.size()));
  check_consistent(a, raw, 48 * MiB, 1);
  a.release(params);
  a.empty_cache();
  CHECK(raw.held == 0);
  CHECK(raw.frees == raw.allocs);
}

TEST_CASE("caching allocator: the same size gets the same block back; best fit; splitting and merging") {
  RawHeap raw;
  CachingAllocator a = raw.make();
  void* p = a.allocate(5000);
  a.release(p);
  CHECK(a.allocate(5000) == p);  // the freed block merged back; best fit at the lowest address
  a.release(p);

  // Many small blocks share one 2 MiB segment; freed in any order they merge back into one.
  std::vector<void*> small;
  for (int i = 0; i < 64; ++i) small.push_back(a.allocate(16 * KiB));
  CHECK(raw.allocs == 1);
  for (int i = 0; i < 64; i += 2) a.release(small[size_t(i)]);
  for (int i = 63; i > 0; i -= 2) a.release(small[size_t(i)]);
  void* whole = a.allocate(MiB);  // only possible in the single 2 MiB segment if it merged
  CHECK(raw.allocs == 1);
  a.release(whole);

  // Medium requests are cut out of one 20 MiB segment.
  std::vector<void*> med;
  for (int i = 0; i < 4; ++i) med.push_back(a.allocate(4 * MiB));
  CHECK(raw.allocs == 2);
  for (int i = 1; i < 4; ++i)
    CHECK(static_cast<char*>(med[size_t(i)]) == static_cast<char*>(med[0]) + i * 4 * MiB);
  // Best fit: with a 4 MiB hole and the 4 MiB tail of the segment free, a 3 MiB request takes the
  // lower-addressed of the equal-sized holes, and the 1 MiB left over is not split off (too small
  // to be worth a large-pool block), so the block keeps its 4 MiB.
  a.release(med[1]);
  void* q = a.allocate(3 * MiB);
  CHECK(q == med[1]);
  CHECK(a.block_size(q) == 4 * MiB);
  a.release(q);
  for (int i : {0, 2, 3}) a.release(med[size_t(i)]);
  CHECK(a.stats().in_use == 0);
  // Merged back: a 20 MiB request fits the medium segment exactly, no new segment.
  void* big = a.allocate(20 * MiB);
  CHECK(big == med[0]);
  CHECK(raw.allocs == 2);
  a.release(big);
  // Small and large pools are separate: a small request never takes a piece of a large segment.
  void* s = a.allocate(100);
  CHECK(static_cast<char*>(s) - static_cast<char*>(med[0]) != 0);
  CHECK(a.stats().segments == 2);
  a.release(s);
  a.empty_cache();
  CHECK(raw.held == 0);
}

TEST_CASE("caching allocator: empty_cache keeps segments with blocks in use") {
  RawHeap raw;
  CachingAllocator a = raw.make();
  void* keep = a.allocate(2 * MiB);  // lives in a 20 MiB segment
  void* other = a.allocate(2 * MiB);
  void* solo = a.allocate(30 * MiB);
  a.release(other);
  a.release(solo);
  a.empty_cache();
  CHECK(raw.frees == 1);  // only the 30 MiB segment was fully free
  CHECK(raw.held == 20 * MiB);
  check_consistent(a, raw, 2 * MiB, 1);
  // The free tail of the kept segment still serves requests.
  void* again = a.allocate(2 * MiB);
  CHECK(raw.allocs == 2);
  a.release(again);
  a.release(keep);
  a.empty_cache();
  CHECK(raw.held == 0);
  check_consistent(a, raw, 0, 0);
}

TEST_CASE("caching allocator: out of raw memory empties the cache and retries once, then returns nullptr") {
  RawHeap raw;
  raw.budget = 64 * MiB;
  CachingAllocator a = raw.make();
  void* x = a.allocate(40 * MiB);
  REQUIRE(x != nullptr);
  a.release(x);  // 40 MiB cached, too small for what follows
  void* y = a.allocate(50 * MiB);
  // 40 + 50 > 64: the first raw attempt failed, the cached 40 MiB went back, the retry worked.
  REQUIRE(y != nullptr);
  CHECK(raw.failures == 1);
  CHECK(raw.frees == 1);
  CHECK(raw.requests == std::vector<size_t>{40 * MiB, 50 * MiB, 50 * MiB});
  check_consistent(a, raw, 50 * MiB, 1);

  // Nothing left to give back: a further request fails cleanly and changes nothing.
  void* z = a.allocate(50 * MiB);
  CHECK(z == nullptr);
  CHECK(raw.failures == 3);  // the attempt and the retry after emptying the (empty) cache
  check_consistent(a, raw, 50 * MiB, 1);
  CHECK(a.stats().allocations == 2);

  // A medium request whose 20 MiB segment does not fit gets a segment of its exact size.
  void* w = a.allocate(3 * MiB);
  REQUIRE(w != nullptr);
  CHECK(a.block_size(w) == 3 * MiB);
  CHECK(raw.requests.back() == 3 * MiB);
  check_consistent(a, raw, 53 * MiB, 2);

  // Releasing makes room again; the allocator keeps working after failures.
  a.release(y);
  void* v = a.allocate(50 * MiB);
  CHECK(v == y);  // served from the cache, no raw call
  a.release(v);
  a.release(w);
  a.empty_cache();
  CHECK(raw.held == 0);
  check_consistent(a, raw, 0, 0);
}

TEST_CASE("caching allocator: releasing a pointer it does not own is an error") {
  RawHeap raw;
  CachingAllocator a = raw.make();
  int on_stack = 0;
  CHECK_THROWS_WITH_AS(a.release(&on_stack), doctest::Contains("not handed out by this allocator"), Error);
  void* p = a.allocate(4096);
  CHECK_THROWS_AS(a.release(static_cast<char*>(p) + 512), Error);  // inside a block is not a block
  CHECK_THROWS_AS(a.block_size(static_cast<char*>(p) + 512), Error);
  a.release(p);
  CHECK_THROWS_WITH_AS(a.release(p), doctest::Contains("already released"), Error);  // double release
  CHECK_THROWS_AS(a.block_size(p), Error);
  a.release(nullptr);  // like free(nullptr)
  check_consistent(a, raw, 0, 0);
  CHECK_THROWS_AS(CachingAllocator(nullptr, [](void*) {}), Error);
}

TEST_CASE("caching allocator: the destructor hands back every segment, also ones with live blocks") {
  RawHeap raw;
  {
    CachingAllocator a = raw.make();
    a.allocate(100);
    a.allocate(5 * MiB);
    void* r = a.allocate(25 * MiB);  // too big for the rest of the 5 MiB request's 20 MiB segment
    a.release(r);
    CHECK(raw.live.size() == 3);
  }
  CHECK(raw.live.empty());
  CHECK(raw.frees == 3);
}

TEST_CASE("caching allocator: a random workload keeps blocks disjoint, contents intact and statistics exact") {
  RawHeap raw;
  raw.budget = 160 * MiB;  // tight enough that the retry path runs now and then
  CachingAllocator a = raw.make();
  struct Live {
    size_t requested, size;
    uint8_t tag;
  };
  std::map<char*, Live> live;  // by address, to check disjointness against the neighbours
  size_t live_bytes = 0;
  int64_t nulls = 0;
  auto stamp = [](char* p, size_t n, uint8_t tag) {
    // Mark the first, middle and last bytes of the requested range with the block's tag: any
    // overlap with another block that is written later shows up when this one is released.
    if (n == 0) return;
    p[0] = p[n / 2] = p[n - 1] = char(tag);
  };
  auto intact = [](const char* p, size_t n, uint8_t tag) {
    return n == 0 || (p[0] == char(tag) && p[n / 2] == char(tag) && p[n - 1] == char(tag));
  };
  for (uint64_t i = 0; i < 4000; ++i) {
    const uint64_t r = bits_at(77, 0, i);
    const bool do_alloc = live.empty() || (r % 100) < 55;
    if (do_alloc) {
      // Log-uniform sizes from bytes to tens of MiB, sometimes exactly a rounding boundary.
      const int log2 = int((r >> 8) % 26);
      size_t n = (size_t(1) << log2) + ((r >> 16) % (size_t(1) << log2));
      if ((r >> 40) % 7 == 0) n = CachingAllocator::round_size(n);
      char* p = static_cast<char*>(a.allocate(n));
      if (!p) {
        ++nulls;
        continue;
      }
      const size_t size = a.block_size(p);
      REQUIRE(size >= n);
      REQUIRE(size % 512 == 0);
      REQUIRE(reinterpret_cast<uintptr_t>(p) % 512 == 0);
      auto next = live.lower_bound(p);
      if (next != live.end()) REQUIRE(p + size <= next->first);
      if (next != live.begin()) {
        auto prev = std::prev(next);
        REQUIRE(prev->first + prev->second.size <= p);
      }
      const uint8_t tag = uint8_t(i * 3);
      stamp(p, n, tag);
      live[p] = {n, size, tag};
      live_bytes += size;
    } else {
      auto it = live.begin();
      std::advance(it, long((r >> 8) % live.size()));
      REQUIRE_MESSAGE(intact(it->first, it->second.requested, it->second.tag), "block contents were overwritten");
      live_bytes -= it->second.size;
      a.release(it->first);
      live.erase(it);
    }
    if (i % 97 == 0) {
      check_consistent(a, raw, live_bytes, int64_t(live.size()));
      if (i % 3 == 0) a.empty_cache();
    }
  }
  check_consistent(a, raw, live_bytes, int64_t(live.size()));
  CHECK(a.stats().allocations + nulls > 2000);
  CHECK(raw.failures > 0);  // the budget did bind: the retry path ran
  MESSAGE(fmt::format("{} allocations, {} raw allocations, {} raw failures, {} nullptr results",
                      a.stats().allocations, raw.allocs, raw.failures, nulls));
  for (auto& [p, l] : live) {
    CHECK(intact(p, l.requested, l.tag));
    a.release(p);
  }
  check_consistent(a, raw, 0, 0);
  a.empty_cache();
  CHECK(raw.held == 0);
  CHECK(raw.live.empty());
}

#if MPIGPT_POISON_CACHED_BLOCKS
TEST_CASE("caching allocator: a sanitizer build poisons all but the requested bytes of live blocks") {
  RawHeap raw;
  CachingAllocator a = raw.make();
  char* p = static_cast<char*>(a.allocate(1000));
  char* q = static_cast<char*>(a.allocate(3 * MiB + 7));
  CHECK(__asan_region_is_poisoned(p, 1000) == nullptr);
  CHECK(__asan_address_is_poisoned(p + 1000));  // the rounding tail of a 1024-byte block
  CHECK(__asan_address_is_poisoned(p + 1024));  // the free rest of the small segment
  CHECK(__asan_region_is_poisoned(q, 3 * MiB + 7) == nullptr);
  CHECK(__asan_address_is_poisoned(q + 3 * MiB + 7));
  a.release(p);
  CHECK(__asan_address_is_poisoned(p));  // a cached block is poisoned until handed out again
  char* p2 = static_cast<char*>(a.allocate(24));
  CHECK(p2 == p);
  CHECK(__asan_region_is_poisoned(p2, 24) == nullptr);
  CHECK(__asan_address_is_poisoned(p2 + 24));
  a.release(p2);
  a.release(q);
  a.empty_cache();  // the raw free gets unpoisoned segments (the raw heap frees them with free())
  CHECK(raw.live.empty());
}
#endif
