// The checkpoint file: one HDF5 file that all ranks write and read collectively with parallel
// HDF5, every tensor a dataset of its *global* shape of which each rank moves the boxes it owns,
// so a file written by one layout is read by any other (DESIGN principle 6).
#pragma once
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/core/tensor.h"

namespace mpigpt {

// A rectangle of a tensor seen as 2-D (rows = first dimension, cols = the product of the rest;
// a 1-D tensor has cols = 1): rows [row0, row0 + rows), columns [col0, col0 + cols).
struct Box {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
  bool operator==(const Box&) const = default;
};

// A box of a tensor and this rank's memory for it (rows x cols floats, row-major).
struct Piece {
  Box box;
  float* data = nullptr;
};

// The boxes covering elements [begin, end) of a (rows x cols) row-major tensor: at most three
// (the rest of the first row, whole rows, the start of the last row). How a flat slice of a
// buffer (a distributed-optimizer shard) becomes hyperslabs.
std::vector<Box> flat_range_boxes(int64_t rows, int64_t cols, int64_t begin, int64_t end);

// Writer and reader know nothing of the GPT: lib/train maps parameters and optimizer state to
// names and boxes. Root attributes carry the metadata; each dataset has a checksum.
class CheckpointWriter {
 public:
  // Creates (truncates) `path` collectively over `comm`.
  CheckpointWriter(MPI_Comm comm, const std::string& path);
  ~CheckpointWriter();
  // Collective: every rank calls write() for the same names with the same global shapes in the
  // same order; `mine` are the boxes this rank writes (possibly none), disjoint over ranks and
  // together covering the tensor. Names may contain '/' (groups are created as needed).
  void write(const std::string& name, const Shape& global, const std::vector<Piece>& mine);
  // Root attributes (collective, same value on every rank).
  void attr(const std::string& key, const std::string& value);
  void attr(const std::string& key, int64_t value);
  void attr(const std::string& key, double value);
  // Collective: stores the checksums, closes and flushes the file (fsync) so that the caller
  // may then declare the save complete.
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class CheckpointReader {
 public:
  // Opens `path` collectively; a missing, truncated or non-checkpoint file is an mpigpt::Error
  // naming it.
  CheckpointReader(MPI_Comm comm, const std::string& path);
  ~CheckpointReader();
  bool has(const std::string& name) const;
  Shape shape(const std::string& name) const;       // error naming file and dataset if absent
  std::vector<std::string> names() const;           // every dataset, sorted
  // Collective, like write(): fills this rank's boxes (disjoint within a rank; ranks may read
  // the same elements). Boxes outside the stored shape: error naming file, dataset, box, shape.
  void read(const std::string& name, const std::vector<Piece>& mine);
  // The same after checking that the stored shape is `expected`: a mismatch is an error naming
  // file, dataset and both shapes (a box list alone cannot tell (768, 2304) from (2304, 768)).
  void read(const std::string& name, const Shape& expected, const std::vector<Piece>& mine);
  // Recompute a dataset's checksum collectively (each rank reads a share of its rows) and
  // compare with the stored one; error naming file and dataset on mismatch.
  void verify(const std::string& name);
  // The stored value; it does not depend on which rank wrote which part.
  uint64_t checksum(const std::string& name) const;
  std::string attr_string(const std::string& key) const;
  int64_t attr_int(const std::string& key) const;
  double attr_double(const std::string& key) const;
  bool has_attr(const std::string& key) const;
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mpigpt
