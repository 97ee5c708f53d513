// cuDNN's fused attention through the graph (backend) API (see cudnn_sdpa.h): the forward and
// backward graphs (cudnn_sdpa_graphs.cu) planned for the handle with heuristics mode A (the first
// engine configuration that finalizes is kept per shape) and executed on its stream.
#include "lib/kernels/cuda/cudnn_sdpa.h"

#include <fmt/format.h>

#include "lib/core/error.h"
#include "lib/kernels/cuda/cudnn_api.h"

#ifdef MPIGPT_HAVE_CUDNN
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <vector>

#include "lib/kernels/cuda/cudnn_sdpa_graphs.h"
#endif

namespace mpigpt::cuda {

std::string cudnn_sdpa_unavailable() { return cudnn_load_error(); }

std::string cudnn_sdpa_version() {
#ifdef MPIGPT_HAVE_CUDNN
  if (cudnn_load_error().empty()) {
    const size_t v = cudnn().GetVersion();
    return fmt::format("cuDNN {}.{}.{}", v / 10000, v % 10000 / 100, v % 100);
  }
#endif
  return {};
}

#ifndef MPIGPT_HAVE_CUDNN

SdpaPlans cudnn_sdpa_plan_for_device(const SdpaShape&, const std::string&) {
  throw Error(cudnn_load_error());
}

struct CudnnSdpa::Plans {};
CudnnSdpa::CudnnSdpa(void*) { throw Error(cudnn_load_error()); }
CudnnSdpa::~CudnnSdpa() = default;
bool CudnnSdpa::prepare(const SdpaShape&, std::string* why) {
  *why = cudnn_load_error();
  return false;
}
SdpaPlans CudnnSdpa::plans(const SdpaShape&) const { return {}; }
size_t CudnnSdpa::workspace_bytes(const SdpaShape&) const { return 0; }
void CudnnSdpa::forward(const SdpaShape&, void*, float*, const void*, void*) { throw Error(cudnn_load_error()); }
void CudnnSdpa::backward(const SdpaShape&, void*, const void*, const void*, const void*, const float*, void*) {
  throw Error(cudnn_load_error());
}

#else

using sdpa::build_backward;
using sdpa::build_forward;
using sdpa::check;
using sdpa::Desc;
using sdpa::Graph;

namespace {

// Attributes deprecated in cuDNN 9 that its engines still read: the handle of an operation graph
// and of an execution plan (named by value: the enumerators carry deprecation warnings).
constexpr auto kGraphHandle = cudnnBackendAttributeName_t(800);  // CUDNN_ATTR_OPERATIONGRAPH_HANDLE
constexpr auto kPlanHandle = cudnnBackendAttributeName_t(400);   // CUDNN_ATTR_EXECUTION_PLAN_HANDLE

// The backward's own fp32 tensors ahead of cuDNN's workspace, each on a 256-byte boundary: dQ at
// 0, D (B,NH,T) at rowdot, cuDNN's workspace at total.
struct BackwardWorkspace {
  size_t rowdot, total;
};
BackwardWorkspace backward_workspace(const SdpaShape& s) {
  auto round_up = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t rows = size_t(s.B) * size_t(s.NH) * size_t(s.T);
  const size_t dq = round_up(rows * size_t(s.HD) * sizeof(float));
  return {dq, dq + round_up(rows * sizeof(float))};
}

// Why cuDNN's fused engines cannot take this shape on this cuDNN (the frontend's support checks).
std::string shape_unsupported(const SdpaShape& s, size_t version) {
  if (s.HD % 8 != 0 || s.HD > 128) return fmt::format("head dim {} is not a multiple of 8 up to 128", s.HD);
  if (s.T < 2) return "the backward needs at least 2 tokens";
  if (version == 91000 || version == 91001) return "cuDNN 9.10.0 and 9.10.1 have known bf16 attention bugs";
  if (version <= 91500 && s.T % 128 != 0)
    return fmt::format("cuDNN {} (9.15.0 or older) runs the backward only for T a multiple of 128 (T = {})", version,
                       s.T);
  return {};
}

}  // namespace

// A planned graph: its descriptors, the engine configuration chosen and the plan.
struct Planned {
  Graph graph;
  std::unique_ptr<Desc> opgraph, heuristics, config, plan;  // kept for the plan's life
  SdpaPlanInfo info;
  explicit Planned(const char* name) : graph(name) {}
};

// The forward and backward graphs of a shape, to be planned (on a handle or a described device).
struct CudnnSdpa::Plans {
  Planned fwd{"forward"}, bwd{"backward"};
  explicit Plans(const SdpaShape& shape) {
    build_forward(fwd.graph, shape);
    build_backward(bwd.graph, shape);
  }
  SdpaPlans info() const { return {fwd.info, bwd.info}; }
};

namespace {

// Where a plan is made for: a handle on the current device, or (device-less, cuDNN 9.8 on) a device
// property descriptor made from another machine's description (cudnn_sdpa_plan_for_device).
struct Target {
  cudnnHandle_t handle = nullptr;
  cudnnBackendDescriptor_t device = nullptr;
};

// The global index of the engine a finalized engine configuration runs, for the reports: -1 when
// cuDNN does not say (never an error).
int64_t engine_index(cudnnBackendDescriptor_t config, const std::string& name) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, name + " engine");
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t n = 0, index = -1;
  if (cudnn().BackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw) !=
          CUDNN_STATUS_SUCCESS ||
      cudnn().BackendGetAttribute(raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index) !=
          CUDNN_STATUS_SUCCESS)
    return -1;
  return index;
}

