// The checkpoint file: writer and reader of the format in docs/checkpoint-format.md (keep the two
// in step) on top of hdf5_collective.h; this file owns the layout of the file, the validation
// of names, shapes and attributes, and the durability of a save.
#include "io/checkpoint/checkpoint_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include "io/checkpoint/hdf5_collective.h"
#include "lib/core/error.h"

namespace mpigpt {
namespace {

using h5::Handle, h5::Run, h5::watched;

constexpr const char* kFormat = "mpigpt-checkpoint";
constexpr int64_t kFormatVersion = 1;
constexpr const char* kChecksumAlgorithm = "splitmix64-sum-v1";
constexpr unsigned kMaxCompact = 65535;   // links and attributes an object header may hold (HDF5's most)
constexpr hsize_t kAlign = 1 << 20;          // datasets of 1 MiB or more start on a 1 MiB boundary
constexpr int64_t kKickBytes = 64 << 20;     // start the disk on every 64 MiB written
constexpr int64_t kVerifyFloats = 16 << 20;  // verify() holds at most 64 MiB per rank
constexpr const char* kAttrsChecksum = "attributes_checksum";

// A root attribute as read or written.
struct Attr {
  enum Kind { Str, Int, Dbl, Other } kind = Other;
  std::string s;
  int64_t i = 0;
  uint64_t u = 0;  // an integer as unsigned: checksums use all 64 bits
  double d = 0;
};
// Its kind and value hashed: the writers vote with it, and attributes_checksum sums it per key.
uint64_t attr_hash(const Attr& a) {
  if (a.kind == Attr::Str) return h5::fnv1a(1, a.s.data(), a.s.size());
  if (a.kind == Attr::Int) return h5::fnv1a(2, &a.i, 8);
  return a.kind == Attr::Dbl ? h5::fnv1a(3, &a.d, 8) : 4;
}

std::string check_name(const std::string& name) {
  bool bad = name.empty() || name.front() == '/' || name.back() == '/' || name.find("//") != std::string::npos;
  for (size_t a = 0, b = 0; !bad && a <= name.size(); a = b + 1) {
    b = std::min(name.find('/', a), name.size());
    bad = name.compare(a, b - a, ".") == 0 || name.compare(a, b - a, "..") == 0;
  }
  return bad ? fmt::format("dataset name '{}' is invalid: use non-empty components other than '.' and '..', "
                           "separated by single '/', without a leading or trailing '/'", name) : "";
}

}  // namespace

std::vector<Box> flat_range_boxes(int64_t rows, int64_t cols, int64_t begin, int64_t end) {
  if (rows < 0 || cols < 0 || begin < 0 || begin > end || end > rows * cols)
    fail("flat_range_boxes: range [{}, {}) is not inside a {} x {} tensor", begin, end, rows, cols);
  std::vector<Box> out;
  if (begin == end) return out;
  int64_t r0 = begin / cols, c0 = begin % cols, r1 = end / cols, c1 = end % cols;
  if (r0 == r1) return {Box{r0, 1, c0, c1 - c0}};
  if (c0) out.push_back(Box{r0++, 1, c0, cols - c0});
  if (r1 > r0) out.push_back(Box{r0, r1 - r0, 0, cols});
  if (c1) out.push_back(Box{r1, 1, 0, c1});
  return out;
}

// ---- writer ----------------------------------------------------------------------------------
struct CheckpointWriter::Impl {
  h5::Agreement ag;
  std::string path;
  Handle file, dxpl, gcpl, dcpl;
  bool node_leader = false;  // lowest rank of its node: fsyncs the file and kicks writeback
  int kick_fd = -1;
  int64_t unkicked = 0;  // dataset bytes written since the last kick
  std::vector<float> staging;
  uint64_t attrs_sum = 0;  // attributes_checksum: the sum of every root attribute's hash with its key

