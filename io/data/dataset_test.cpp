// TokenSource (format detection) and GptDataset: determinism, shifted targets, every window once
// per epoch, disjoint splits, and the errors a user can run into.
#include "io/data/dataset.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <thread>

#include "io/data/indexed_dataset.h"
#include "io/data/llmc_tokens.h"
#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

constexpr int kVocab = 1000;

// `n` documents of varied lengths; token values differ per document so reads can be traced.
std::string write_corpus(const TempDir& tmp, int n, const std::string& name = "corpus") {
  std::string prefix = tmp / name;
  IndexedDatasetWriter w(prefix, kVocab);
  for (int d = 0; d < n; ++d) {
    std::vector<int32_t> doc;
    for (int i = 0; i < 5 + (d * 13) % 29; ++i) doc.push_back((d * 31 + i * 7) % (kVocab - 1));
    doc.push_back(kVocab - 1);  // EOD
    w.add_document(doc);
  }
  w.finish();
  return prefix;
}

// The split's stream rebuilt independently from the documents it reports.
std::vector<int32_t> stream_of_split(const GptDataset& ds, const TokenSource& src) {
  std::vector<int32_t> stream;
  for (uint32_t d : ds.documents()) {
    std::vector<int32_t> doc(size_t(src.document_length(d)));
    src.read(d, 0, int64_t(doc.size()), doc.data());
    stream.insert(stream.end(), doc.begin(), doc.end());
  }
  return stream;
}

}  // namespace

TEST_CASE("TokenSource: opens a prefix, its .bin/.idx name, or an llm.c file") {
  TempDir tmp;
  std::string prefix = write_corpus(tmp, 4);
  auto a = TokenSource::open(prefix);
  CHECK(a->num_documents() == 4);
  CHECK(a->format() == "indexed dataset");
  CHECK(TokenSource::open(prefix + ".bin")->num_tokens() == a->num_tokens());
  CHECK(TokenSource::open(prefix + ".idx")->num_documents() == 4);

  write_llmc_tokens(tmp / "shard.bin", std::vector<int32_t>{5, 6, 7});
  auto b = TokenSource::open(tmp / "shard.bin");
  CHECK(b->format() == "llm.c token file");
  CHECK(b->num_documents() == 1);
  CHECK(b->document_length(0) == 3);

  CHECK_THROWS_WITH_AS(TokenSource::open(tmp / "nope"), doctest::Contains("nope not found"), Error);
  write_file(tmp / "lonely.bin", "not tokens either");
  CHECK_THROWS_WITH_AS(TokenSource::open(tmp / "lonely.bin"), doctest::Contains("no MMIDIDX index"), Error);
  write_file(tmp / "junk.txt", "hello world, not tokens");
  CHECK_THROWS_WITH_AS(TokenSource::open(tmp / "junk.txt"),
                       doctest::Contains("junk.txt is neither an llm.c token file"), Error);
}

TEST_CASE("GptDataset: samples depend only on (seed, index), targets are tokens shifted") {
  TempDir tmp;
  auto src = TokenSource::open(write_corpus(tmp, 40));
  const int T = 16;
  GptDataset a(src, Split::Train, 0.1, T, 1234, kVocab), b(src, Split::Train, 0.1, T, 1234, kVocab);
  const int64_t S = a.samples_per_epoch();
  REQUIRE(S > 5);
  CHECK(S == (a.num_tokens() - 1) / T);
  const int64_t n = 3 * S;  // three epochs

  std::vector<std::vector<int32_t>> in_order(static_cast<size_t>(n)), tgt(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    in_order[size_t(i)].resize(T);
    tgt[size_t(i)].resize(T);
    a.get(i, in_order[size_t(i)].data(), tgt[size_t(i)].data());
  }
  // Instance b reads the same indices scrambled across epochs: same samples.
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[size_t(i)] = (i * 7919) % n;
  std::vector<int32_t> x(T), y(T);
  for (int64_t i : order) {
    b.get(i, x.data(), y.data());
    CHECK(x == in_order[size_t(i)]);
    CHECK(y == tgt[size_t(i)]);
  }

  const auto stream = stream_of_split(a, *src);
  CHECK(int64_t(stream.size()) == a.num_tokens());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t w = a.window_of(i);
    for (int t = 0; t < T; ++t) {
      CHECK(in_order[size_t(i)][size_t(t)] == stream[size_t(w * T + t)]);
      CHECK(tgt[size_t(i)][size_t(t)] == stream[size_t(w * T + t + 1)]);
    }
  }

  // Another seed gives another order.
  GptDataset c(src, Split::Train, 0.1, T, 99, kVocab);
  bool differs = false;
  for (int64_t i = 0; i < S && !differs; ++i) {
    c.get(i, x.data(), y.data());
    differs = x != in_order[size_t(i)];
  }
  CHECK(differs);
}