// Plans g's operations for the target: the first engine configuration of heuristics mode A whose
// plan finalizes. (Not FALLBACK: its engines would be generic ones, where the builtin kernels are
// the better fallback.) False when none does, each configuration's reason in p.rejected.
bool try_plan(Planned& p, Target target) {
  const std::vector<cudnnBackendDescriptor_t> ops = p.graph.ops();
  const std::string& name = p.graph.name();
  p.opgraph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, name + " operation graph");
  p.opgraph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(), int64_t(ops.size()));
  // Deprecated (as the plan's below): a cuDNN that no longer takes it does not need it.
  if (target.handle)
    (void)cudnn().BackendSetAttribute(p.opgraph->get(), kGraphHandle, CUDNN_TYPE_HANDLE, 1, &target.handle);
  p.opgraph->finalize();
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  auto heur = std::make_unique<Desc>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, name + " heuristics");
  const cudnnBackendDescriptor_t graph = p.opgraph->get();
  heur->set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, &graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
  if (target.device) heur->set(CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, &target.device);
  check(cudnn().BackendFinalize(heur->get()), name + ": heuristics mode A");
  int64_t count = 0;
  check(cudnn().BackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                    &count, nullptr),
        name + ": counting the heuristics' engine configurations");
  std::deque<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i)
    raw.push_back(configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, name + " engine configuration").get());
  int64_t returned = 0;
  if (count > 0)
    check(cudnn().BackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                      count, &returned, raw.data()),
          name + ": reading the heuristics' engine configurations");
  p.info.offered = returned;
  for (int64_t i = 0; i < returned; ++i) {
    const int64_t engine = engine_index(raw[size_t(i)], name);
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, name + " execution plan");
    if (target.handle)
      (void)cudnn().BackendSetAttribute(plan->get(), kPlanHandle, CUDNN_TYPE_HANDLE, 1, &target.handle);
    if (target.device) plan->set(CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, &target.device);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw[size_t(i)]);
    const cudnnStatus_t rc = cudnn().BackendFinalize(plan->get());
    if (rc != CUDNN_STATUS_SUCCESS) {
      const std::string why = cudnn_error_text(rc);
      // The engine's kernels were generated and compiled; the CUDA driver could not load them
      // (only the device-less planning of a machine without a driver gets this far and no further).
      if (rc == CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER && why.find("cuLibraryLoadData") != std::string::npos)
        ++p.info.built;
      p.info.rejected.push_back(fmt::format("configuration {} (engine {}): {}", i, engine, why));
      continue;
    }
    int64_t ws = 0, n = 0;
    check(cudnn().BackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                      &ws),
          name + ": reading the plan's workspace size");
    p.info.workspace = ws;
    p.info.chosen = i;
    p.info.engine = engine;
    p.plan = std::move(plan);
    p.config = std::make_unique<Desc>(std::move(configs[size_t(i)]));
    p.heuristics = std::move(heur);
    return true;
  }
  if (returned == 0) p.info.rejected.push_back("heuristics mode A offered no engine configuration");
  return false;
}

