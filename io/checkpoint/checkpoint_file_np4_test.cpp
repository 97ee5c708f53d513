// The checkpoint file on four ranks: tensors written under one ownership layout are read back
// exactly under every other, with the same checksum whoever wrote what; errors reach every rank
// together; a 64 MiB tensor reports the achieved bandwidth.
#include <doctest/doctest.h>
#include <hdf5.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "io/checkpoint/checkpoint_file.h"
#include "lib/core/error.h"

using namespace mpigpt;

namespace {

int rank_of() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }

// A scratch directory every rank sees (rank 0 makes and removes it).
class SharedTempDir {
 public:
  SharedTempDir() {
    char buf[4096] = {};
    if (rank_of() == 0) {
      std::string t = (std::filesystem::temp_directory_path() / "mpigpt_ck4_XXXXXX").string();
      REQUIRE(mkdtemp(t.data()) != nullptr);
      std::strncpy(buf, t.c_str(), sizeof(buf) - 1);
    }
    MPI_Bcast(buf, sizeof(buf), MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = buf;
  }
  ~SharedTempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    std::error_code ec;
    if (rank_of() == 0) std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& n) const { return path_ + "/" + n; }

 private:
  std::string path_;
};

float value_at(int64_t i) { return float(i % (1 << 22)) * 0.5f - float(i % 5); }  // exact in float

uint64_t reference_checksum(int64_t n) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    float v = value_at(i);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    uint64_t z = (uint64_t(i) * 0x9E3779B97F4A7C15ull) ^ bits;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    sum += z ^ (z >> 31);
  }
  return sum;
}

// This rank's boxes in one contiguous buffer, laid out in the order given (not necessarily the
// file's order, so that the staging path is taken).
struct Owned {
  std::vector<float> mem;
  std::vector<Piece> pieces;
  Owned(const std::vector<Box>& boxes, int64_t C, bool fill) {
    int64_t n = 0;
    for (const Box& b : boxes) n += b.numel();
    mem.assign(size_t(n), -12345.0f);
    float* p = mem.data();
    for (const Box& b : boxes) {
      pieces.push_back(Piece{b, p});
      if (fill)
        for (int64_t r = 0; r < b.rows; ++r)
          for (int64_t c = 0; c < b.cols; ++c) p[r * b.cols + c] = value_at((b.row0 + r) * C + b.col0 + c);
      p += b.numel();
    }
  }
  int64_t wrong(int64_t C) const {  // elements that differ from value_at
    int64_t bad = 0;
    for (const Piece& pc : pieces)
      for (int64_t r = 0; r < pc.box.rows; ++r)
        for (int64_t c = 0; c < pc.box.cols; ++c)
          bad += pc.data[r * pc.box.cols + c] != value_at((pc.box.row0 + r) * C + pc.box.col0 + c);
    return bad;
  }
};

using Layout = std::function<std::vector<Box>(int64_t R, int64_t C, int rank)>;
struct Named {
  const char* name;
  Layout boxes;
};

// Splits [0, n) into 4 uneven parts; part r.
std::pair<int64_t, int64_t> part(int64_t n, int r) {
  const int64_t cut[5] = {0, n * 3 / 20, n * 9 / 20, n * 14 / 20, n};
  return {cut[r], cut[r + 1]};
}

