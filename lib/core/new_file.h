// Output files written safely in folders others may write too (a shared checkpoint folder, /tmp):
// never through a link planted there, and never seen half-written under their final name.
#pragma once
#include <cstdio>
#include <string>
#include <string_view>

namespace mpigpt {

// Writes PATH.tmp, created new (O_CREAT | O_EXCL | O_NOFOLLOW; a stale PATH.tmp, file or link,
// is removed first, never followed), buffered, and renamed over PATH by commit() (a link at
// PATH is replaced, not followed). Errors name the path; a full disk says "disk full".
class NewFile {
 public:
  explicit NewFile(std::string path);
  ~NewFile();  // without commit(): PATH.tmp is removed
  NewFile(const NewFile&) = delete;
  NewFile& operator=(const NewFile&) = delete;

  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  void flush();
  // Overwrites n bytes at `offset` of what was written (a header whose counts are known last).
  void rewrite(size_t offset, const void* data, size_t n);
  // Flushes (and with `durable`, fsyncs the file and its folder) and renames it to PATH. The file
  // stays open: later write()s append to PATH.
  void commit(bool durable = false);
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void failed(const char* doing) const;
  std::string path_, tmp_;
  std::FILE* f_ = nullptr;
  bool committed_ = false;
};

}  // namespace mpigpt