void make_plan(Planned& p, Target target) {
  if (try_plan(p, target)) return;
  std::string tried;
  for (const std::string& r : p.info.rejected) tried += "; " + r;
  fail("no cuDNN engine runs the {} graph{}", p.graph.name(), tried);
}

// One user tensor of an execution: its id and where it lies (a host scalar's address for the
// by-value ones, read when the call is queued).
struct Bound {
  SdpaTensorId uid;
  const void* ptr;
};

// Queues plan p with the variant pack of the tensors, and the workspace.
void execute(cudnnHandle_t handle, const Planned& p, const std::vector<Bound>& tensors, void* workspace) {
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  for (const Bound& t : tensors) {
    uids.push_back(t.uid);
    ptrs.push_back(const_cast<void*>(t.ptr));
  }
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, p.graph.name() + " variant pack");
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace)
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), int64_t(ptrs.size()))
      .set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()))
      .finalize();
  check(cudnn().BackendExecute(handle, p.plan->get(), pack.get()),
        "executing the " + p.graph.name() + " (engine.attention_backend = builtin runs the builtin kernels instead)");
}

cudnnHandle_t as_handle(void* h) { return static_cast<cudnnHandle_t>(h); }

// The value of the masked scores: -inf from cuDNN 9.10 on, the lowest float before (as the
// frontend chooses).
float mask_value() {
  return cudnn().GetVersion() >= 91000 ? -std::numeric_limits<float>::infinity()
                                       : std::numeric_limits<float>::lowest();
}

}  // namespace