TEST_CASE("GptDataset: packed rows restart positions at documents and drop the cross-document target") {
  TempDir tmp;
  auto src = TokenSource::open(write_corpus(tmp, 40));
  const int T = 16;
  GptDataset ds(src, Split::Train, 0.1, T, 1234, kVocab);
  const auto stream = stream_of_split(ds, *src);
  // Document starts in the stream, rebuilt from the documents' lengths.
  std::set<int64_t> starts;
  int64_t at = 0;
  for (uint32_t d : ds.documents()) {
    starts.insert(at);
    at += src->document_length(d);
  }
  std::vector<int32_t> x(T), y(T), pos(T), x0(T), y0(T);
  int boundaries = 0;
  for (int64_t i = 0; i < ds.samples_per_epoch(); ++i) {
    ds.get(i, x.data(), y.data(), pos.data());
    ds.get(i, x0.data(), y0.data());
    CHECK(x == x0);  // the same tokens as an unpacked row
    const int64_t w = ds.window_of(i);
    int32_t p = 0;
    for (int t = 0; t < T; ++t, ++p) {
      if (t > 0 && starts.count(w * T + t)) p = 0;
      CHECK(pos[size_t(t)] == p);
      const bool crosses = starts.count(w * T + t + 1) > 0;
      boundaries += crosses;
      // The token before a document start is the EOD of the one before it.
      if (crosses) CHECK(x[size_t(t)] == kVocab - 1);
      CHECK(y[size_t(t)] == (crosses ? -1 : y0[size_t(t)]));
    }
  }
  CHECK(boundaries > 10);  // the corpus' documents (6-34 tokens) end inside many rows
}

TEST_CASE("GptDataset: every window exactly once per epoch, a fresh order each epoch") {
  TempDir tmp;
  auto src = TokenSource::open(write_corpus(tmp, 30));
  GptDataset ds(src, Split::Train, 0.2, 8, 7, kVocab);
  const int64_t S = ds.samples_per_epoch();
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t e = 0; e < 3; ++e) {
    std::vector<int64_t> seen;
    for (int64_t i = e * S; i < (e + 1) * S; ++i) seen.push_back(ds.window_of(i));
    epochs.push_back(seen);
    std::sort(seen.begin(), seen.end());
    for (int64_t w = 0; w < S; ++w) CHECK(seen[size_t(w)] == w);
  }
  CHECK(epochs[0] != epochs[1]);
  CHECK(epochs[1] != epochs[2]);
}

TEST_CASE("GptDataset: concurrent readers see the same samples as a sequential one") {
  TempDir tmp;
  auto src = TokenSource::open(write_corpus(tmp, 30));
  const int T = 8;
  GptDataset shared(src, Split::Train, 0.0, T, 3, kVocab), solo(src, Split::Train, 0.0, T, 3, kVocab);
  const int64_t n = 4 * shared.samples_per_epoch();
  std::vector<int32_t> got(static_cast<size_t>(n * T)), want(static_cast<size_t>(n * T)), y(T);
  // Two threads take alternating samples, so they keep crossing epoch boundaries together.
  auto work = [&](int64_t first) {
    std::vector<int32_t> t(T);
    for (int64_t i = first; i < n; i += 2) shared.get(i, got.data() + i * T, t.data());
  };
  std::thread a(work, 0), b(work, 1);
  a.join();
  b.join();
  for (int64_t i = 0; i < n; ++i) solo.get(i, want.data() + i * T, y.data());
  CHECK(got == want);
}

TEST_CASE("GptDataset: train and validation documents are disjoint and cover the corpus") {
  TempDir tmp;
  auto src = TokenSource::open(write_corpus(tmp, 40));
  GptDataset train(src, Split::Train, 0.1, 4, 5, kVocab), valid(src, Split::Valid, 0.1, 4, 5, kVocab);
  std::set<uint32_t> t(train.documents().begin(), train.documents().end());
  std::set<uint32_t> v(valid.documents().begin(), valid.documents().end());
  CHECK(v.size() == 4);
  CHECK(t.size() == 36);
  for (uint32_t d : v) CHECK(t.count(d) == 0);
  CHECK(train.num_tokens() + valid.num_tokens() == src->num_tokens());
  // At least one validation document whenever valid_fraction > 0.
  GptDataset tiny_valid(src, Split::Valid, 0.001, 4, 5, kVocab);
  CHECK(tiny_valid.num_documents() == 1);
  // valid_fraction 0: the whole source trains (how a separate data.valid_path is read).
  CHECK(GptDataset(src, Split::Train, 0.0, 4, 5, kVocab).num_tokens() == src->num_tokens());
}

