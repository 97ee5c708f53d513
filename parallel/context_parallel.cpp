// Context parallelism: token assignment, ring / all-gather attention and the sequence gather.
#include "parallel/context_parallel.h"

#include <algorithm>
#include <utility>

namespace mpigpt {

namespace {
// Message tags on the cp communicator (it carries nothing else).
constexpr int kTagKvForward = 1, kTagKvBackward = 2, kTagDkv = 3;
}  // namespace

CpCommType parse_cp_comm_type(const std::string& s) {
  if (s == "p2p") return CpCommType::P2P;
  if (s == "all_gather") return CpCommType::AllGather;
  fail("parallel.cp_comm_type = '{}' is not a context-parallel method; use p2p (ring attention) or all_gather", s);
}

std::vector<int32_t> cp_token_index(int B, int T, int cp, const int32_t* pos) {
  MPIGPT_CHECK(B > 0 && cp > 0 && T > 0 && T % (2 * cp) == 0, "cp_token_index: T = {} must be a multiple of 2*cp = {}",
               T, 2 * cp);
  const int n2 = 2 * cp, Tl = T / cp;
  std::vector<int32_t> index(size_t(cp) * B * Tl);
  std::vector<int> fill(cp), size(n2), begin(n2);
  for (int b = 0; b < B; ++b) {
    std::fill(fill.begin(), fill.end(), 0);
    int counter = 0;  // the chunk that receives the next extra token
    for (int s = 0; s < T;) {
      int e = s + 1;
      while (e < T && !(pos && pos[int64_t(b) * T + e] == 0)) ++e;
      const int n = e - s, q = n / n2, rem = n % n2;
      for (int k = 0, at = s; k < n2; ++k) {
        size[k] = q + (((k - counter) % n2 + n2) % n2 < rem ? 1 : 0);
        begin[k] = at;
        at += size[k];
      }
      counter = (counter + rem) % n2;
      for (int r = 0; r < cp; ++r)
        for (int k : {r, n2 - 1 - r})
          for (int t = begin[k]; t < begin[k] + size[k]; ++t) {
            MPIGPT_CHECK(fill[r] < Tl, "cp_token_index: rank {} of row {} overflows {} tokens", r, b, Tl);
            index[(size_t(r) * B + b) * Tl + fill[r]++] = int32_t(int64_t(b) * T + t);
          }
      s = e;
    }
    for (int r = 0; r < cp; ++r)
      MPIGPT_CHECK(fill[r] == Tl, "cp_token_index: rank {} holds {} tokens of row {}, not {}", r, fill[r], b, Tl);
  }
  return index;
}

std::vector<int32_t> cu_seqlens_of(int B, int T, const int32_t* pos) {
  std::vector<int32_t> cu;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      if (t == 0 || (pos && pos[int64_t(b) * T + t] == 0)) cu.push_back(int32_t(int64_t(b) * T + t));
  cu.push_back(int32_t(int64_t(B) * T));
  return cu;
}

CpMicroBatch cp_split(int B, int T, int cp, int rank, const int32_t* tokens, const int32_t* targets,
                      const int32_t* pos) {
  const std::vector<int32_t> index = cp_token_index(B, T, cp, pos);
  const size_t n = size_t(B) * T, local = n / cp;
  // Document ids (from the cumulative sequence lengths) and positions, in sequence order.
  const std::vector<int32_t> cu = cu_seqlens_of(B, T, pos);
  std::vector<int32_t> all_pos(n), all_seg(n);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t i = cu[d]; i < cu[d + 1]; ++i) {
      all_pos[i] = pos ? pos[i] : i % T;
      all_seg[i] = int32_t(d);
    }
  CpMicroBatch m;
  m.index.assign(index.begin() + rank * local, index.begin() + (rank + 1) * local);
  m.tokens.resize(local);
  m.targets.resize(local);
  m.pos.resize(n);
  m.seg.resize(n);
  for (size_t k = 0; k < n; ++k) {
    m.pos[k] = all_pos[index[k]];
    m.seg[k] = all_seg[index[k]];
  }
  for (size_t k = 0; k < local; ++k) {
    const int32_t i = m.index[k];
    m.tokens[k] = tokens[i];
    m.targets[k] = targets[i];
  }
  return m;
}

ContextParallel::ContextParallel(const Comm* cp, CpCommType type, Ops& ops) : cp_(cp), type_(type), ops_(ops) {
  if (cp_ && cp_->size() > 1) {
    size_ = cp_->size();
    rank_ = cp_->rank();
  }
}

Tensor ContextParallel::scratch(Buffer& b, Shape s, DType t) {
  const size_t bytes = size_t(s.numel()) * dtype_size(t);
  if (b.bytes() < bytes) b = Buffer(ops_, bytes);
  return b.tensor(s, t);
}

