// MMIDIDX: round trip, the exact bytes Megatron-LM's _IndexWriter produces, reading Megatron files
// with several sequences per document, and one clear error per kind of damage.
#include "io/data/indexed_dataset.h"

#include <doctest/doctest.h>

#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

std::string le64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string le32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }

std::vector<int32_t> read_all(const IndexedDataset& ds, int64_t seq) {
  std::vector<int32_t> out(size_t(ds.sequence_length(seq)));
  ds.read(seq, 0, int64_t(out.size()), out.data());
  return out;
}

// Writes a two-document dataset {1,2,3}, {4,5} and returns its prefix.
std::string write_small(const TempDir& tmp, int vocab = 257) {
  std::string prefix = tmp / "sub/dir/small";
  IndexedDatasetWriter w(prefix, vocab);
  w.add_document(std::vector<int32_t>{1, 2, 3});
  w.add_document(std::vector<int32_t>{4, 5});
  w.finish();
  return prefix;
}

}  // namespace

TEST_CASE("MMIDIDX: the .idx and .bin bytes are exactly what Megatron writes") {
  TempDir tmp;
  std::string prefix = write_small(tmp);
  // Hand-assembled from megatron/core/datasets/indexed_dataset.py (_IndexWriter.write):
  // header, version 1, dtype code, sequence count, document count (including the leading 0),
  // int32 lengths, int64 byte pointers, int64 document indices.
  std::string want = std::string("MMIDIDX\0\0", 9) + le64(1) + std::string(1, char(8)) + le64(2) +
                     le64(3) + le32(3) + le32(2) + le64(0) + le64(6) + le64(0) + le64(1) + le64(2);
  CHECK(want.size() == 82);
  CHECK(read_file(prefix + ".idx") == want);
  CHECK(read_file(prefix + ".bin") == std::string("\1\0\2\0\3\0\4\0\5\0", 10));

  // A vocabulary of 65500 or more ids needs int32 (code 4) and 4-byte pointers.
  std::string big = tmp / "big";
  IndexedDatasetWriter w(big, 70000);
  w.add_document(std::vector<int32_t>{69999, 7});
  w.add_document(std::vector<int32_t>{1});
  w.finish();
  std::string want_big = std::string("MMIDIDX\0\0", 9) + le64(1) + std::string(1, char(4)) + le64(2) +
                         le64(3) + le32(2) + le32(1) + le64(0) + le64(8) + le64(0) + le64(1) + le64(2);
  CHECK(read_file(big + ".idx") == want_big);
  IndexedDataset ds(big);
  CHECK(ds.dtype_code() == 4);
  CHECK(read_all(ds, 0) == std::vector<int32_t>{69999, 7});
}

TEST_CASE("MMIDIDX: write/read round trip") {
  TempDir tmp;
  std::string prefix = tmp / "rt";
  std::vector<std::vector<int32_t>> docs;
  {
    IndexedDatasetWriter w(prefix, 50257);
    for (int d = 0; d < 50; ++d) {
      std::vector<int32_t> doc;
      for (int i = 0; i < 1 + (d * 7) % 23; ++i) doc.push_back((d * 1000 + i * 37) % 50257);
      if (d == 10) doc.clear();  // an empty sequence is legal in the format
      docs.push_back(doc);
      w.add_document(doc);
    }
    CHECK(w.num_documents() == 50);
    w.finish();
  }
  IndexedDataset ds(prefix);
  CHECK(ds.dtype_code() == kMmidxUint16);
  REQUIRE(ds.num_sequences() == 50);
  CHECK(ds.num_documents() == 50);
  int64_t total = 0;
  for (int d = 0; d < 50; ++d) {
    CHECK(read_all(ds, d) == docs[size_t(d)]);
    total += int64_t(docs[size_t(d)].size());
  }
  CHECK(ds.num_tokens() == total);
  int32_t part[3];
  ds.read(3, 2, 3, part);
  CHECK(part[0] == docs[3][2]);
  CHECK(part[2] == docs[3][4]);
}

