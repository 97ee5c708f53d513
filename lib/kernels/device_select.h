// Which GPU a rank computes on: one rank per GPU (as Megatron and llm.c run), chosen by its local rank
// (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)), the same under mpirun and srun. Only the choice and
// its errors live here; the CUDA calls are in lib/kernels/cuda/device.h.
#pragma once
#include <string>

namespace mpigpt {

// The device of local rank `local_rank` of `local_size` ranks on host `host` that sees
// `devices` GPUs: device = local rank. Errors (naming the host, the counts and the fix): no GPU
// at all, or more local ranks than GPUs unless `allow_sharing` (then device = local rank mod
// devices; for tests with several ranks on one GPU over `--comm mpi`, as NCCL refuses it).
int choose_device(int local_rank, int local_size, int devices, bool allow_sharing, const std::string& host);

// Number of CUDA devices this process sees (0 without the CUDA backend, a driver or a device).
int visible_cuda_devices();

}  // namespace mpigpt
