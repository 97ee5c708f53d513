// Context parallelism: the sequence of every micro-batch is cut over the cp group and attention
// runs across it. Which tokens a cp rank holds, attention over the whole sequence by ring (p2p) or
// by all-gather, and the differentiable context_parallel_gather that reassembles the sequence.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "parallel/comm.h"

namespace mpigpt {

enum class CpCommType { P2P, AllGather };
// "p2p" | "all_gather"; anything else fails naming parallel.cp_comm_type.
CpCommType parse_cp_comm_type(const std::string& s);

// The tokens each cp rank holds of one micro-batch of B rows of T tokens (T divisible by 2*cp).
// Every document is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r, so the causal
// work of the ranks is balanced. Without packing a row is one document and the chunks are its
// T/(2*cp) equal parts (Megatron's scheme). With packing a document of length n has chunks of
// n/(2*cp) tokens, rounded up for n % (2*cp) of them: the extra tokens are dealt to the chunks
// round-robin, continuing from document to document along the row, so that every rank still
// holds exactly T/cp tokens of each row.
//   pos (B*T): position of each token within its document; a document starts where pos == 0
//   (nullptr: every row is one document, positions 0..T-1).
// Returns index (cp, B, T/cp): for rank r, row b, local token t, the flat index b*T + s of the
// token in the micro-batch. Local tokens of a row keep the order of the row.
std::vector<int32_t> cp_token_index(int B, int T, int cp, const int32_t* pos);

// The documents of a packed micro-batch in the THD format a fused varlen attention consumes:
// cumulative sequence lengths over the B*T tokens taken as one sequence, [0, ..., B*T]; a row
// boundary is always a document boundary. pos as above (nullptr: one document per row).
std::vector<int32_t> cu_seqlens_of(int B, int T, const int32_t* pos);

// The per-token inputs of one micro-batch as this rank sees them, built from the whole
// micro-batch (host arrays of B*T) and the index above: local tokens and targets, and the
// positions and document ids of EVERY rank's tokens (attention needs the remote ones to mask
// the K/V blocks it receives).
struct CpMicroBatch {
  std::vector<int32_t> tokens, targets;  // (B*T/cp) this rank's
  std::vector<int32_t> index;            // (B*T/cp) flat index b*T + t of each in the micro-batch
  std::vector<int32_t> pos, seg;         // (cp, B, T/cp) every rank's, rank-major
};
// seg: document id, the index of the token's document in cu_seqlens_of (unique over the micro-batch).
CpMicroBatch cp_split(int B, int T, int cp, int rank, const int32_t* tokens, const int32_t* targets,
                      const int32_t* pos);

// With one rank (or no group) the attention is plain masked attention over the local tokens,
// which is also how packed sequences run without context parallelism. Masking is by per-token
// positions and document ids, never by the token's place in the local array: query i sees key j
// iff they are in the same document and pos[j] <= pos[i]. So any assignment of tokens to ranks
// gives exactly the single-rank attention, whatever order the local tokens are in.
class ContextParallel {
 public:
  // cp: the context-parallel group (nullptr or one rank: local attention only).
  ContextParallel(const Comm* cp, CpCommType type, Ops& ops);
  int size() const { return size_; }
  int rank() const { return rank_; }
  CpCommType comm_type() const { return type_; }

  // Attention of the local queries over the keys/values of the whole sequence.
  //   out (B,Tl,NH*HD), lse (B,NH,Tl) saved for backward; qkv (B,Tl,(NH+2*NKV)*HD) local, rotary
  //   applied; pos, seg (cp,B,Tl) i32 of every rank's tokens (CpMicroBatch), on the device.
  // p2p (ring attention):
  //   forward:  K/V blocks travel around the ring (rank r sends to r+1, receives from r-1); the
  //             next block's transfer is started before the current one is computed; partial
  //             results are merged by their log-sum-exp.
  //   backward: the blocks travel the same way with their dK/dV partial sums, which arrive back
  //             at their owner after cp steps.
  // all_gather:
  //   forward:  all-gather of K/V over cp, then the local queries against every block (merged
  //             as in the ring, without its overlap).
  //   backward: dK/dV of the whole sequence, reduce-scattered back to their owners.
  void attention_forward(Tensor out, Tensor lse, Tensor qkv, Tensor pos, Tensor seg, int NH, int NKV, int HD);
  // dqkv (B,Tl,(NH+2*NKV)*HD) overwritten.
  void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, Tensor pos, Tensor seg,
                          int NH, int NKV, int HD);

  // context_parallel_gather, for operations that need the whole sequence (per-token
  // log-probabilities of a sequence, say). index (cp,B,Tl) i32 from cp_token_index, on the device.
  //   forward:  full (B*T, C) = every rank's local rows (B*Tl, C) all-gathered and put back in
  //             sequence order.
  //   backward: dlocal (B*Tl, C) = this rank's rows of dfull (no communication: every rank holds
  //             the gradient of the whole sequence, from the same loss).
  void gather_forward(Tensor full, Tensor local, Tensor index);
  void gather_backward(Tensor dlocal, Tensor dfull, Tensor index);

  // Scratch bytes held (K/V blocks in flight, partial results).
  size_t scratch_bytes() const;

 private:
  Tensor scratch(Buffer& b, Shape s, DType t = DType::F32);
  void attend(bool first, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg, Tensor kpos,
              Tensor kseg, int NH, int NKV, int HD);
  void forward_ring(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor pos, Tensor seg, int NH, int NKV, int HD);
  void forward_gathered(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor pos, Tensor seg, int NH, int NKV,
                        int HD);
  void backward_ring(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out, Tensor lse, Tensor pos,
                     Tensor seg, int NH, int NKV, int HD);
  void backward_gathered(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out, Tensor lse,
                         Tensor pos, Tensor seg, int NH, int NKV, int HD);

  const Comm* cp_;
  CpCommType type_;
  Ops& ops_;
  int size_ = 1, rank_ = 0;
  // Reused from call to call; reallocated only when a larger one is needed.
  Buffer kv_, kv_next_, dkv_[3], blk_out_, blk_lse_, gathered_, dgathered_;
};

}  // namespace mpigpt