TEST_CASE("MMIDIDX: a Megatron file with several sequences per document") {
  TempDir tmp;
  std::string prefix = tmp / "meg";
  // 3 sequences (lengths 2, 1, 2), documents [0, 2) and [2, 3): document_indices = 0, 2, 3.
  write_file(prefix + ".idx", std::string("MMIDIDX\0\0", 9) + le64(1) + std::string(1, char(8)) +
                                  le64(3) + le64(3) + le32(2) + le32(1) + le32(2) + le64(0) + le64(4) +
                                  le64(6) + le64(0) + le64(2) + le64(3));
  write_file(prefix + ".bin", std::string("\x0a\0\x0b\0\x0c\0\x0d\0\x0e\0", 10));
  IndexedDataset ds(prefix);
  CHECK(ds.num_sequences() == 3);
  CHECK(ds.num_documents() == 2);
  CHECK(ds.document_index(1) == 2);
  CHECK(read_all(ds, 2) == std::vector<int32_t>{13, 14});
}

TEST_CASE("MMIDIDX: errors name the file and the fix") {
  TempDir tmp;
  CHECK_THROWS_WITH_AS(IndexedDataset(tmp / "nothing"),
                       doctest::Contains("nothing.idx does not exist"), Error);

  std::string prefix = write_small(tmp);
  std::string idx = read_file(prefix + ".idx"), bin = read_file(prefix + ".bin");
  auto restore = [&] {
    write_file(prefix + ".idx", idx);
    write_file(prefix + ".bin", bin);
  };

  std::filesystem::remove(prefix + ".bin");
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("small.bin does not exist"), Error);
  restore();

  write_file(prefix + ".idx", "NOTMAGIC!" + idx.substr(9));
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("small.idx is not an MMIDIDX index"), Error);
  restore();

  write_file(prefix + ".idx", idx.substr(0, 9) + le64(2) + idx.substr(17));
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("unsupported MMIDIDX version 2"), Error);
  restore();

  write_file(prefix + ".idx", idx.substr(0, 17) + std::string(1, char(7)) + idx.substr(18));
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("unsupported token dtype code 7"), Error);
  restore();

  truncate_file(prefix + ".idx", 20);
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("small.idx is truncated"), Error);
  restore();

  truncate_file(prefix + ".idx", 60);
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("small.idx is truncated"), Error);
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("prepare-data"), Error);
  restore();

  truncate_file(prefix + ".bin", 7);
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("small.bin is shorter than its index says"), Error);
  restore();
  // A pointer near the int64 limit is refused, and its message is made without overflowing.
  const size_t pointers_at = 34 + 4 * size_t(uint8_t(idx[18]));
  write_file(prefix + ".idx", idx.substr(0, pointers_at) + le64(INT64_MAX - 11) + idx.substr(pointers_at + 8));
  CHECK_THROWS_WITH_AS(IndexedDataset{prefix}, doctest::Contains("from byte 9223372036854775796 but"), Error);
  restore();
  CHECK(IndexedDataset(prefix).num_tokens() == 5);
}

TEST_CASE("MMIDIDX writer: rejects ids outside the vocabulary, leaves nothing behind unfinished") {
  TempDir tmp;
  std::string prefix = tmp / "w";
  {
    IndexedDatasetWriter w(prefix, 257);
    w.add_document(std::vector<int32_t>{1});
    CHECK_THROWS_WITH_AS(w.add_document(std::vector<int32_t>{257}), doctest::Contains("token id 257"), Error);
  }
  CHECK_FALSE(std::filesystem::exists(prefix + ".bin"));
  CHECK_FALSE(std::filesystem::exists(prefix + ".bin.tmp"));
  CHECK_FALSE(std::filesystem::exists(prefix + ".idx"));
}