// Those of training (row blocks, column blocks, TP-style QKV row shards, distributed-optimizer
// flat ranges) and irregular ones (interleaved columns with an idle rank, a checkerboard).
std::vector<Named> layouts() {
  return {
      {"row blocks", [](int64_t R, int64_t C, int r) {
         auto [a, b] = part(R, r);
         return std::vector<Box>{{a, b - a, 0, C}};
       }},
      {"column blocks", [](int64_t R, int64_t C, int r) {
         auto [a, b] = part(C, r);
         return std::vector<Box>{{0, R, a, b - a}};
       }},
      {"qkv row shards", [](int64_t R, int64_t C, int r) {  // rows = 3 x (4 x shard); V, K, Q in memory
         std::vector<Box> v;
         for (int q = 2; q >= 0; --q) v.push_back({q * (R / 3) + r * (R / 12), R / 12, 0, C});
         return v;
       }},
      {"optimizer flat ranges", [](int64_t R, int64_t C, int r) {
         auto [a, b] = part(R * C, r);
         return flat_range_boxes(R, C, a, b);
       }},
      {"interleaved columns, rank 3 idle", [](int64_t R, int64_t C, int r) {
         const int64_t q = C / 5;  // rank 0: two column ranges of every row
         if (r == 0) return std::vector<Box>{{0, R, 3 * q, q}, {0, R, 0, q}};
         if (r == 1) return std::vector<Box>{{0, R, q, 2 * q}, {0, R, 4 * q, C - 4 * q}};
         return std::vector<Box>{};
       }},
      {"checkerboard", [](int64_t R, int64_t C, int r) {
         const int64_t h = R / 2, w = C / 2;
         if (r == 0) return std::vector<Box>{{h, R - h, w, C - w}, {0, h, 0, w}};
         if (r == 1) return std::vector<Box>{{0, h, w, C - w}};
         if (r == 2) return std::vector<Box>{{h, R - h, 0, w}};
         return std::vector<Box>{};
       }},
  };
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The same message on every rank: gather lengths and compare to rank 0's.
bool same_on_all_ranks(const std::string& s) {
  std::vector<char> buf(512, 0);
  std::memcpy(buf.data(), s.data(), std::min<size_t>(s.size(), 511));
  std::vector<char> zero(buf);
  MPI_Bcast(zero.data(), 512, MPI_CHAR, 0, MPI_COMM_WORLD);
  int same = buf == zero, all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

}  // namespace

TEST_CASE("every layout reads back what every other layout wrote, with one checksum") {
  SharedTempDir tmp;
  const int r = rank_of();
  const std::string path = tmp / "layouts.h5";
  const std::vector<Named> L = layouts();
  struct T {
    std::string name;
    Shape shape;
  };
  // 2-D and 3-D tensors (the 3-D one's column ranges cut through its inner dimensions) and a
  // 1-D one, whose "columns" are 1 wide.
  const std::vector<T> tensors = {{"model/layers.0.attn.qkv.weight", {24, 10}}, {"optimizer/exp_avg/x", {12, 4, 5}},
                                  {"optimizer/exp_avg_sq/bias", {36}}};
  {
    CheckpointWriter w(MPI_COMM_WORLD, path);
    for (const T& t : tensors)
      for (size_t k = 0; k < L.size(); ++k) {
        const int64_t R = t.shape[0], C = t.shape.numel() / R;
        if (C == 1 && (k == 1 || k == 4 || k == 5)) continue;  // needs columns to split
        Owned mine(L[k].boxes(R, C, r), C, true);
        w.write(t.name + "/" + std::to_string(k), t.shape, mine.pieces);
      }
    w.attr("layouts", int64_t(L.size()));
    w.close();
  }
  CheckpointReader rd(MPI_COMM_WORLD, path);
  CHECK(rd.attr_int("layouts") == int64_t(L.size()));
  int datasets = 0;
  for (const T& t : tensors) {
    const int64_t R = t.shape[0], C = t.shape.numel() / R;
    const uint64_t want = reference_checksum(t.shape.numel());
    for (size_t k = 0; k < L.size(); ++k) {
      const std::string name = t.name + "/" + std::to_string(k);
      if (!rd.has(name)) continue;
      ++datasets;
      CAPTURE(name);
      CHECK(rd.shape(name) == t.shape);
      CHECK(rd.checksum(name) == want);  // independent of who wrote which part
      rd.verify(name);
      for (size_t j = 0; j < L.size(); ++j) {
        if (j == k || (C == 1 && (j == 1 || j == 4 || j == 5))) continue;
        CAPTURE(L[k].name);
        CAPTURE(L[j].name);
        Owned got(L[j].boxes(R, C, r), C, false);
        rd.read(name, t.shape, got.pieces);
        CHECK(got.wrong(C) == 0);
      }
    }
  }
  CHECK(datasets == 15);
}

TEST_CASE("errors reach every rank together") {
  SharedTempDir tmp;
  const int r = rank_of();
  const std::string path = tmp / "e.h5";
  {
    CheckpointWriter w(MPI_COMM_WORLD, path);
    std::vector<float> v(40, 1.0f);
    // Only rank 2 passes a bad box: every rank throws rank 2's message.
    std::vector<Piece> mine = {Piece{{r * 2, 2, 0, 5}, v.data()}};
    if (r == 2) mine[0].box.col0 = 3;
    std::string err = error_of([&] { w.write("w", {8, 5}, mine); });
    CHECK(err.find("lies outside the tensor's 8 x 5") != std::string::npos);
    CHECK(err.find("reported by rank 2 of 4") != std::string::npos);
    CHECK(same_on_all_ranks(err));
    err = error_of([&] { w.write(r == 1 ? "w1" : "w", {8, 5}, {Piece{{r * 2, 2, 0, 5}, v.data()}}); });
    CHECK(err.find("ranks make different calls (rank 0: write('w', (8, 5)) of checkpoint '" + path) !=
          std::string::npos);
    CHECK(same_on_all_ranks(err));
    std::vector<Piece> all_but_rank3;
    if (r != 3) all_but_rank3.push_back(Piece{{r * 2, 2, 0, 5}, v.data()});
    err = error_of([&] { w.write("w", {8, 5}, all_but_rank3); });
    CHECK(err.find("cover 30 elements, the tensor has 40") != std::string::npos);
    err = error_of([&] { w.attr("k", int64_t(r)); });
    CHECK(err.find("ranks make different calls (rank 0: attr('k')") != std::string::npos);
    w.write("w", {8, 5}, {Piece{{r * 2, 2, 0, 5}, v.data()}});
    w.close();
  }
  {
    CheckpointReader rd(MPI_COMM_WORLD, path);
    std::vector<float> v(10);
    std::string err = error_of([&] { rd.read("absent", {Piece{{r * 2, 2, 0, 5}, v.data()}}); });
    CHECK(err.find("has no dataset 'absent'") != std::string::npos);
    CHECK(same_on_all_ranks(err));
    err = error_of([&] { rd.read("w", r == 0 ? Shape{5, 8} : Shape{8, 5}, {}); });
    CHECK(err.find("different calls (rank 0: read('w', (5, 8))") != std::string::npos);  // before the shape error
    err = error_of([&] { rd.read("w", Shape{5, 8}, {}); });
    CHECK(err.find("has shape (8, 5) but the model expects (5, 8)") != std::string::npos);
  }
  // Damage: one flipped byte found by verify() on every rank, then truncation, then not HDF5.
  if (r == 0) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "w", H5P_DEFAULT);
    haddr_t off = H5Dget_offset(d);
    H5Dclose(d), H5Fclose(f);
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(std::streamoff(off + 4 * 33 + 1));
    io.put('\x7f');
  }
  MPI_Barrier(MPI_COMM_WORLD);
  {
    CheckpointReader rd(MPI_COMM_WORLD, path);
    std::string err = error_of([&] { rd.verify("w"); });
    CHECK(err.find("dataset 'w' fails its checksum") != std::string::npos);
    CHECK(same_on_all_ranks(err));
  }
  if (r == 0) std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  MPI_Barrier(MPI_COMM_WORLD);
  std::string err = error_of([&] { CheckpointReader rd(MPI_COMM_WORLD, path); });
  CHECK(err.find("'" + path + "' is damaged or truncated") != std::string::npos);
  CHECK(same_on_all_ranks(err));
  if (r == 0) std::ofstream(path, std::ios::trunc) << "not hdf5";
  MPI_Barrier(MPI_COMM_WORLD);
  err = error_of([&] { CheckpointReader rd(MPI_COMM_WORLD, path); });
  CHECK(err.find("'" + path + "' is not an HDF5 file") != std::string::npos);
  err = error_of([&] { CheckpointReader rd(MPI_COMM_WORLD, path + ".missing"); });
  CHECK(err.find("does not exist") != std::string::npos);
  CHECK(same_on_all_ranks(err));
}

