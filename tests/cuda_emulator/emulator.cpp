// The host emulator of the CUDA backend (docs/testing.md): kernel launches, run on the host with each
// CUDA thread a fiber (the runtime API is emulator_runtime.cpp).
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <vector>

#include "cuda_runtime.h"

// Under AddressSanitizer (docs/testing.md, `make test-sanitize`) every stack switch is announced to
// it, so that it tracks which stack is current; without that, the redzones a fiber's frames leave
// behind in its heap-allocated stack read as errors, and the fiber's own frames are checked against
// the wrong stack bounds.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define MPIGPT_EMU_ASAN 1
#else
#define MPIGPT_EMU_ASAN 0
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

// The threads of a block are fibers on the calling thread: on x86-64 a six-register stack switch,
// elsewhere ucontext, whose every switch is a system call.
#if defined(__x86_64__)
// mpigpt_emu_switch(&from, to): saves the callee-saved registers on the current stack, stores its
// stack pointer to *from and resumes the context whose stack pointer is `to` (System V ABI).
extern "C" void mpigpt_emu_switch(void** from, void* to);
asm(R"(
  .text
  .globl mpigpt_emu_switch
  .type mpigpt_emu_switch, @function
mpigpt_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mpigpt_emu_switch, .-mpigpt_emu_switch
)");
#endif