  Impl(MPI_Comm comm, const std::string& p) : ag(comm), path(p) {}
  ~Impl() {
    h5::Quiet quiet;
    // A failed save is left open: its close would flush into the same failure (a full disk), and
    // it is collective, so ranks that failed at different points of it would wait for each other
    // forever. The job ends on the error anyway.
    if (std::uncaught_exceptions() > 0) file.release();
    watched("the close of checkpoint '" + path + "'", [&] { return file.reset(); });
    if (kick_fd >= 0) ::close(kick_fd);
  }
  std::string what(const std::string& call) const { return fmt::format("{} of checkpoint '{}'", call, path); }
  std::string h5fail(const char* call, const std::string& what) const {
    return fmt::format("checkpoint '{}': {} failed for {}: {}", path, call, what, h5::error());
  }
  // Starts the disk on what this node wrote so far without waiting for it (Linux), so that the
  // fsync in close() finds little left: a save takes about max(CPU, disk) instead of their sum.
  void kick(int64_t bytes) {
    if ((unkicked += bytes) < kKickBytes || kick_fd < 0) return;
#ifdef __linux__
    sync_file_range(kick_fd, 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
    unkicked = 0;
  }
  // `hash`: the attribute's kind and value (attr_hash); every rank must pass the same.
  void put_attr(const std::string& key, hid_t file_type, hid_t mem_type, const void* value, uint64_t hash) {
    h5::Quiet quiet;
    const std::string call = what(fmt::format("attr('{}')", key));
    hash = h5::fnv1a(hash, key.data(), key.size());
    ag.vote(file.ok() ? "" : fmt::format("checkpoint '{}': attr('{}') after close()", path, key), hash, call);
    std::string err = watched(call, [&]() -> std::string {
      if (H5Aexists(file, key.c_str()) > 0)
        return fmt::format("checkpoint '{}': root attribute '{}' is written twice ('format' and 'format_version' "
                           "are reserved); write each key once", path, key);
      return h5::put_scalar(file, key, file_type, mem_type, value) ? ""
                                                                    : h5fail("H5Acreate2/H5Awrite", "root attribute '" + key + "'");
    });
    ag.agree(err);
    attrs_sum += hash;  // written
  }
};

CheckpointWriter::CheckpointWriter(MPI_Comm comm, const std::string& path) : impl_(std::make_unique<Impl>(comm, path)) {
  h5::Quiet quiet;
  Impl& I = *impl_;
  std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  std::error_code ec;
  I.ag.agree(std::filesystem::is_directory(dir, ec) ? "" : fmt::format(
      "cannot create checkpoint '{}': directory '{}' does not exist (here); create it first", path, dir.string()));
  Handle fapl = h5::fapl_mpio(I.ag.comm());
  // Large datasets start on 1 MiB boundaries (file-system blocks and stripes), and small metadata
  // is gathered in 1 MiB blocks instead of being strewn between the tensors.
  H5Pset_alignment(fapl, kAlign, kAlign), H5Pset_meta_block_size(fapl, kAlign);
  // Damaged metadata must be an error at the open, not libhdf5 acting on it (in the 1.6 formats a
  // damaged attribute header crashed it): the 1.8 formats, whose object headers carry checksums,
  // and every link and attribute held in its object's header (dense storage keeps them in heap
  // blocks without one). Any HDF5 >= 1.8 reads the file.
  H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_V18);
  I.gcpl = Handle(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
  Handle fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);  // the root group's
  for (hid_t pl : {hid_t(I.gcpl), hid_t(fcpl)})
    H5Pset_link_phase_change(pl, kMaxCompact, kMaxCompact), H5Pset_attr_phase_change(pl, kMaxCompact, kMaxCompact);
  I.file = watched(I.what("the creation (H5Fcreate)"),
                   [&] { return Handle(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, fapl), H5Fclose); });
  I.ag.agree(I.file.ok() ? "" : fmt::format("cannot create checkpoint '{}' (H5Fcreate: {}); check that the directory "
                                            "is writable and on a file system every rank sees", path, h5::error()));
  MPI_Comm node;
  MPI_Comm_split_type(I.ag.comm(), MPI_COMM_TYPE_SHARED, I.ag.rank(), MPI_INFO_NULL, &node);
  int node_rank = 0;
  MPI_Comm_rank(node, &node_rank), MPI_Comm_free(&node);
  I.node_leader = node_rank == 0;
  if (I.node_leader) I.kick_fd = ::open(path.c_str(), O_RDONLY);  // only for kick(): failure is harmless
  I.dxpl = h5::collective_dxpl();
  // Contiguous, allocated at creation (parallel HDF5 needs that) and never filled: every element
  // is written by its owner, so a fill would write the whole checkpoint twice.
  I.dcpl = Handle(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_layout(I.dcpl, H5D_CONTIGUOUS), H5Pset_alloc_time(I.dcpl, H5D_ALLOC_TIME_EARLY);
  H5Pset_fill_time(I.dcpl, H5D_FILL_TIME_NEVER);
  attr("format", std::string(kFormat));
  attr("format_version", kFormatVersion);
}

CheckpointWriter::~CheckpointWriter() = default;

void CheckpointWriter::write(const std::string& name, const Shape& global, const std::vector<Piece>& mine) {
  h5::Quiet quiet;
  Impl& I = *impl_;
  std::string err = I.file.ok() ? check_name(name) : "write() after close()";
  if (err.empty() && (global.ndim < 1 || global.ndim > kMaxDims))
    err = fmt::format("shape {} is not that of a tensor of rank 1..{}", global.str(), kMaxDims);
  for (int i = 0; err.empty() && i < global.ndim; ++i)
    if (global.d[i] < 0) err = fmt::format("shape {} has a negative dimension", global.str());
  std::vector<Box> boxes;
  std::vector<Run> runs;
  if (err.empty()) runs = h5::plan_runs(mine, global[0], h5::shape_cols(global), boxes, err);
  int64_t count = 0;
  for (const Run& r : runs) count += r.n;
  if (!err.empty()) err = fmt::format("checkpoint '{}', dataset '{}' {}: {}", I.path, name, global.str(), err);
  const h5::Vote v = I.ag.vote(err, h5::hash_call(name, global), fmt::format("write('{}', {}) of checkpoint '{}'", name,
                           global.str(), I.path), uint64_t(count), err.empty() ? h5::checksum_runs(runs) : 0);
  if (v.count != uint64_t(global.numel()))
    fail("checkpoint '{}', dataset '{}' {}: the ranks' boxes cover {} elements, the tensor has {}; the boxes must "
         "be disjoint across ranks and cover the tensor", I.path, name, global.str(), v.count, global.numel());

  // H5Dcreate2 fails alike on every rank (same arguments, checked above, and the same metadata),
  // so its status is agreed together with the transfer's.
  hsize_t dims[kMaxDims];
  for (int i = 0; i < global.ndim; ++i) dims[i] = hsize_t(global.d[i]);
  Handle fspace(H5Screate_simple(global.ndim, dims, nullptr), H5Sclose);
  const std::string dataset = fmt::format("dataset '{}'", name);
  err = watched(I.what("the write of " + dataset), [&]() -> std::string {
    for (size_t p = name.find('/'); p != std::string::npos; p = name.find('/', p + 1)) {
      const std::string g = name.substr(0, p);  // each group on the path, with the compact links
      if (H5Lexists(I.file, g.c_str(), H5P_DEFAULT) != 0) continue;  // there, or a dataset: H5Dcreate2 says so
      if (!Handle(H5Gcreate2(I.file, g.c_str(), H5P_DEFAULT, I.gcpl, H5P_DEFAULT), H5Gclose).ok())
        return I.h5fail("H5Gcreate2", fmt::format("group '{}' of {}", g, dataset));
    }
    Handle dset(H5Dcreate2(I.file, name.c_str(), H5T_IEEE_F32LE, fspace, H5P_DEFAULT, I.dcpl, H5P_DEFAULT), H5Dclose);
    if (!dset.ok()) return I.h5fail("H5Dcreate2", dataset + " (written twice, or part of its path is a dataset?)");
    bool staged;
    float* buf = h5::runs_buffer(runs, count, I.staging, staged);
    if (staged)
      for (int64_t o = 0; const Run& r : runs) std::memcpy(buf + o, r.ptr, size_t(r.n) * 4), o += r.n;
    if (std::string e = h5::transfer(true, dset, I.dxpl, global, boxes, buf, count); !e.empty())
      return h5::write_failure(I.path, dataset, count * 4, e);
    Handle algo = h5::string_type(kChecksumAlgorithm);
    if (!(h5::put_scalar(dset, "checksum", H5T_STD_U64LE, H5T_NATIVE_UINT64, &v.sum) &&
          h5::put_scalar(dset, "checksum_algorithm", algo, algo, kChecksumAlgorithm)))
      return I.h5fail("H5Acreate2/H5Awrite", "the checksum of " + dataset);
    return "";
  });
  I.ag.agree(err);
  I.kick(global.numel() * 4);
}

void CheckpointWriter::attr(const std::string& key, const std::string& value) {
  Handle t = h5::string_type(value);
  impl_->put_attr(key, t, t, value.c_str(), attr_hash(Attr{Attr::Str, value}));
}
void CheckpointWriter::attr(const std::string& key, int64_t value) {
  impl_->put_attr(key, H5T_STD_I64LE, H5T_NATIVE_INT64, &value, attr_hash(Attr{Attr::Int, "", value}));
}
void CheckpointWriter::attr(const std::string& key, double value) {
  impl_->put_attr(key, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value, attr_hash(Attr{Attr::Dbl, "", 0, 0, value}));
}

void CheckpointWriter::close() {
  h5::Quiet quiet;
  Impl& I = *impl_;
  if (!I.file.ok()) return;
  // The metadata is written at the flush; the close that follows only when every rank flushed
  // (a rank whose flush failed must not enter the collective close alone). First the root
  // attributes' checksum: the datasets' do not cover the iteration, the data position or the
  // configuration, and a damaged one of those can still read as a valid value. Every rank holds
  // the same sum: each attribute was agreed on when written.
  I.ag.agree(watched(I.what("the flush (H5Fflush)"), [&] {
    if (!h5::put_scalar(I.file, kAttrsChecksum, H5T_STD_U64LE, H5T_NATIVE_UINT64, &I.attrs_sum))
      return I.h5fail("H5Acreate2/H5Awrite", fmt::format("root attribute '{}'", kAttrsChecksum));
    errno = 0;
    return H5Fflush(I.file, H5F_SCOPE_GLOBAL) < 0 ? h5::write_failure(I.path, "the metadata", 0, h5::error()) : "";
  }));
  I.ag.agree(watched(I.what("the close (H5Fclose)"), [&] {
    errno = 0;
    return I.file.reset() < 0 ? h5::write_failure(I.path, "the metadata", 0, h5::error()) : "";
  }));
  // Durable before we return: one rank per node fsyncs the file (that node's page cache holds its
  // ranks' writes), rank 0 also the directory, which holds the new name.
  std::string err;
  auto sync = [&](const std::string& p, int flags) {
    const Waiting w([&] { return I.what("the fsync of '" + p + "'"); });
    errno = 0;
    int fd = ::open(p.c_str(), flags);
    if (fd < 0 || ::fsync(fd) != 0) err = h5::write_failure(I.path, "'" + p + "' to disk (fsync)", 0, "the save is not durable");
    if (fd >= 0) ::close(fd);
  };
  if (I.node_leader) sync(I.path, O_RDONLY);
  if (I.ag.rank() == 0 && err.empty())
    sync(std::filesystem::absolute(I.path).parent_path().string(), O_RDONLY | O_DIRECTORY);
  I.ag.agree(err);
}

// ---- reader ----------------------------------------------------------------------------------
namespace {
struct Entry {
  Shape shape;
  std::string problem;  // why it cannot be read as a float32 tensor ("" when it can)
  bool has_checksum = false;
  uint64_t checksum = 0;
  std::string algorithm;
};
// A scalar attribute of any string, integer or float type, as what it holds.
Attr read_attr(hid_t loc, const char* key) {
  Attr out;
  Handle a(H5Aopen(loc, key, H5P_DEFAULT), H5Aclose);
  Handle t(a.ok() ? H5Aget_type(a) : -1, H5Tclose), sp(a.ok() ? H5Aget_space(a) : -1, H5Sclose);
  if (!t.ok() || !sp.ok() || H5Sget_simple_extent_npoints(sp) != 1) return out;
  const H5T_class_t cls = H5Tget_class(t);
  const bool is_unsigned = cls == H5T_INTEGER && H5Tget_sign(t) == H5T_SGN_NONE;
  if (cls == H5T_INTEGER && H5Aread(a, is_unsigned ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64, &out.u) >= 0)
    out.kind = Attr::Int, std::memcpy(&out.i, &out.u, 8);
  if (cls == H5T_FLOAT && H5Aread(a, H5T_NATIVE_DOUBLE, &out.d) >= 0) out.kind = Attr::Dbl;
  if (cls == H5T_STRING && H5Tis_variable_str(t) > 0) {
    Handle mt = h5::string_type();
    H5Tset_cset(mt, H5Tget_cset(t));
    char* p = nullptr;
    if (H5Aread(a, mt, &p) >= 0) out.kind = Attr::Str, out.s = p ? p : "";
    if (p) H5free_memory(p);
  } else if (cls == H5T_STRING) {  // fixed length (h5py stores numpy bytes so): cut at the padding
    std::string buf(H5Tget_size(t), '\0');
    if (H5Aread(a, t, buf.data()) >= 0) out.kind = Attr::Str, out.s = buf.substr(0, buf.find('\0'));
    if (H5Tget_strpad(t) == H5T_STR_SPACEPAD) out.s.erase(out.s.find_last_not_of(' ') + 1);
  }
  return out;
}
}  // namespace

struct CheckpointReader::Impl {
  h5::Agreement ag;
  std::string path;
  Handle file, dxpl;
  std::map<std::string, Entry> index;  // read once at open, identical on every rank
  std::map<std::string, Attr> attrs;
  std::vector<float> staging;