TEST_CASE("GptDataset: a single-document source (llm.c) splits its token stream") {
  TempDir tmp;
  std::vector<int32_t> toks(1000);
  for (int i = 0; i < 1000; ++i) toks[size_t(i)] = i % 500;
  write_llmc_tokens(tmp / "s.bin", toks);
  auto src = TokenSource::open(tmp / "s.bin");
  GptDataset train(src, Split::Train, 0.1, 10, 1, 500), valid(src, Split::Valid, 0.1, 10, 1, 500);
  CHECK(train.num_tokens() == 900);
  CHECK(valid.num_tokens() == 100);
  CHECK(valid.samples_per_epoch() == 9);
  std::vector<int32_t> x(10), y(10);
  for (int64_t i = 0; i < valid.samples_per_epoch(); ++i) {
    valid.get(i, x.data(), y.data());
    const int64_t w = valid.window_of(i);
    CHECK(x[0] == toks[size_t(900 + w * 10)]);
    CHECK(y[9] == toks[size_t(900 + w * 10 + 10)]);
  }
}

TEST_CASE("GptDataset without shuffle reads the stream in order, as llm.c's loader does") {
  TempDir tmp;
  std::vector<int32_t> toks(1000);
  for (int i = 0; i < 1000; ++i) toks[size_t(i)] = i % 500;
  write_llmc_tokens(tmp / "s.bin", toks);
  GptDataset train(TokenSource::open(tmp / "s.bin"), Split::Train, 0.0, 10, 1, 500, false);
  REQUIRE(train.samples_per_epoch() == 99);
  std::vector<int32_t> x(10), y(10);
  for (int64_t i : {0, 1, 57, 98, 99, 100, 250}) {  // the second and third epochs repeat the first
    train.get(i, x.data(), y.data());
    const int64_t w = i % 99;
    CHECK(train.window_of(i) == w);
    CHECK(x[0] == toks[size_t(w * 10)]);
    CHECK(y[9] == toks[size_t(w * 10 + 10)]);
  }
  // Documents keep the source's order; validation is the last ones.
  auto src = TokenSource::open(write_corpus(tmp, 20));
  GptDataset t(src, Split::Train, 0.1, 4, 5, kVocab, false), v(src, Split::Valid, 0.1, 4, 5, kVocab, false);
  std::vector<uint32_t> in_order(18);
  for (uint32_t k = 0; k < 18; ++k) in_order[k] = k;
  CHECK(t.documents() == in_order);
  CHECK(v.documents() == std::vector<uint32_t>{18, 19});
}

TEST_CASE("GptDataset: errors name the file, the value and the fix") {
  TempDir tmp;
  auto src = TokenSource::open(write_corpus(tmp, 10));
  std::vector<int32_t> x(8), y(8);

  GptDataset small_vocab(src, Split::Train, 0.0, 8, 1, 500);
  auto read_all = [&] {
    for (int64_t i = 0; i < small_vocab.samples_per_epoch(); ++i) small_vocab.get(i, x.data(), y.data());
  };
  CHECK_THROWS_WITH_AS(read_all(), doctest::Contains("corpus: token id"), Error);
  CHECK_THROWS_WITH_AS(read_all(), doctest::Contains("vocabulary size 500"), Error);
  CHECK_THROWS_WITH_AS(read_all(), doctest::Contains("another tokenizer"), Error);

  CHECK_THROWS_WITH_AS(GptDataset(src, Split::Train, 0.0, 100000, 1, kVocab),
                       doctest::Contains("a sample needs seq_len+1 = 100001"), Error);
  CHECK_THROWS_WITH_AS(GptDataset(src, Split::Valid, 0.1, 200, 1, kVocab),
                       doctest::Contains("the validation split of dataset"), Error);
  CHECK_THROWS_WITH_AS(GptDataset(src, Split::Valid, 0.0, 8, 1, kVocab),
                       doctest::Contains("has 0 tokens"), Error);
  CHECK_THROWS_WITH_AS(GptDataset(src, Split::Train, 1.5, 8, 1, kVocab),
                       doctest::Contains("data.valid_fraction = 1.5"), Error);

  std::string empty = tmp / "empty";
  IndexedDatasetWriter w(empty, kVocab);
  w.finish();
  CHECK_THROWS_WITH_AS(GptDataset(TokenSource::open(empty), Split::Train, 0.0, 8, 1, kVocab),
                       doctest::Contains("empty"), Error);
}
