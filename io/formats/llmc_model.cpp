// llm.c GPT-2 model file reader and writer.
#include "io/formats/llmc_model.h"

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "io/formats/hf_format.h"
#include "io/mapped_file.h"
#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

namespace {

// The file: a header of 256 int32 (magic 20240326, version 3 = fp32 or 5 = bf16, max_seq_len,
// vocab_size, num_layers, num_heads, channels, padded_vocab_size, zeros), then the parameters in
// this order, each stacked over layers, PyTorch nn.Linear (out, in) layout: wte (Vp,C), wpe
// (maxT,C), ln1w, ln1b (L,C), qkvw (L,3C,C), qkvb (L,3C), attprojw (L,C,C), attprojb (L,C),
// ln2w, ln2b (L,C), fcw (L,4C,C), fcb (L,4C), fcprojw (L,C,4C), fcprojb (L,C), lnfw, lnfb (C).
// The output head is tied to wte; wte's rows [V, Vp) are zero.
constexpr size_t kHeaderBytes = 256 * sizeof(int32_t);

// Our per-layer tensors in llm.c's order (each stacked over the layers in the file).
constexpr const char* kLayerTensors[] = {
    "attn_norm.weight", "attn_norm.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
    "mlp_norm.weight",  "mlp_norm.bias",  "mlp.fc.weight",   "mlp.fc.bias",   "mlp.proj.weight",  "mlp.proj.bias"};

// Our names in file order: wte, wpe, the 12 per-layer kinds over all layers, final norm.
std::vector<std::string> file_order(int L) {
  std::vector<std::string> out = {"embedding.word.weight", "embedding.position.weight"};
  for (const char* t : kLayerTensors)
    for (int l = 0; l < L; ++l) out.push_back("layers." + std::to_string(l) + "." + t);
  out.push_back("final_norm.weight");
  out.push_back("final_norm.bias");
  return out;
}

std::map<std::string, Shape> shape_map(const ModelConfig& m, int padded_vocab) {
  std::map<std::string, Shape> out;
  for (const auto& [name, s] : param_shapes(m, padded_vocab)) out[name] = s;
  return out;
}

}  // namespace

TensorMap read_llmc_model(const std::string& path, ModelConfig* m_out, int* vocab_out, int* padded_out) {
  MappedFile file(path, "llm.c model file");
  const char* fix = "write it again with llm.c's train_gpt2.py (or `mpigpt convert`)";
  if (file.size() >= 4 && file.at<int32_t>(0) != kLlmcModelMagic)
    fail("{} is not an llm.c model file: magic number {} instead of {}{}; {}", path, file.at<int32_t>(0),
         kLlmcModelMagic, file.at<int32_t>(0) == 20240520 ? " (it is an llm.c token file)" : "", fix);
  if (file.size() < kHeaderBytes)
    fail("llm.c model file {} is truncated: {} bytes, shorter than the {}-byte header; {}", path, file.size(),
         kHeaderBytes, fix);
  int32_t h[8];
  for (int i = 0; i < 8; ++i) h[i] = file.at<int32_t>(4 * size_t(i));
  const int version = h[1];
  if (version != 3 && version != 5)
    fail("llm.c model file {}: unsupported version {} (3 = fp32, 5 = bf16; versions 1-2 predate the padded "
         "vocabulary); {}", path, version, fix);
  const char* field[] = {"magic", "version", "max_seq_len", "vocab_size", "num_layers", "num_heads", "channels",
                         "padded_vocab_size"};
  for (int i = 2; i < 8; ++i)
    if (h[i] <= 0) fail("llm.c model file {}: header {} = {} must be positive; {}", path, field[i], h[i], fix);
  const int maxT = h[2], V = h[3], L = h[4], NH = h[5], C = h[6], Vp = h[7];
  if (Vp < V) fail("llm.c model file {}: padded_vocab_size {} is smaller than vocab_size {}; {}", path, Vp, V, fix);
  if (C % NH != 0) fail("llm.c model file {}: channels {} is not a multiple of num_heads {}; {}", path, C, NH, fix);
  // The size the header promises, in floating point first: a corrupt header (a billion layers, say)
  // is refused before anything of that size is built or counted in integers that would overflow.
  const int bytes = version == 3 ? 4 : 2;
  const double c = C;
  const double numel = (double(Vp) + maxT) * c + double(L) * (12 * c * c + 13 * c) + 2 * c;
  const double expected = kHeaderBytes + numel * bytes, size = double(file.size());
  if (size != expected)
    fail("llm.c model file {} has {} bytes, but its header (version {}, L {}, C {}, Vp {}, maxT {}) promises {:.0f} "
         "parameters = {:.0f} bytes; the file is {}; {}", path, file.size(), version, L, C, Vp, maxT, numel, expected,
         size < expected ? "truncated" : "longer than that", fix);
  ModelConfig m;
  m.family = "gpt2";
  m.num_layers = L;
  m.hidden = C;
  m.num_heads = m.num_kv_heads = NH;
  m.ffn_hidden = 4 * C;
  m.seq_len = m.max_position = maxT;
  m.vocab_size = V;
  m.norm_eps = 1e-5;
  m.tie_embeddings = true;
  const std::vector<std::string> order = file_order(L);
  const std::map<std::string, Shape> shapes = shape_map(m, Vp);
  TensorMap out;
  uint64_t total = 0;
  for (const auto& [name, s] : shapes) total += uint64_t(s.numel());
  MPIGPT_CHECK(double(total) == numel, "{}: the header's parameter count {:.0f} against the model's {}", path, numel,
               total);
  for (const auto& [name, s] : shapes) out[name] = HostTensor{s, std::vector<float>(size_t(s.numel()))};
  uint64_t pos = kHeaderBytes;
  for (size_t k = 0; k < order.size(); ++k) {
    HostTensor& t = out.at(order[k]);
    const size_t n = t.data.size();
    if (version == 3) {
      std::memcpy(t.data.data(), file.data() + pos, n * 4);
    } else {
      for (size_t i = 0; i < n; ++i) t.data[i] = std::bit_cast<float>(uint32_t(file.at<uint16_t>(pos + 2 * i)) << 16);
    }
    pos += n * bytes;
  }
  std::vector<float>& wte = out.at("embedding.word.weight").data;
  std::fill(wte.begin() + int64_t(V) * C, wte.end(), 0.0f);  // padding rows are zero by definition
  if (m_out) *m_out = m;
  if (vocab_out) *vocab_out = V;
  if (padded_out) *padded_out = Vp;
  return out;
}