  Impl(MPI_Comm comm, const std::string& p) : ag(comm), path(p) {}
  ~Impl() {
    h5::Quiet quiet;
    if (std::uncaught_exceptions() > 0) file.release();  // as the writer's: no collective close while failing
    watched("the close of checkpoint '" + path + "'", [&] { return file.reset(); });
  }
  // The dataset, or null and why it cannot be read (the same on every rank, as the index is).
  const Entry* find(const std::string& name, std::string& err) const {
    auto it = index.find(name);
    if (it == index.end())
      err = fmt::format("checkpoint '{}' has no dataset '{}' ({} datasets; was it written for another model or "
                        "layout?)", path, name, index.size());
    else if (!it->second.problem.empty())
      err = fmt::format("checkpoint '{}', dataset '{}': {}", path, name, it->second.problem);
    return err.empty() ? &it->second : nullptr;
  }
  const Entry& entry(const std::string& name) const {
    std::string err;
    const Entry* e = find(name, err);
    return e ? *e : throw Error(err);
  }
  const Attr& attr(const std::string& key, Attr::Kind kind) const {
    static const char* kinds[] = {"a string", "an integer", "a float", "of another type"};
    auto it = attrs.find(key);
    if (it == attrs.end())
      fail("checkpoint '{}' has no root attribute '{}'; was it written by another program?", path, key);
    if (it->second.kind != kind)
      fail("checkpoint '{}': root attribute '{}' is {}, not {}", path, key, kinds[it->second.kind], kinds[kind]);
    return it->second;
  }
  std::string build_index();
  void check_root() const;
  void read(const std::string& name, const Shape* expected, const std::vector<Piece>& mine);
};

// Every dataset's shape, type and checksum, and every root attribute; collective (all ranks make
// the same metadata reads, which rank 0 performs and broadcasts).
std::string CheckpointReader::Impl::build_index() {
  std::vector<std::string> names;
  auto visit = [](hid_t, const char* n, const H5O_info_t* info, void* d) -> herr_t {
    if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(d)->push_back(n);
    return 0;
  };
  if (H5Ovisit2(file, H5_INDEX_NAME, H5_ITER_INC, visit, &names, H5O_INFO_BASIC) < 0)
    return "H5Ovisit2: " + h5::error();
  for (const std::string& n : names) {
    Entry& e = index[n];
    Handle d(H5Dopen2(file, n.c_str(), H5P_DEFAULT), H5Dclose);
    Handle sp(d.ok() ? H5Dget_space(d) : -1, H5Sclose), t(d.ok() ? H5Dget_type(d) : -1, H5Tclose);
    if (!sp.ok() || !t.ok()) return fmt::format("H5Dopen2 of '{}': {}", n, h5::error());
    const int nd = H5Sget_simple_extent_ndims(sp);
    hsize_t dims[H5S_MAX_RANK] = {};
    H5Sget_simple_extent_dims(sp, dims, nullptr);
    e.shape.ndim = std::clamp(nd, 0, kMaxDims);
    for (int i = 0; i < e.shape.ndim; ++i) e.shape.d[i] = int64_t(dims[i]);
    if (nd < 1 || nd > kMaxDims)
      e.problem = fmt::format("it has rank {}, checkpoints hold tensors of rank 1..{}", nd, kMaxDims);
    else if (H5Tequal(t, H5T_IEEE_F32LE) <= 0) e.problem = "its elements are not float32 (little-endian)";
    if (H5Aexists(d, "checksum") > 0) {
      Attr c = read_attr(d, "checksum");
      e.has_checksum = c.kind == Attr::Int, e.checksum = c.u;
    }
    if (H5Aexists(d, "checksum_algorithm") > 0) e.algorithm = read_attr(d, "checksum_algorithm").s;
  }
  auto each = [](hid_t loc, const char* n, const H5A_info_t*, void* d) -> herr_t {
    return (*static_cast<std::map<std::string, Attr>*>(d))[n] = read_attr(loc, n), 0;
  };
  if (H5Aiterate2(file, H5_INDEX_NAME, H5_ITER_INC, nullptr, each, &attrs) < 0) return "H5Aiterate2: " + h5::error();
  return "";
}

CheckpointReader::CheckpointReader(MPI_Comm comm, const std::string& path) : impl_(std::make_unique<Impl>(comm, path)) {
  h5::Quiet quiet;
  Impl& I = *impl_;
  // Rank 0 first tells apart the ways a path can fail to be a checkpoint, with a serial open, so
  // that the parallel open below only meets files that open.
  std::string err;
  std::error_code ec;
  if (I.ag.rank() == 0) {
    if (!std::filesystem::exists(path, ec))
      err = fmt::format("checkpoint file '{}' does not exist; check the path", path);
    else if (!std::filesystem::is_regular_file(path, ec))
      err = fmt::format("checkpoint '{}' is not a regular file; give the path of the .h5 file", path);
    else if (H5Fis_hdf5(path.c_str()) <= 0)
      err = fmt::format("'{}' is not an HDF5 file, so not an mpigpt checkpoint; give the path of a checkpoint "
                        "written by mpigpt", path);
    else if (Handle f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose); !f.ok())
      err = fmt::format("checkpoint '{}' is damaged or truncated ({}); the save that wrote it may not have "
                        "finished; use an earlier checkpoint", path, h5::error());
  }
  I.ag.agree(err);
  I.ag.agree(std::filesystem::exists(path, ec) ? "" : fmt::format("checkpoint '{}' exists on rank 0 but not here; "
                                                                    "put it on a file system every rank sees", path));
  Handle fapl = h5::fapl_mpio(I.ag.comm());
  const std::string opening = fmt::format("the opening of checkpoint '{}' (H5Fopen, its index)", path);
  I.file = watched(opening, [&] { return Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose); });
  I.ag.agree(I.file.ok() ? "" : fmt::format("cannot open checkpoint '{}' (H5Fopen: {})", path, h5::error()));
  try {
    err = watched(opening, [&] { return I.build_index(); });
    I.ag.agree(err.empty() ? "" : fmt::format("checkpoint '{}' is damaged: {}", path, err));
    I.check_root();
  } catch (const Error&) {
    // Every rank fails here alike (the index is the same on every rank), so the collective close
    // is safe, and a process that goes on (a tool trying several files, a test) keeps no file open.
    watched("the close of checkpoint '" + path + "'", [&] { return I.file.reset(); });
    throw;
  }
  I.dxpl = h5::collective_dxpl();
}

