// RuntimeLibrary: a library that is missing, a function that is missing, and a working pair (the C
// math library's cos, which every Linux machine has as libm.so.6).
#include "lib/core/runtime_library.h"

#include <doctest/doctest.h>

#include <string>

using namespace mpigpt;

namespace {
const RuntimeLibrarySpec kSpec{"libm.so.6", "math", "test context: ", "Install it.", "(too old?); upgrade it"};
double identity(double x) { return x; }  // a non-null start, so that bind visibly clears the slot
}  // namespace

TEST_CASE("runtime library: a missing library names itself, the search and the fix") {
  RuntimeLibrarySpec spec = kSpec;
  spec.soname = "libmpigpt_no_such_library.so.7";
  RuntimeLibrary lib(spec);
  CHECK_FALSE(lib.ok());
  const std::string& e = lib.error();
  CHECK(e.find("test context: cannot load the math library libmpigpt_no_such_library.so.7 (") == 0);
  CHECK(e.find("it was searched in LD_LIBRARY_PATH = '") != std::string::npos);
  CHECK(e.find("system library directories. Install it.") != std::string::npos);
  double (*f)(double) = &identity;
  lib.bind("cos", f);
  CHECK((f == nullptr));
  CHECK(lib.error() == e);  // the first failure stays
}

TEST_CASE("runtime library: functions are found; the first missing one is the error") {
  RuntimeLibrary lib(kSpec);
  REQUIRE(lib.ok());
  double (*cosine)(double) = nullptr;
  lib.bind("cos", cosine);
  REQUIRE((cosine != nullptr));
  CHECK(cosine(0.0) == 1.0);
  CHECK(lib.ok());
  double (*none)(double) = &identity;
  lib.bind("mpigpt_no_such_function", none);
  CHECK((none == nullptr));
  lib.bind("another_missing_function", none);
  CHECK(lib.error() == "test context: libm.so.6 lacks the function mpigpt_no_such_function (too old?); upgrade it");
}
