// The MPI process environment: initialisation, world rank/size, and the fatal-error exit that
// aborts every rank (a failing rank must never leave the others waiting in a collective).
#pragma once
#include <string>

namespace mpigpt {

class MpiEnv {
 public:
  MpiEnv(int* argc, char*** argv);  // MPI_Init_thread (funneled)
  ~MpiEnv();                        // MPI_Finalize
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0, size_ = 1;
};

int world_rank();
int world_size();
// Print "mpigpt: error (rank R of N): MESSAGE" to stderr and end the job with `code`:
// MPI_Abort when more than one rank runs, so that no rank hangs, plain exit otherwise.
[[noreturn]] void abort_job(const std::string& message, int code = 1);

}  // namespace mpigpt