// The root attributes every reader checks: format, version and (where saved) their checksum.
void CheckpointReader::Impl::check_root() const {
  auto f = attrs.find("format");
  if (f == attrs.end() || f->second.kind != Attr::Str || f->second.s != kFormat)
    fail("'{}' is an HDF5 file but not an mpigpt checkpoint: its root attribute 'format' is {} (expected '{}')", path,
         f == attrs.end() ? "missing" : f->second.kind == Attr::Str ? "'" + f->second.s + "'" : "not a string",
         kFormat);
  auto v = attrs.find("format_version");
  if (v == attrs.end() || v->second.kind != Attr::Int || v->second.i < 1)
    fail("checkpoint '{}': root attribute 'format_version' is missing or not a positive integer; the file is damaged",
         path);
  if (v->second.i > kFormatVersion)
    fail("checkpoint '{}' has format_version {}, this mpigpt reads version {} or older; it was written by a newer "
         "mpigpt: update mpigpt to read it", path, v->second.i, kFormatVersion);
  if (auto c = attrs.find(kAttrsChecksum); c != attrs.end()) {
    uint64_t sum = 0;
    for (const auto& [key, a] : attrs)
      if (key != kAttrsChecksum) sum += h5::fnv1a(attr_hash(a), key.data(), key.size());
    if (c->second.kind != Attr::Int || c->second.u != sum)
      fail("checkpoint '{}' is damaged: its root attributes (iteration, data position, configuration) do not match "
           "their checksum '{}'; use an earlier checkpoint (after editing attributes on purpose, delete {})", path,
           kAttrsChecksum, kAttrsChecksum);
  }
}