size_t ContextParallel::scratch_bytes() const {
  size_t n = kv_.bytes() + kv_next_.bytes() + blk_out_.bytes() + blk_lse_.bytes() + gathered_.bytes() +
             dgathered_.bytes();
  for (const Buffer& b : dkv_) n += b.bytes();
  return n;
}

// The positions / document ids of rank j's tokens, (B,Tl).
static Tensor block_of(Tensor t, int j, int64_t B, int64_t Tl) { return t.flat_slice(j * B * Tl, B * Tl).view({B, Tl}); }

void ContextParallel::attention_forward(Tensor out, Tensor lse, Tensor qkv, Tensor pos, Tensor seg, int NH, int NKV,
                                        int HD) {
  const int64_t B = qkv.size(0), Tl = qkv.size(1), R = qkv.size(2), KVD = 2 * int64_t(NKV) * HD;
  MPIGPT_CHECK(pos.numel() == size_ * B * Tl && seg.numel() == pos.numel(),
               "context-parallel attention: pos {} / seg {} must hold cp*B*Tl = {}*{}*{} ids", pos.str(), seg.str(),
               size_, B, Tl);
  Tensor kv = scratch(kv_, {B, Tl, KVD}, qkv.dtype);
  ops_.copy_cols(kv.view({B * Tl, KVD}), 0, qkv.view({B * Tl, R}), int64_t(NH) * HD, KVD);
  if (type_ == CpCommType::AllGather && size_ > 1)
    forward_gathered(out, lse, qkv, kv, pos, seg, NH, NKV, HD);
  else
    forward_ring(out, lse, qkv, kv, pos, seg, NH, NKV, HD);
}

