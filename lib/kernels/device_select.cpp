// Device choice per rank (see device_select.h).
#include "lib/kernels/device_select.h"

#include <cstdlib>

#include "lib/core/error.h"
#include "lib/kernels/ops.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/device.h"
#endif

namespace mpigpt {

int choose_device(int local_rank, int local_size, int devices, bool allow_sharing, const std::string& host) {
  MPIGPT_CHECK(local_rank >= 0 && local_rank < local_size, "local rank {} of {}", local_rank, local_size);
  if (devices <= 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    fail("engine.backend = cuda but host {} has no CUDA device visible to this process{}; run on a GPU node "
         "(one rank per GPU) or use engine.backend = cpu",
         host, visible ? fmt::format(" (CUDA_VISIBLE_DEVICES = '{}')", visible) : std::string());
  }
  if (local_size > devices && !allow_sharing)
    fail("{} ranks run on host {} but it has {} CUDA device(s): one rank per GPU; launch at most {} ranks per node "
         "(srun --ntasks-per-node={}, mpirun --map-by ppr:{}:node), or set engine.allow_device_sharing = true (tests only: the ranks then share "
         "the GPUs round robin)",
         local_size, host, devices, devices, devices, devices);
  return local_rank % devices;
}

int visible_cuda_devices() {
#ifdef MPIGPT_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

}  // namespace mpigpt

#ifndef MPIGPT_WITH_CUDA
namespace mpigpt {
std::unique_ptr<Ops> make_cuda_ops(int device, const CudaOptions&) {
  fail("engine.backend = cuda: this mpigpt was built without the CUDA backend (no nvcc at configure time); "
       "rebuild with the CUDA toolkit installed (cmake -DMPIGPT_CUDA=ON) or use engine.backend = cpu");
}
}  // namespace mpigpt
#endif