CheckpointReader::~CheckpointReader() = default;

bool CheckpointReader::has(const std::string& name) const { return impl_->index.count(name) > 0; }
Shape CheckpointReader::shape(const std::string& name) const { return impl_->entry(name).shape; }
std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : impl_->index) out.push_back(n);
  return out;
}
uint64_t CheckpointReader::checksum(const std::string& name) const {
  const Entry& e = impl_->entry(name);
  if (!e.has_checksum)
    fail("checkpoint '{}', dataset '{}' has no 'checksum' attribute; the file is damaged", path(), name);
  return e.checksum;
}
std::string CheckpointReader::attr_string(const std::string& key) const { return impl_->attr(key, Attr::Str).s; }
int64_t CheckpointReader::attr_int(const std::string& key) const { return impl_->attr(key, Attr::Int).i; }
double CheckpointReader::attr_double(const std::string& key) const { return impl_->attr(key, Attr::Dbl).d; }
bool CheckpointReader::has_attr(const std::string& key) const { return impl_->attrs.count(key) > 0; }
const std::string& CheckpointReader::path() const { return impl_->path; }

void CheckpointReader::Impl::read(const std::string& name, const Shape* expected, const std::vector<Piece>& mine) {
  std::string err;
  const Entry* e = find(name, err);
  if (e && expected && !(e->shape == *expected))
    err = fmt::format("checkpoint '{}', dataset '{}' has shape {} but the model expects {}; the checkpoint was "
                      "written for another model configuration", path, name, e->shape.str(), expected->str());
  std::vector<Box> boxes;
  std::vector<Run> runs;
  if (err.empty()) {
    runs = h5::plan_runs(mine, e->shape[0], h5::shape_cols(e->shape), boxes, err);
    if (!err.empty()) err = fmt::format("checkpoint '{}', dataset '{}' {}: {}", path, name, e->shape.str(), err);
  }
  const Shape call = expected ? *expected : Shape{};
  ag.vote(err, h5::hash_call(name, call),
          fmt::format("read('{}'{}) of checkpoint '{}'", name, expected ? ", " + call.str() : "", path));
  int64_t count = 0;
  for (const Run& r : runs) count += r.n;
  bool staged;
  float* buf = h5::runs_buffer(runs, count, staging, staged);
  err = watched(fmt::format("the read of dataset '{}' of checkpoint '{}'", name, path), [&] {
    Handle dset(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);  // fails alike everywhere, if at all
    return dset.ok() ? h5::transfer(false, dset, dxpl, e->shape, boxes, buf, count) : "H5Dopen2 failed: " + h5::error();
  });
  ag.agree(err.empty() ? "" : fmt::format("checkpoint '{}', dataset '{}': {}", path, name, err));
  if (staged)
    for (int64_t o = 0; const Run& r : runs) std::memcpy(r.ptr, buf + o, size_t(r.n) * 4), o += r.n;
}

