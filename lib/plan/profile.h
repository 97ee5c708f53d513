// Device profiles for the time model: a device's GEMM rate by shape, the cost of the other ops per
// unit of work, and its links, read from and written to JSON (`mpigpt bench --profile-out`).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mpigpt {

// One timed GEMM: c (m,n) = a (m,k) @ b (k,n), seconds per call.
struct GemmSample {
  int64_t m = 0, n = 0, k = 0;
  double seconds = 0;
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
};

// A link class: a message of b bytes takes latency + b / bandwidth (bytes/s on the wire per rank).
struct Link {
  double latency = 0;
  double bandwidth = 0;
  double seconds(double bytes) const { return bytes > 0 ? latency + bytes / bandwidth : 0.0; }
};

// The non-GEMM work of a step, by unit (what lib/plan/step_work.h counts).
struct OpRates {
  double elementwise = 0;      // seconds per activation element of a layer pass (norms, residuals, activations, embedding)
  double attention_fwd = 0;    // seconds per causal-attention forward FLOP
  double attention_bwd = 0;    // seconds per attention backward FLOP (counted as 2 x the forward's)
  double crossentropy = 0;     // seconds per logit element (softmax, loss and its gradient)
  double optimizer = 0;        // seconds per parameter element updated (AdamW, gradient norm, clipping)
  double grad_zero = 0;        // seconds per parameter element held (zeroing gradients per step)
  // An attention that writes its T x T scores to memory (not a fused, blockwise kernel): seconds per
  // score element (every key of every query, per head) of a forward and of a backward. 0: fused.
  double attention_scores_fwd = 0;
  double attention_scores_bwd = 0;
  // The blockwise attention with an explicit mask (context parallelism's blocks and their merge,
  // packed documents): seconds per causal FLOP as above, forward and backward. 0: priced as the
  // plain attention (a kernel that skips masked tiles costs about the same).
  double masked_attention_fwd = 0;
  double masked_attention_bwd = 0;
};

struct DeviceProfile {
  std::string name;            // "cpu_2core", "h100", ...
  std::string source;          // where the figures come from (command, date, document)
  double peak_flops = 0;       // dense peak per rank (FLOP/s), for MFU
  // > 0: the ranks of a node share this many cores (the CPU backend, one thread per rank): compute
  // and communication both take core time, nothing overlaps, and N ranks on c cores run at c/N of
  // a core each while all of them work. 0: every rank owns its device (a GPU).
  int shared_cores = 0;
  std::vector<GemmSample> gemm;  // at least one
  double gemm_in_model = 1.0;  // the model's GEMM ops (bias, epilogues) over the plain GEMMs' time
  OpRates ops;
  Link intra_node;             // inside a node (NVLink, shared memory)
  Link inter_node;             // across nodes (the network)
  double reduce_rate = 0;      // seconds per element summed by a reduction (CPU: core time; 0: hidden)
  // The program's pipeline sends block its compute (Megatron-LM's of 2021-2022, modelled for the
  // published tables); false: mpigpt's, which sends without waiting and blocks only on receives.
  bool blocking_p2p = false;
  // Memory of one device (bytes) the planner fits layouts into; 0: not known (`mpigpt plan` then
  // shares this machine's RAM among the ranks of a node).
  double memory_bytes = 0;

  // Seconds of one GEMM of this shape: the rate interpolated over the samples by inverse distance
  // in log(m, n, k), the nearest samples weighing most.
  double gemm_seconds(int64_t m, int64_t n, int64_t k) const;
};

// Parse a profile from JSON text (`what` names it in errors); throws mpigpt::Error naming the field.
DeviceProfile parse_profile(const std::string& json, const std::string& what);
// Read a profile file: a path, or a shipped name (cpu_2core, h100, h200, a100_80g) looked up in `dir`.
DeviceProfile load_profile(const std::string& name_or_path, const std::string& dir);
// The profile as indented JSON.
std::string to_json(const DeviceProfile& p);

}  // namespace mpigpt
