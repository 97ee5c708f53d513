// Tests of NewFile: the final name appears only on commit, links are replaced and never followed,
// an uncommitted file leaves nothing, appends after commit, in-place header rewrites.
#include "lib/core/new_file.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "lib/core/error.h"

using namespace mpigpt;
namespace fs = std::filesystem;

namespace {
std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
struct Dir {
  fs::path path = fs::temp_directory_path() / ("mpigpt_new_file_test_" + std::to_string(::getpid()));
  Dir() { fs::remove_all(path), fs::create_directories(path); }
  ~Dir() { fs::remove_all(path); }
};
}  // namespace

TEST_CASE("NewFile: written under PATH.tmp, renamed on commit, appends after it") {
  Dir d;
  const fs::path p = d.path / "f.txt";
  std::ofstream(p) << "old\n";
  {
    NewFile f(p.string());
    f.write("head");
    f.rewrite(0, "HE", 2);
    f.flush();
    CHECK(slurp(p) == "old\n");  // the old contents until commit
    CHECK(slurp(p.string() + ".tmp") == "HEad");
    f.commit(true);
    f.write(" more");
    f.flush();
  }
  CHECK(slurp(p) == "HEad more");
  CHECK_FALSE(fs::exists(p.string() + ".tmp"));
  {
    NewFile f(p.string());
    f.write("never committed");
  }
  CHECK(slurp(p) == "HEad more");
  CHECK_FALSE(fs::exists(p.string() + ".tmp"));
}

TEST_CASE("NewFile: links planted at PATH or PATH.tmp are replaced, their targets untouched") {
  Dir d;
  const fs::path victim = d.path / "victim", p = d.path / "out";
  std::ofstream(victim) << "keep";
  fs::create_symlink(victim, p);
  fs::create_symlink(victim, p.string() + ".tmp");
  {
    NewFile f(p.string());
    f.write("new");
    f.commit();
  }
  CHECK(slurp(victim) == "keep");
  CHECK_FALSE(fs::is_symlink(p));
  CHECK(slurp(p) == "new");
}

TEST_CASE("NewFile: a folder that does not exist is named in the error") {
  Dir d;
  CHECK_THROWS_WITH_AS(NewFile((d.path / "no" / "f").string()), doctest::Contains("no/f.tmp: No such file"), Error);
}