SdpaPlans cudnn_sdpa_plan_for_device(const SdpaShape& shape, const std::string& device_json) {
  if (cudnn().GetVersion() < 90800)
    fail("cuDNN attention: planning for a described device needs cuDNN 9.8 or newer, this is {}",
         cudnn_sdpa_version());
  if (std::string why = shape_unsupported(shape, cudnn().GetVersion()); !why.empty())
    fail("cuDNN attention: cuDNN does not run this shape: {}", why);
  Desc device(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device description");
  device.set(CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, device_json.data(),
             int64_t(device_json.size()));
  device.finalize();
  CudnnSdpa::Plans plans(shape);
  try_plan(plans.fwd, {nullptr, device.get()});
  try_plan(plans.bwd, {nullptr, device.get()});
  return plans.info();
}

CudnnSdpa::CudnnSdpa(void* stream) : stream_(stream) {
  cudnnHandle_t h = nullptr;
  check(cudnn().Create(&h), "creating a handle (cudnnCreate)");
  if (const cudnnStatus_t rc = cudnn().SetStream(h, static_cast<cudaStream_t>(stream)); rc != CUDNN_STATUS_SUCCESS) {
    (void)cudnn().Destroy(h);  // the destructor does not run for a constructor that throws
    check(rc, "binding the handle to the stream");
  }
  handle_ = h;
}

CudnnSdpa::~CudnnSdpa() {
  plans_.clear();
  if (handle_) (void)cudnn().Destroy(as_handle(handle_));
}

bool CudnnSdpa::prepare(const SdpaShape& shape, std::string* why) {
  if (plans_.count(shape)) return true;
  if (auto it = unsupported_.find(shape); it != unsupported_.end()) {
    *why = it->second;
    return false;
  }
  std::string reason = shape_unsupported(shape, cudnn().GetVersion());
  if (reason.empty()) {
    try {
      auto plans = std::make_unique<Plans>(shape);
      make_plan(plans->fwd, {as_handle(handle_), nullptr});
      make_plan(plans->bwd, {as_handle(handle_), nullptr});
      plans_.emplace(shape, std::move(plans));
      return true;
    } catch (const Error& e) {
      reason = e.what();
    }
  }
  *why = reason;
  unsupported_.emplace(shape, reason);
  return false;
}

SdpaPlans CudnnSdpa::plans(const SdpaShape& shape) const { return plans_.at(shape)->info(); }

size_t CudnnSdpa::workspace_bytes(const SdpaShape& shape) const {
  const Plans& p = *plans_.at(shape);
  return std::max(size_t(p.fwd.info.workspace), backward_workspace(shape).total + size_t(p.bwd.info.workspace));
}

namespace {

// The element offsets of K's and V's columns in a qkv row, and the host scalars of a call.
struct CallConstants {
  int64_t k, v;
  float scale, mask, one = 1.0f;
};
CallConstants constants(const SdpaShape& s) {
  return {int64_t(s.NH) * s.HD, int64_t(s.NH + s.NKV) * s.HD, float(1.0 / std::sqrt(double(s.HD))), mask_value()};
}
const void* bf16_at(const void* base, int64_t element) { return static_cast<const char*>(base) + 2 * element; }

}  // namespace

void CudnnSdpa::forward(const SdpaShape& shape, void* out, float* lse, const void* qkv, void* workspace) {
  const CallConstants c = constants(shape);
  execute(as_handle(handle_), plans_.at(shape)->fwd,
          {{kSdpaQ, qkv}, {kSdpaK, bf16_at(qkv, c.k)}, {kSdpaV, bf16_at(qkv, c.v)}, {kSdpaO, out}, {kSdpaStats, lse},
           {kSdpaScale, &c.scale}, {kSdpaMaskValue, &c.mask}},
          workspace);
}

void CudnnSdpa::backward(const SdpaShape& shape, void* dqkv, const void* dout, const void* qkv, const void* out,
                         const float* lse, void* workspace) {
  char* ws = static_cast<char*>(workspace);
  const BackwardWorkspace layout = backward_workspace(shape);
  // Before cuDNN 9.6 the engines accumulate into dQ's fp32 tensor without clearing it first.
  if (cudnn().GetVersion() < 90600)
    if (cudaMemsetAsync(ws, 0, layout.rowdot, static_cast<cudaStream_t>(stream_)) != cudaSuccess)
      fail("cuDNN attention: clearing the fp32 dQ (cudaMemsetAsync of {} bytes) failed", layout.rowdot);
  const CallConstants c = constants(shape);
  execute(as_handle(handle_), plans_.at(shape)->bwd,
          {{kSdpaQ, qkv}, {kSdpaK, bf16_at(qkv, c.k)}, {kSdpaV, bf16_at(qkv, c.v)}, {kSdpaO, out}, {kSdpaStats, lse},
           {kSdpaScale, &c.scale}, {kSdpaMaskValue, &c.mask}, {kSdpaDO, dout}, {kSdpaDQ, dqkv},
           {kSdpaDK, bf16_at(dqkv, c.k)}, {kSdpaDV, bf16_at(dqkv, c.v)}, {kSdpaOne, &c.one},
           {kSdpaRowDot, ws + layout.rowdot}, {kSdpaDQAccum, ws}},
          ws + layout.total);
}

#endif

}  // namespace mpigpt::cuda
