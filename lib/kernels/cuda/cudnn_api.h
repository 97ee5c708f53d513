// The cuDNN library, loaded at run time: dlopen("libcudnn.so.9") and a table of the graph-API
// functions the fused attention uses (cudnn_sdpa.cu), so that the binary starts on machines
// without cuDNN and engine.attention_backend = builtin never needs it. Included only by cuda/*.cu.
#pragma once
#include <string>

// cudnn_graph.h supplies only the types and enums. Builds whose toolkit lacks cuDNN's headers, and
// the host emulator, have no table (MPIGPT_HAVE_CUDNN undefined) and cudnn_load_error() says so.
#ifdef MPIGPT_HAVE_CUDNN
#include <cudnn_graph.h>
#endif

namespace mpigpt::cuda {

// Empty when cuDNN can be used, else why not: the library, where it was searched and the fixes.
// Loads the library on first call; never throws.
std::string cudnn_load_error();

#ifdef MPIGPT_HAVE_CUDNN

struct CudnnApi {
  decltype(&::cudnnGetVersion) GetVersion;
  decltype(&::cudnnGetErrorString) GetErrorString;
  decltype(&::cudnnGetLastErrorString) GetLastErrorString;
  decltype(&::cudnnCreate) Create;
  decltype(&::cudnnDestroy) Destroy;
  decltype(&::cudnnSetStream) SetStream;
  decltype(&::cudnnBackendCreateDescriptor) BackendCreateDescriptor;
  decltype(&::cudnnBackendDestroyDescriptor) BackendDestroyDescriptor;
  decltype(&::cudnnBackendFinalize) BackendFinalize;
  decltype(&::cudnnBackendSetAttribute) BackendSetAttribute;
  decltype(&::cudnnBackendGetAttribute) BackendGetAttribute;
  decltype(&::cudnnBackendExecute) BackendExecute;
};

// The loaded table; throws mpigpt::Error with cudnn_load_error()'s text when it cannot be loaded.
const CudnnApi& cudnn();

// cuDNN's message for a failed call: the status name and the library's last error text.
std::string cudnn_error_text(cudnnStatus_t rc);

#endif

}  // namespace mpigpt::cuda