void write_llmc_model(const std::string& path, const TensorMap& ours, const ModelConfig& in, int vocab,
                      int padded_vocab) {
  ModelConfig m = in;
  if (m.family != "gpt2")
    fail("llm.c model file {}: model.family = '{}'; llm.c's model file holds GPT-2 only (export llama models with "
         "`mpigpt convert --to hf`)", path, m.family);
  if (m.num_experts > 0)
    fail("llm.c model file {}: model.num_experts = {}; llm.c's model file holds dense GPT-2 models only", path,
         m.num_experts);
  if (m.num_kv_heads == 0) m.num_kv_heads = m.num_heads;
  if (m.ffn_hidden == 0) m.ffn_hidden = 4 * m.hidden;
  if (m.max_position == 0) m.max_position = m.seq_len;
  if (!m.tie_embeddings)
    fail("llm.c model file {}: model.tie_embeddings = false; llm.c's GPT-2 ties the output head to wte", path);
  if (m.ffn_hidden != 4 * m.hidden)
    fail("llm.c model file {}: model.ffn_hidden = {}; llm.c's GPT-2 has ffn_hidden = 4 * hidden = {}", path,
         m.ffn_hidden, 4 * m.hidden);
  if (m.num_kv_heads != m.num_heads)
    fail("llm.c model file {}: model.num_kv_heads = {}; llm.c's GPT-2 has num_kv_heads = num_heads = {}", path,
         m.num_kv_heads, m.num_heads);
  if (vocab <= 0 || padded_vocab < vocab)
    fail("llm.c model file {}: padded vocabulary {} must be at least the vocabulary {} > 0", path, padded_vocab, vocab);
  auto wte = ours.find("embedding.word.weight");
  if (wte == ours.end()) fail("llm.c model file {}: tensor embedding.word.weight is missing", path);
  const int64_t rows = wte->second.shape.ndim == 2 ? wte->second.shape[0] : 0;
  if (rows < vocab)
    fail("llm.c model file {}: embedding.word.weight has shape {}, fewer rows than the vocabulary {}", path,
         wte->second.shape.str(), vocab);
  const std::map<std::string, Shape> shapes = shape_map(m, int(rows));
  for (const auto& [name, s] : shapes) {
    auto it = ours.find(name);
    if (it == ours.end()) fail("llm.c model file {}: tensor {} of shape {} is missing", path, name, s.str());
    if (!(it->second.shape == s) || int64_t(it->second.data.size()) != s.numel())
      fail("llm.c model file {}: tensor {} has shape {} ({} values), the model config says {}", path, name,
           it->second.shape.str(), it->second.data.size(), s.str());
  }
  for (const auto& [name, t] : ours)
    if (!shapes.count(name)) fail("llm.c model file {}: tensor {} is not a parameter of llm.c's GPT-2", path, name);

  std::vector<int32_t> header(256, 0);
  const int32_t values[] = {kLlmcModelMagic, 3, m.max_position, vocab, m.num_layers, m.num_heads, m.hidden, padded_vocab};
  std::copy(std::begin(values), std::end(values), header.begin());
  NewFile f(path);
  f.write(header.data(), sizeof(int32_t) * 256);
  for (const std::string& name : file_order(m.num_layers)) {
    const std::vector<float>& d = ours.at(name).data;
    if (name == "embedding.word.weight") {  // vocab rows, then zero rows up to padded_vocab
      const size_t C = size_t(m.hidden), keep = size_t(vocab) * C;
      const std::vector<float> zeros((size_t(padded_vocab) - size_t(vocab)) * C, 0.0f);
      f.write(d.data(), sizeof(float) * keep);
      f.write(zeros.data(), sizeof(float) * zeros.size());
    } else {
      f.write(d.data(), sizeof(float) * d.size());
    }
  }
  f.commit();
}

}  // namespace mpigpt