// The first block writes out/lse; every later one is computed aside and merged in.
void ContextParallel::attend(bool first, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                             Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  if (first) return ops_.attention_block_forward(out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  Tensor bo = scratch(blk_out_, out.shape, out.dtype), bl = scratch(blk_lse_, lse.shape);
  ops_.attention_block_forward(bo, bl, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  ops_.attention_merge(out, lse, bo, bl);
}

void ContextParallel::forward_ring(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor pos, Tensor seg, int NH,
                                   int NKV, int HD) {
  const int64_t B = qkv.size(0), Tl = qkv.size(1);
  const Tensor qpos = block_of(pos, rank_, B, Tl), qseg = block_of(seg, rank_, B, Tl);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  Tensor cur = kv, nxt = size_ > 1 ? scratch(kv_next_, kv.shape, kv.dtype) : Tensor();
  for (int s = 0; s < size_; ++s) {
    const int j = (rank_ - s + size_) % size_;  // whose K/V block this is
    Request recv, send;
    if (s + 1 < size_) {  // start moving the next block before computing this one
      recv = cp_->irecv(nxt, prev, kTagKvForward);
      send = cp_->isend(cur, next, kTagKvForward);
    }
    attend(s == 0, out, lse, qkv, cur, qpos, qseg, block_of(pos, j, B, Tl), block_of(seg, j, B, Tl), NH, NKV, HD);
    recv.wait();
    send.wait();
    std::swap(cur, nxt);
  }
}

void ContextParallel::forward_gathered(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor pos, Tensor seg, int NH,
                                       int NKV, int HD) {
  const int64_t B = qkv.size(0), Tl = qkv.size(1), n = kv.numel();
  const Tensor qpos = block_of(pos, rank_, B, Tl), qseg = block_of(seg, rank_, B, Tl);
  Tensor all = scratch(gathered_, {size_ * n}, kv.dtype);
  cp_->all_gather(all, kv.view({n}));
  for (int j = 0; j < size_; ++j)
    attend(j == 0, out, lse, qkv, all.flat_slice(j * n, n).view(kv.shape), qpos, qseg, block_of(pos, j, B, Tl),
           block_of(seg, j, B, Tl), NH, NKV, HD);
}

void ContextParallel::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, Tensor pos,
                                         Tensor seg, int NH, int NKV, int HD) {
  const int64_t B = qkv.size(0), Tl = qkv.size(1), R = qkv.size(2), KVD = 2 * int64_t(NKV) * HD;
  Tensor kv = scratch(kv_, {B, Tl, KVD}, qkv.dtype);
  ops_.copy_cols(kv.view({B * Tl, KVD}), 0, qkv.view({B * Tl, R}), int64_t(NH) * HD, KVD);
  ops_.fill(dqkv, 0.0f);  // the block backwards accumulate into its query columns
  Tensor dkv = scratch(dkv_[0], kv.shape, kv.dtype);
  if (size_ == 1) {
    ops_.fill(dkv, 0.0f);
    const Tensor qpos = block_of(pos, 0, B, Tl), qseg = block_of(seg, 0, B, Tl);
    ops_.attention_block_backward(dqkv, dkv, dout, qkv, kv, out, lse, qpos, qseg, qpos, qseg, NH, NKV, HD);
  } else if (type_ == CpCommType::AllGather) {
    backward_gathered(dqkv, dkv, dout, qkv, kv, out, lse, pos, seg, NH, NKV, HD);
  } else {
    backward_ring(dqkv, dkv, dout, qkv, kv, out, lse, pos, seg, NH, NKV, HD);
  }
  ops_.copy_cols(dqkv.view({B * Tl, R}), int64_t(NH) * HD, dkv.view({B * Tl, KVD}), 0, KVD);
}

// On exit dkv holds the gradient of this rank's own K/V block, summed over every rank's queries.
void ContextParallel::backward_ring(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                   Tensor lse, Tensor pos, Tensor seg, int NH, int NKV, int HD) {
  const int64_t B = qkv.size(0), Tl = qkv.size(1);
  const Tensor qpos = block_of(pos, rank_, B, Tl), qseg = block_of(seg, rank_, B, Tl);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  Tensor cur = kv, nxt = scratch(kv_next_, kv.shape, kv.dtype);
  // Three dK/dV buffers rotate: one being sent on, one being received, one for this step's part.
  Tensor d[3] = {dkv, scratch(dkv_[1], kv.shape, kv.dtype), scratch(dkv_[2], kv.shape, kv.dtype)};
  int sending = -1, incoming = -1;
  Request send_d, recv_d;
  for (int s = 0; s < size_; ++s) {
    const int j = (rank_ - s + size_) % size_;
    Request recv_kv, send_kv;
    if (s + 1 < size_) {
      recv_kv = cp_->irecv(nxt, prev, kTagKvBackward);
      send_kv = cp_->isend(cur, next, kTagKvBackward);
    }
    int part = 0;
    while (part == sending || part == incoming) ++part;
    ops_.fill(d[part], 0.0f);
    ops_.attention_block_backward(dqkv, d[part], dout, qkv, cur, out, lse, qpos, qseg, block_of(pos, j, B, Tl),
                                  block_of(seg, j, B, Tl), NH, NKV, HD);
    int total = part;
    if (s > 0) {  // add what the ranks before this one contributed to block j
      recv_d.wait();
      ops_.add(d[incoming], d[incoming], d[part]);
      total = incoming;
    }
    send_d.wait();
    // Pass block j's partial sum on; after the last step it arrives at its owner, j + 1 ... = next.
    send_d = cp_->isend(d[total], next, kTagDkv);
    int free = 0;
    while (free == total) ++free;
    recv_d = cp_->irecv(d[free], prev, kTagDkv);
    sending = total;
    incoming = free;
    recv_kv.wait();
    send_kv.wait();
    std::swap(cur, nxt);
  }
  recv_d.wait();
  send_d.wait();
  if (incoming != 0) ops_.copy(dkv, d[incoming]);
}

void ContextParallel::backward_gathered(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                        Tensor lse, Tensor pos, Tensor seg, int NH, int NKV, int HD) {
  const int64_t B = qkv.size(0), Tl = qkv.size(1), n = kv.numel();
  const Tensor qpos = block_of(pos, rank_, B, Tl), qseg = block_of(seg, rank_, B, Tl);
  // The gathered K/V are not kept from the forward: gathering them again costs one all-gather
  // and saves cp-1 blocks of memory per layer and micro-batch in flight.
  Tensor all = scratch(gathered_, {size_ * n}, kv.dtype), dall = scratch(dgathered_, {size_ * n}, kv.dtype);
  cp_->all_gather(all, kv.view({n}));
  ops_.fill(dall, 0.0f);
  for (int j = 0; j < size_; ++j)
    ops_.attention_block_backward(dqkv, dall.flat_slice(j * n, n).view(kv.shape), dout, qkv,
                                  all.flat_slice(j * n, n).view(kv.shape), out, lse, qpos, qseg,
                                  block_of(pos, j, B, Tl), block_of(seg, j, B, Tl), NH, NKV, HD);
  cp_->reduce_scatter_sum(dkv.view({n}), dall);
}

void ContextParallel::gather_forward(Tensor full, Tensor local, Tensor index) {
  const int64_t rows = local.size(0), C = local.size(1);
  MPIGPT_CHECK(full.numel() == size_ * local.numel() && index.numel() == size_ * rows,
               "context_parallel_gather: full {} must hold cp = {} times local {}, index {} one id per row", full.str(),
               size_, local.str(), index.str());
  Tensor all = local;
  if (size_ > 1) {
    all = scratch(gathered_, {size_ * rows, C}, local.dtype);
    cp_->all_gather(all.view({size_ * rows * C}), local.view({rows * C}));
  }
  ops_.fill(full, 0.0f);
  ops_.scatter_add_rows(full, all, index);  // a permutation: every row lands once
}

void ContextParallel::gather_backward(Tensor dlocal, Tensor dfull, Tensor index) {
  const int64_t rows = dlocal.size(0);
  ops_.gather_rows(dlocal, dfull, index.flat_slice(rank_ * rows, rows));
}

}  // namespace mpigpt
