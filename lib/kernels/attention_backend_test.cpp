#include "lib/kernels/attention_backend.h"

#include <doctest/doctest.h>

#include "lib/core/error.h"

using namespace mpigpt;
using Kind = AttentionBackendSpec::Kind;

TEST_CASE("engine.attention_backend: one implementation, auto, or auto among a list") {
  CHECK(parse_attention_backend("builtin") == AttentionBackendSpec{Kind::Builtin, false, false});
  CHECK(parse_attention_backend("wgmma") == AttentionBackendSpec{Kind::Wgmma, false, false});
  CHECK(parse_attention_backend("cudnn") == AttentionBackendSpec{Kind::Cudnn, false, false});
  CHECK(parse_attention_backend("auto") == AttentionBackendSpec{Kind::Auto, true, true});
  CHECK(parse_attention_backend("builtin,cudnn") == AttentionBackendSpec{Kind::Auto, false, true});
  CHECK(parse_attention_backend("wgmma,builtin") == AttentionBackendSpec{Kind::Auto, true, false});
  CHECK(parse_attention_backend("cudnn,builtin,wgmma") == AttentionBackendSpec{Kind::Auto, true, true});
  CHECK(parse_attention_backend("cudnn").gpu_only());
  CHECK(parse_attention_backend("wgmma").gpu_only());
  for (const char* v : {"builtin", "auto", "builtin,cudnn"}) CHECK_FALSE(parse_attention_backend(v).gpu_only());

  // The canonical spelling parses back to the same choice.
  for (const char* v : {"builtin", "wgmma", "cudnn", "auto", "builtin,wgmma", "builtin,cudnn", "builtin,wgmma,cudnn"}) {
    CAPTURE(v);
    const AttentionBackendSpec spec = parse_attention_backend(v);
    CHECK(parse_attention_backend(attention_backend_str(spec)) == spec);
  }
  CHECK(attention_backend_str(parse_attention_backend("cudnn,builtin")) == "builtin,cudnn");
  CHECK(attention_backend_str(parse_attention_backend("builtin,cudnn,wgmma")) == "auto");
}

TEST_CASE("engine.attention_backend: a bad value is named with what to write") {
  auto fails = [](const char* value, const char* says) {
    CAPTURE(value);
    CHECK_THROWS_WITH_AS(parse_attention_backend(value), doctest::Contains(says), Error);
  };
  fails("flash", "engine.attention_backend = 'flash' is not one of builtin | wgmma | cudnn | auto, nor a");
  fails("builtin,flash", "('flash' is none)");
  fails("builtin,auto", "('auto' is none)");
  fails("builtin,cudnn,cudnn", "names cudnn twice");
  fails("wgmma,cudnn", "lists auto's candidates without builtin");
  fails("wgmma,cudnn", "add it (builtin,wgmma,cudnn)");
  for (const char* v : {"", "builtin,", ",cudnn", "builtin,,cudnn"}) fails(v, "has an empty name");
}