namespace emu {
namespace {

// A fiber's execution context: start(entry) makes it begin at entry() on the given stack, and
// switch_to saves the current context in `from` and resumes `to`.
// A context also records its stack's extent for AddressSanitizer: a fiber's from start, the
// scheduler's (the calling thread's) from the first switch into a fiber.
struct StackExtent {
  const void* bottom = nullptr;
  size_t size = 0;
  void* fake_stack = nullptr;  // AddressSanitizer's save of the context's fake stack while it is away
};
// A fiber's stack about to be used from its top again: recorded as the context's extent, and
// cleared of the redzones its last run's frames left (AddressSanitizer).
StackExtent fresh_stack(std::vector<char>& stack) {
#if MPIGPT_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(stack.data(), stack.size());
#endif
  return {stack.data(), stack.size(), nullptr};
}
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
  StackExtent extent;
};
void start(Context& c, std::vector<char>& stack, void (*entry)()) {
  c.extent = fresh_stack(stack);
  auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                          // entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(entry);   // where the switch's `ret` goes
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
  c.sp = sp;
}
void raw_switch(Context& from, Context& to) { mpigpt_emu_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
  StackExtent extent;
};
void start(Context& c, std::vector<char>& stack, void (*entry)()) {
  c.extent = fresh_stack(stack);
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack.data();
  c.uc.uc_stack.ss_size = stack.size();
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
void raw_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// Saves the current context in `from` and resumes `to`; `from_ends` when `from` is a fiber that
// will never be resumed (its body returned).
void switch_to(Context& from, Context& to, bool from_ends = false) {
#if MPIGPT_EMU_ASAN
  __sanitizer_start_switch_fiber(from_ends ? nullptr : &from.extent.fake_stack, to.extent.bottom, to.extent.size);
#endif
  raw_switch(from, to);
#if MPIGPT_EMU_ASAN
  __sanitizer_finish_switch_fiber(from.extent.fake_stack, nullptr, nullptr);
#endif
  (void)from_ends;
}

enum State { Runnable, AtBlockBar, AtWarpBar, Done };
struct Fiber {
  Context ctx;
  std::vector<char> stack;
  State state = Runnable;
  uint3 tid;
  int vote_gen = 0;
  int exchange_gen = 0;  // the warp exchanges (shuffles, all-gathers) this thread has made
  // Asynchronous copies (cuda_pipeline_primitives.h): those issued since the last commit, and the
  // committed groups, oldest first; each copy keeps its destination and the source bytes taken at issue.
  struct Copy {
    void* dst;
    std::vector<char> bytes;
  };
  std::vector<Copy> open_copies;
  std::deque<std::vector<Copy>> committed_copies;
};
std::vector<Fiber> fibers;
Context sched;
int cur = -1;
std::function<void()>* body = nullptr;
struct alignas(128) SmemChunk {
  float v[32];
};
// Shared memory is static storage (blocks never run at once); dynamic shared memory is this buffer,
// filled with 0xff bytes at each launch, as is device memory from cudaMalloc, so reading either
// before writing it gives NaNs rather than plausible zeros.
std::vector<SmemChunk> smem;  // dynamic shared memory, 128-byte aligned as __align__(128) asks
// [generation % 2][warp][lane][bytes]: shuffles and all-gathers. A lane writes its value, waits at
// the warp barrier and reads; the next exchange writes the other buffer, and the one after reuses
// this one only past that next exchange's barrier, when every lane has read this one.
unsigned char warp_buf[2][32][32][256];
int votes[3];
int nthreads = 0;
long launch_count = 0;
size_t smem_size = 0;  // the launch's dynamic shared memory bytes

void trampoline() {
#if MPIGPT_EMU_ASAN
  // The first code on a fiber's stack: completes the switch from the scheduler and learns the
  // scheduler's stack, where the fiber's barriers switch back to.
  __sanitizer_finish_switch_fiber(nullptr, &sched.extent.bottom, &sched.extent.size);
#endif
  (*body)();
  fibers[cur].state = Done;
  switch_to(fibers[cur].ctx, sched, /*from_ends=*/true);
}
void yield(State s) {
  fibers[cur].state = s;
  switch_to(fibers[cur].ctx, sched);
}
int linear(const uint3& t) { return int(t.x + blockDim.x * (t.y + blockDim.y * t.z)); }

// A launch runs its blocks one after another, and a block's fibers switch only at barriers: a fiber
// runs until it reaches __syncthreads (or a warp barrier: __syncwarp, a shuffle, both sides of a
// vote) or returns; then the next runnable fiber runs. A warp barrier opens when every live lane of
// the warp waits at it, a block barrier when every live thread of the block does; threads that
// returned no longer count, as on the GPU. Anything else (a barrier that some threads can never
// reach) is reported as a deadlock and aborts.
void run_block() {
  for (int i = 0; i < nthreads; ++i) {
    Fiber& f = fibers[i];
    f.state = Runnable;
    f.vote_gen = 0;
    f.exchange_gen = 0;
    f.open_copies.clear();
    f.committed_copies.clear();
    f.tid = {unsigned(i % blockDim.x), unsigned((i / blockDim.x) % blockDim.y), unsigned(i / (blockDim.x * blockDim.y))};
    start(f.ctx, f.stack, trampoline);
  }
  votes[0] = votes[1] = votes[2] = 0;
  for (;;) {
    for (int i = 0; i < nthreads; ++i) {  // every runnable fiber up to its next barrier
      if (fibers[i].state != Runnable) continue;
      cur = i;
      threadIdx = fibers[i].tid;
      switch_to(sched, fibers[i].ctx);
    }
    int done = 0, atblock = 0;
    for (int i = 0; i < nthreads; ++i) {
      done += fibers[i].state == Done;
      atblock += fibers[i].state == AtBlockBar;
    }
    if (done == nthreads) return;
    bool released = false;
    // One warp whose live lanes all wait at the warp barrier goes on: the first such warp in this
    // launch's order, so that one warp runs ahead of the others up to the block barrier (warp 0
    // first on even launches, the last warp first on odd ones). A kernel that lets one warp
    // overwrite shared data that another may still read, without a block barrier between, fails.
    const int nwarps = (nthreads + 31) / 32;
    for (int k = 0; k < nwarps && !released; ++k) {
      const int w = launch_count % 2 == 0 ? k : nwarps - 1 - k;
      int live = 0, at = 0;
      for (int i = w * 32; i < std::min(nthreads, w * 32 + 32); ++i) {
        live += fibers[i].state != Done;
        at += fibers[i].state == AtWarpBar;
      }
      if (live > 0 && at == live) {
        for (int i = w * 32; i < std::min(nthreads, w * 32 + 32); ++i)
          if (fibers[i].state == AtWarpBar) fibers[i].state = Runnable;
        released = true;
      }
    }
    if (!released && atblock == nthreads - done) {
      for (auto& f : fibers)
        if (f.state == AtBlockBar) f.state = Runnable;
      released = true;
    }
    if (!released) {
      fprintf(stderr, "cuda emulator: deadlock in block (%u,%u,%u): %d done, %d at __syncthreads, the rest at a warp barrier\n",
              blockIdx.x, blockIdx.y, blockIdx.z, done, atblock);
      abort();
    }
  }
}
}  // namespace

void syncthreads() { yield(AtBlockBar); }
void syncwarp() { yield(AtWarpBar); }
int syncthreads_or(int p) {
  const int g = fibers[cur].vote_gen++;
  if (p) votes[g % 3] = 1;
  syncthreads();
  const int r = votes[g % 3];
  votes[(g + 2) % 3] = 0;
  syncthreads();
  return r;
}
void* dyn_smem() { return smem.data(); }
void pipeline_copy(void* dst, const void* src, size_t bytes) {
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(smem.data());
  if ((bytes != 4 && bytes != 8 && bytes != 16) || d % bytes != 0 || reinterpret_cast<uintptr_t>(src) % bytes != 0 ||
      d < s || d + bytes > s + smem_size) {
    fprintf(stderr, "cuda emulator: __pipeline_memcpy_async of %zu bytes from %p to %p: needs 4, 8 or 16 bytes, both "
            "aligned to the size, into the block's dynamic shared memory\n", bytes, src, dst);
    abort();
  }
  Fiber::Copy c{dst, std::vector<char>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes)};
  std::memset(dst, 0xff, bytes);
  fibers[cur].open_copies.push_back(std::move(c));
}
void pipeline_commit() {
  Fiber& f = fibers[cur];
  f.committed_copies.push_back(std::move(f.open_copies));
  f.open_copies.clear();
}
void pipeline_wait_prior(size_t prior) {
  auto& groups = fibers[cur].committed_copies;
  for (; groups.size() > prior; groups.pop_front())
    for (const auto& c : groups.front()) std::memcpy(c.dst, c.bytes.data(), c.bytes.size());
}
size_t dyn_smem_bytes() { return smem_size; }
namespace {
// This thread's half of the warp's exchange buffer for its next exchange.
unsigned char (*exchange_buf())[32][256] { return warp_buf[fibers[cur].exchange_gen++ % 2]; }
}  // namespace
void shfl_exchange(const void* in, void* out, size_t bytes, int lane_xor) {
  const int lin = linear(threadIdx), w = lin / 32, lane = lin % 32;
  auto buf = exchange_buf();
  std::memcpy(buf[w][lane], in, bytes);
  syncwarp();
  std::memcpy(out, buf[w][lane ^ lane_xor], bytes);
}
int lane() { return linear(threadIdx) % 32; }
void warp_allgather(const void* in, void* out, size_t bytes) {
  const int lin = linear(threadIdx), w = lin / 32;
  auto buf = exchange_buf();
  std::memcpy(buf[w][lin % 32], in, bytes);
  syncwarp();
  for (int l = 0; l < 32; ++l) std::memcpy(static_cast<char*>(out) + l * bytes, buf[w][l], bytes);
}
namespace {
std::map<const void*, int> max_dynamic_smem;  // per kernel, from cudaFuncSetAttribute
}  // namespace
void set_max_dynamic_smem(const void* kernel, int bytes) { max_dynamic_smem[kernel] = bytes; }

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, ::CUstream_st* stream,
            std::function<void()> fn) {
  constexpr size_t kDefaultSmem = 48 * 1024;
  if (smem_bytes > kDefaultSmem) {
    const auto it = max_dynamic_smem.find(kernel);
    if (it == max_dynamic_smem.end() || size_t(it->second) < smem_bytes) {
      fprintf(stderr,
              "cuda emulator: a launch asks for %zu bytes of dynamic shared memory, above the 48 KiB default, but "
              "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) allowed the kernel %d\n",
              smem_bytes, it == max_dynamic_smem.end() ? int(kDefaultSmem) : it->second);
      last_error = cudaErrorInvalidValue;
      return;
    }
  }
  const long n = long(block.x) * block.y * block.z;
  if (n <= 0 || n > 1024 || smem_bytes > 232448 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535) {
    fprintf(stderr, "cuda emulator: invalid launch grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n", grid.x, grid.y, grid.z, block.x,
            block.y, block.z, smem_bytes);
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  nthreads = int(n);
  // Room for a whole block of 1024 threads at once, so that growing never copies the fibers and
  // their stacks (a Fiber's move is not noexcept, so a reallocation would copy them).
  if (fibers.capacity() < 1024) fibers.reserve(1024);
  if (fibers.size() < size_t(n)) fibers.resize(size_t(n));
  for (auto& f : fibers)
    if (f.stack.empty()) f.stack.resize(256 * 1024);
  body = &fn;
  blockDim = block;
  gridDim = grid;
  const float nan = __uint_as_float(0xffffffffu);  // NaNs for reads of shared memory nobody wrote
  SmemChunk garbage;
  std::fill(std::begin(garbage.v), std::end(garbage.v), nan);
  smem.assign(smem_bytes / sizeof(SmemChunk) + 1, garbage);
  smem_size = smem_bytes;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        run_block();
      }
  body = nullptr;
  ++launch_count;
}
}  // namespace emu
