// NewFile: create-new, write, rename (new_file.h).
#include "lib/core/new_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "lib/core/error.h"

namespace mpigpt {

NewFile::NewFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  ::unlink(tmp_.c_str());  // a stale one (a file, or a link, which is removed, not followed)
  const int fd = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) failed("cannot create");
  f_ = ::fdopen(fd, "w");
  if (!f_) {
    ::close(fd);
    failed("cannot create");
  }
}

NewFile::~NewFile() {
  if (f_) std::fclose(f_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void NewFile::failed(const char* doing) const {
  const int e = errno;
  const std::string& name = committed_ ? path_ : tmp_;
  if (e == ENOSPC || e == EDQUOT) fail("disk full writing {} ({}); make room there or write elsewhere", name, std::strerror(e));
  fail("{} {}: {}", doing, name, std::strerror(e));
}

void NewFile::write(const void* data, size_t n) {
  if (n && std::fwrite(data, 1, n, f_) != n) failed("cannot write");
}

void NewFile::flush() {
  if (std::fflush(f_) != 0) failed("cannot write");
}

void NewFile::rewrite(size_t offset, const void* data, size_t n) {
  flush();
  if (::pwrite(fileno(f_), data, n, off_t(offset)) != ssize_t(n)) failed("cannot write");
}

void NewFile::commit(bool durable) {
  flush();
  if (durable && ::fsync(fileno(f_)) != 0) failed("cannot sync");
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail("cannot rename {} to {}: {}", tmp_, path_, std::strerror(errno));
  committed_ = true;
  if (durable) {
    const std::string dir = std::filesystem::absolute(path_).parent_path().string();
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) ::fsync(fd), ::close(fd);
  }
}

}  // namespace mpigpt