void CheckpointReader::read(const std::string& name, const std::vector<Piece>& mine) {
  h5::Quiet quiet;
  impl_->read(name, nullptr, mine);
}

void CheckpointReader::read(const std::string& name, const Shape& expected, const std::vector<Piece>& mine) {
  h5::Quiet quiet;
  impl_->read(name, &expected, mine);
}

void CheckpointReader::verify(const std::string& name) {
  h5::Quiet quiet;
  Impl& I = *impl_;
  std::string err;
  const Entry* e = I.find(name, err);
  if (e && !e->has_checksum)
    err = fmt::format("checkpoint '{}', dataset '{}' has no 'checksum' attribute; the file is damaged", path(), name);
  else if (e && e->algorithm != kChecksumAlgorithm)
    err = fmt::format("checkpoint '{}', dataset '{}': checksum_algorithm '{}' is unknown (this mpigpt knows '{}'); "
                      "update mpigpt", path(), name, e->algorithm, kChecksumAlgorithm);
  I.ag.vote(err, h5::hash_call(name, Shape{}), fmt::format("verify('{}') of checkpoint '{}'", name, path()));
  // Rows split evenly over the ranks, read in steps of bounded memory; every rank takes the same
  // number of steps (some with nothing to read) because each step is a collective read.
  const int64_t R = e->shape[0], C = h5::shape_cols(e->shape), P = I.ag.size();
  const int64_t r0 = R * I.ag.rank() / P, r1 = R * (I.ag.rank() + 1) / P;
  const int64_t step = std::max<int64_t>(1, kVerifyFloats / std::max<int64_t>(C, 1));
  const int64_t steps = ((R + P - 1) / P + step - 1) / step;
  Handle dset(H5Dopen2(I.file, name.c_str(), H5P_DEFAULT), H5Dclose);
  std::vector<float>& buf = I.staging;
  buf.resize(std::max(buf.size(), size_t(std::min(R, step) * C)));
  uint64_t sum = 0, total = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t a = std::min(r1, r0 + s * step), b = std::min(r1, a + step);
    std::vector<Box> boxes;
    if (b > a) boxes.push_back(Box{a, b - a, 0, C});
    err = watched(fmt::format("the verification of dataset '{}' of checkpoint '{}'", name, path()), [&] {
      return dset.ok() ? h5::transfer(false, dset, I.dxpl, e->shape, boxes, buf.data(), (b - a) * C)
                       : "H5Dopen2 failed: " + h5::error();
    });
    I.ag.agree(err.empty() ? "" : fmt::format("checkpoint '{}', dataset '{}': {}", path(), name, err));
    sum += h5::checksum_runs({Run{a * C, buf.data(), (b - a) * C}});
  }
  watched(fmt::format("the sum of the checksum of dataset '{}' of checkpoint '{}'", name, path()),
          [&] { return MPI_Allreduce(&sum, &total, 1, MPI_UINT64_T, MPI_SUM, I.ag.comm()); });
  if (total != e->checksum)
    fail("checkpoint '{}', dataset '{}' fails its checksum (stored {:#018x}, computed {:#018x}): the file is damaged; "
         "use an earlier checkpoint", path(), name, e->checksum, total);
}

}  // namespace mpigpt
