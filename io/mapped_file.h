// A read-only memory map of a whole file: the token files are far larger than memory, and the
// page cache already holds what several ranks on one node read, so they are mapped, not read.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace mpigpt {

class MappedFile {
 public:
  // Maps `path` read-only; throws naming the file and the system error when it cannot.
  // `what` describes the file in messages ("index file", "llm.c token file").
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // A little-endian value at byte `offset` (callers bound-check first). The index arrays sit at
  // unaligned offsets (a 34-byte header), so values are copied out, never dereferenced in place.
  template <class T>
  T at(size_t offset) const {
    T v;
    std::memcpy(&v, data_ + offset, sizeof(T));
    return v;
  }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace mpigpt
