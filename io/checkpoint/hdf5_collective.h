// Collective I/O of boxes of global tensors over parallel HDF5, the plumbing under the checkpoint
// file: owned HDF5 ids and their errors, the agreement that makes every rank leave a collective
// call the same way, the plan from boxes to HDF5's element order, the transfer, the checksum.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/checkpoint/checkpoint_file.h"
#include "lib/core/watchdog.h"

namespace mpigpt::h5 {

bool mpi_finalized();

// Owns one hid_t and closes it with the matching H5?close (not after MPI_Finalize, which shut
// parallel HDF5 down and closed every id already).
class Handle {
 public:
  Handle() = default;
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle& operator=(Handle&& o) noexcept { return std::swap(id_, o.id_), std::swap(close_, o.close_), *this; }
  ~Handle() { reset(); }
  herr_t reset() {
    herr_t rc = id_ >= 0 && !mpi_finalized() ? close_(id_) : 0;
    return id_ = -1, rc;
  }
  // Forgets the id without closing it: closing a file is collective, which a rank that is
  // unwinding from a failed save must not enter (its peers may not, so it would wait forever).
  void release() { id_ = -1; }
  operator hid_t() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// HDF5 prints its error stack to stderr by default; we turn failures into one mpigpt::Error and
// restore the caller's setting on the way out.
class Quiet {
 public:
  Quiet() { H5Eget_auto2(H5E_DEFAULT, &fn_, &data_), H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
  ~Quiet() { H5Eset_auto2(H5E_DEFAULT, fn_, data_); }

 private:
  H5E_auto2_t fn_ = nullptr;
  void* data_ = nullptr;
};

// The most specific messages of HDF5's error stack (e.g. "truncated file: eof = ...").
std::string error();

// Runs f(), a blocking HDF5 call, marked as a wait on the peers: HDF5's own collectives (barriers
// and reductions inside H5Dwrite, H5Fflush, H5Fclose, ...) and the file system's answers then end
// under the watchdog's timeout like every other wait of the job.
template <class F>
auto watched(const std::string& what, F&& f) {
  const Waiting w([&what] { return what; });
  return f();
}

// The message for a failed write of `what` (of `bytes` bytes) to checkpoint `path`, told the way a
// user acts on it: "disk full writing WHAT of checkpoint PATH (N bytes free ...)" when the write
// found no space (errno, or less free space than it asked), else the system's error and HDF5's
// `h5err`. Call it right after the failed call, while errno still holds the reason.
std::string write_failure(const std::string& path, const std::string& what, int64_t bytes, const std::string& h5err);

// File access over MPI-IO with collective metadata; transfers that are collective (every rank
// calls) but carried out with each rank's own MPI-IO calls (see the .cpp for the measurements).
Handle fapl_mpio(MPI_Comm comm);
Handle collective_dxpl();
Handle string_type();  // variable-length UTF-8: how earlier saves stored strings (still read)
// The type strings are written as: fixed-length UTF-8 of the value's size, null-terminated. Its
// bytes live in the attribute's header message, which carries a checksum, where a variable-length
// string's lie in the global heap, which has none (and libhdf5 crashed on a damaged one).
Handle string_type(const std::string& value);
// A scalar attribute `key` on `loc`; false on failure (the HDF5 error stack says why).
bool put_scalar(hid_t loc, const std::string& key, hid_t file_type, hid_t mem_type, const void* value);

uint64_t fnv1a(uint64_t h, const void* p, size_t n);
uint64_t hash_call(const std::string& name, const Shape& s);  // what vote() compares

// What a collective call settles in one all-reduce before it touches the file: whether every
// rank made the same call, the lowest rank that found an error, and sums of counts and checksums.
struct Vote {
  uint64_t hash_max, not_hash_max, first_bad, count, sum;
};

// Makes every rank leave a collective call the same way (all return or all throw), never some
// ranks inside it while others left.
class Agreement {
 public:
  explicit Agreement(MPI_Comm comm);  // duplicates comm: our messages never meet the caller's
  ~Agreement();
  Agreement(const Agreement&) = delete;
  Agreement& operator=(const Agreement&) = delete;
  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // `call` describes this rank's call, `err` its own error ("" if none). All ranks get the same
  // totals, or all throw: rank 0's call if the calls differ, else the lowest failing rank's error.
  Vote vote(const std::string& err, uint64_t hash, const std::string& call, uint64_t count = 0, uint64_t sum = 0);
  // After the file was touched: if any rank failed, all throw the lowest failing rank's error.
  void agree(const std::string& err);

 private:
  [[noreturn]] void raise(int from, std::string msg);
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  MPI_Op op_ = MPI_OP_NULL;
  int rank_ = 0, size_ = 1;
};

// A stretch of elements adjacent both in the file (global flat index) and in memory.
struct Run {
  int64_t index;
  float* ptr;
  int64_t n;
};

int64_t shape_cols(const Shape& s);  // the "cols" of the rows x cols view (1 for 1-D)
// Checks this rank's pieces against the (R x C) view (in bounds, with memory, disjoint) and
// returns their runs in ascending global flat index, the order in which HDF5 walks a hyperslab
// selection; `boxes` gets the non-empty boxes. On a problem: `err` says which, and {} returned.
std::vector<Run> plan_runs(const std::vector<Piece>& mine, int64_t R, int64_t C, std::vector<Box>& boxes,
                           std::string& err);
// Contiguous memory for the runs: their own when they follow each other in memory (one box, a
// flat shard cut by flat_range_boxes, ...), else `staging` (which the caller copies in or out).
float* runs_buffer(const std::vector<Run>& runs, int64_t count, std::vector<float>& staging, bool& staged);
// This rank's `boxes` of dataset `dset` (shape `s`): `count` floats at `buf` in ascending flat
// order, in one collective H5Dwrite or H5Dread. Returns the error, "" if none (errno then holds
// the system's reason, if any).
std::string transfer(bool write, hid_t dset, hid_t dxpl, const Shape& s, const std::vector<Box>& boxes, float* buf,
                     int64_t count);

// The checksum of docs/checkpoint-format.md over elements [index, index + n) held at v, and over
// runs (with OpenMP threads for large ones). Sums of parts are the checksum of the whole.
uint64_t checksum_range(int64_t index, const float* v, int64_t n);
uint64_t checksum_runs(const std::vector<Run>& runs);

}  // namespace mpigpt::h5