TEST_CASE("a 64 MiB tensor: row blocks and interleaved (staged) columns, timed") {
  SharedTempDir tmp;
  const int r = rank_of();
  const int64_t R = 4096, C = 4096;
  const double mb = double(R * C * 4) / 1e6;
  const Layout rows = [](int64_t R, int64_t C, int r) { return std::vector<Box>{{r * R / 4, R / 4, 0, C}}; };
  const Layout cols = [](int64_t R, int64_t C, int r) {  // two column ranges per rank: staged
    return std::vector<Box>{{0, R, C / 2 + r * C / 8, C / 8}, {0, R, r * C / 8, C / 8}};
  };
  for (auto [what, write_layout, read_layout] :
       {std::tuple{"row blocks", rows, cols}, std::tuple{"interleaved columns", cols, rows}}) {
    const std::string path = tmp / "big.h5";
    Owned mine(write_layout(R, C, r), C, true);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    CheckpointWriter w(MPI_COMM_WORLD, path);
    w.write("big", {R, C}, mine.pieces);
    w.close();  // includes the fsync
    double write_s = MPI_Wtime() - t0;
    CheckpointReader rd(MPI_COMM_WORLD, path);
    Owned got(read_layout(R, C, r), C, false);
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    rd.read("big", {R, C}, got.pieces);
    MPI_Barrier(MPI_COMM_WORLD);
    double read_s = MPI_Wtime() - t0;
    CHECK(got.wrong(C) == 0);
    t0 = MPI_Wtime();
    rd.verify("big");
    double verify_s = MPI_Wtime() - t0;
    if (r == 0)
      MESSAGE(fmt::format("64 MiB written as {} by 4 ranks: write+close+fsync {:.0f} MB/s, read {:.0f} MB/s, verify "
                          "{:.0f} MB/s", what, mb / write_s, mb / read_s, mb / verify_s));
  }
}
