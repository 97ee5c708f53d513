#!/usr/bin/env python3
"""Independent oracle for io/formats/hf_oracle_test.cpp: tiny Hugging Face models and their
logits, with nothing but numpy (no torch, no transformers).

  make_hf_tiny.py make {gpt2,llama,mistral,qwen2,mixtral} OUTDIR [--dtype F32|BF16|F16] [--shards N] [--hub-style]
      writes OUTDIR/config.json, the weights (model.safetensors, or N shards + index) under
      transformers' names and layouts (GPT-2 Conv1D weights stored (in, out)), OUTDIR/tokens.i32
      (T int32) and OUTDIR/logits.f64 (T x V float64) of a float64 forward pass over those tokens.
      --hub-style writes GPT-2 the way the hub's openai-community/gpt2 file is: no "transformer."
      prefix and the attn.bias / attn.masked_bias buffers. mixtral weights are drawn again until
      every token's top-k choice is clear (router margin below > 1e-3).
  make_hf_tiny.py logits MODELDIR TOKENS OUT [MARGIN_OUT]
      reads an HF model directory (config.json + safetensors), runs the same forward pass over the
      int32 tokens in TOKENS and writes the float64 logits (T x V) to OUT; MARGIN_OUT receives the
      router margin as text (inf for a dense model).

The forward passes follow transformers' modeling_gpt2.py (LayerNorm, gelu_new, causal attention,
tied head), modeling_llama.py (RMSNorm, rotate_half RoPE, repeat_kv GQA, SwiGLU, lm_head; the
same for modeling_mistral.py without a sliding window, and modeling_qwen2.py, whose q/k/v
projections add a bias) and modeling_mixtral.py (Llama attention; every MLP a mixture of experts: router logits = h @ gate^T,
softmax over all E experts, top-k, the k weights renormalised to sum 1, out = sum_k w_k *
w2(silu(w1 h) * w3 h)). The router margin is the smallest gap, over every token and layer,
between the k-th and (k+1)-th largest router logit: a top-k choice that float32 rounding
could flip shows as a margin near 0."""
import json
import os
import struct
import sys

import numpy as np

# ---- safetensors ------------------------------------------------------------------------------


def to_bf16_bits(a):
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even as torch does."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.astype(np.uint16)


def encode(a, dtype):
    if dtype == "F32":
        return np.ascontiguousarray(a, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.ascontiguousarray(a, dtype="<f2").tobytes()
    return to_bf16_bits(a).astype("<u2").tobytes()


def decode(raw, dtype, shape):
    if dtype == "F32":
        a = np.frombuffer(raw, dtype="<f4")
    elif dtype == "F16":
        a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise SystemExit(f"unsupported dtype {dtype}")
    return a.astype(np.float64).reshape(shape)


def write_safetensors(path, tensors, dtypes):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        blob = encode(a, dtypes[name])
        header[name] = {"dtype": dtypes[name], "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = decode(data[b:end], e["dtype"], e["shape"])
    return out


def save_model(outdir, tensors, dtypes, shards):
    names = list(tensors)
    if shards <= 1:
        write_safetensors(os.path.join(outdir, "model.safetensors"), tensors, dtypes)
        return
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        write_safetensors(os.path.join(outdir, file), part, dtypes)
        for n in part:
            weight_map[n] = file
            total += len(encode(part[n], dtypes[n]))
    with open(os.path.join(outdir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_model(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(d, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for file in files:
        out.update(read_safetensors(os.path.join(d, file)))
    return out


# ---- forward passes (float64) ------------------------------------------------------------------


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def causal_attention(q, k, v):
    """q (NH,T,HD), k/v (NH,T,HD) -> (T, NH*HD)."""
    NH, T, HD = q.shape
    s = q @ k.transpose(0, 2, 1) / np.sqrt(HD)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    return (softmax(s) @ v).transpose(1, 0, 2).reshape(T, NH * HD)


def gpt2_logits(cfg, w, tokens):
    w = {(k if k.startswith("transformer.") or k == "lm_head.weight" else "transformer." + k): v for k, v in w.items()}
    C, NH, eps = cfg["n_embd"], cfg["n_head"], cfg.get("layer_norm_epsilon", 1e-5)
    HD, T = C // NH, len(tokens)

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[p + ".weight"] + w[p + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    wte = w["transformer.wte.weight"]
    x = wte[tokens] + w["transformer.wpe.weight"][np.arange(T)]
    for l in range(cfg["n_layer"]):
        p = f"transformer.h.{l}."
        qkv = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]  # Conv1D: x @ W
        q, k, v = (qkv[:, i * C : (i + 1) * C].reshape(T, NH, HD).transpose(1, 0, 2) for i in range(3))
        x = x + causal_attention(q, k, v) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        a = gelu_new(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + a @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    head = w["lm_head.weight"] if not cfg.get("tie_word_embeddings", True) else wte
    return ln(x, "transformer.ln_f") @ head.T


def mixtral_moe(cfg, w, p, h, margins):
    """One block_sparse_moe of modeling_mixtral.py; appends each token's router margin."""
    E, K = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    logits = h @ w[p + "gate.weight"].T  # (T, E)
    probs = softmax(logits)
    order = np.argsort(-logits, axis=-1, kind="stable")
    top = order[:, :K]
    if K < E:
        srt = np.take_along_axis(logits, order, axis=-1)
        margins.extend(srt[:, K - 1] - srt[:, K])
    weights = np.take_along_axis(probs, top, axis=-1)
    weights = weights / weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for k in range(K):
            x = f"{p}experts.{top[t, k]}."
            g, u = h[t] @ w[x + "w1.weight"].T, h[t] @ w[x + "w3.weight"].T
            out[t] += weights[t, k] * ((g / (1.0 + np.exp(-g)) * u) @ w[x + "w2.weight"].T)
    return out


def llama_logits(cfg, w, tokens, margins):
    C, NH = cfg["hidden_size"], cfg["num_attention_heads"]
    NKV, eps = cfg.get("num_key_value_heads", NH), cfg.get("rms_norm_eps", 1e-6)
    HD, T, theta = C // NH, len(tokens), cfg.get("rope_theta", 10000.0)

    def rms(x, p):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w[p]

    def rotate_half(x):
        return np.concatenate([-x[..., HD // 2 :], x[..., : HD // 2]], axis=-1)

    inv_freq = 1.0 / theta ** (np.arange(0, HD, 2, dtype=np.float64) / HD)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=-1)  # (T, HD)
    cos, sin = np.cos(emb), np.sin(emb)

    x = w["model.embed_tokens.weight"][tokens]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms(x, p + "input_layernorm.weight")
        def proj(n, heads):  # nn.Linear, with a bias where the model has one (Qwen2's q/k/v)
            y = h @ w[p + f"self_attn.{n}.weight"].T + w.get(p + f"self_attn.{n}.bias", 0.0)
            return y.reshape(T, heads, HD).transpose(1, 0, 2)

        q, k, v = proj("q_proj", NH), proj("k_proj", NKV), proj("v_proj", NKV)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, NH // NKV, axis=0), np.repeat(v, NH // NKV, axis=0)  # repeat_kv
        x = x + causal_attention(q, k, v) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, p + "post_attention_layernorm.weight")
        if cfg["model_type"] == "mixtral":
            x = x + mixtral_moe(cfg, w, p + "block_sparse_moe.", h, margins)
            continue
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return rms(x, "model.norm.weight") @ head.T


def logits_of(cfg, w, tokens):
    """(logits (T, V), router margin: inf without experts)."""
    if cfg["model_type"] == "gpt2":
        return gpt2_logits(cfg, w, np.asarray(tokens)), np.inf
    margins = []
    logits = llama_logits(cfg, w, np.asarray(tokens), margins)
    return logits, min(margins, default=np.inf)


# ---- tiny random models ----------------------------------------------------------------------


def make(family, outdir, dtype, shards, hub_style):
    for attempt in range(100):
        cfg, w, tokens, dtypes = draw(family, dtype, hub_style, attempt)
        # The reference sees exactly the stored values (bf16/f16 rounding included).
        stored = {n: decode(encode(a, dtypes[n]), dtypes[n], a.shape) for n, a in w.items()}
        logits, margin = logits_of(cfg, stored, tokens)
        if margin > 1e-3:
            break
    else:
        raise SystemExit("no draw with a clear top-k routing in 100 attempts")
    os.makedirs(outdir, exist_ok=True)
    save_model(outdir, w, dtypes, shards)
    with open(os.path.join(outdir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tokens.tofile(os.path.join(outdir, "tokens.i32"))
    logits.astype("<f8").tofile(os.path.join(outdir, "logits.f64"))


def draw(family, dtype, hub_style, attempt):
    """config.json, the weights, the tokens and the stored dtypes of one random tiny model."""
    rng = np.random.default_rng({"gpt2": 1234, "llama": 4321, "mistral": 5432, "qwen2": 6543, "mixtral": 8765}[family]
                                + 1000 * attempt)
    V, C, L, T = 37, 16, 2, 8
    rnd = lambda *s, std=0.2: (rng.standard_normal(s) * std).astype(np.float32)
    w = {}
    if family == "gpt2":
        P, F = 16, 4 * C
        cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": P,
               "n_ctx": P, "n_embd": C, "n_layer": L, "n_head": 4, "n_inner": None,
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
        pre = "" if hub_style else "transformer."
        w[pre + "wte.weight"] = rnd(V, C, std=0.5)
        w[pre + "wpe.weight"] = rnd(P, C, std=0.1)
        for l in range(L):
            h = f"{pre}h.{l}."
            for n in ("ln_1", "ln_2"):
                w[h + n + ".weight"] = 1 + rnd(C, std=0.1)
                w[h + n + ".bias"] = rnd(C, std=0.1)
            for n, i, o in (("attn.c_attn", C, 3 * C), ("attn.c_proj", C, C), ("mlp.c_fc", C, F), ("mlp.c_proj", F, C)):
                w[h + n + ".weight"] = rnd(i, o, std=0.3)  # Conv1D: (in, out)
                w[h + n + ".bias"] = rnd(o, std=0.1)
            if hub_style:
                w[h + "attn.bias"] = np.tril(np.ones((P, P), dtype=np.float32)).reshape(1, 1, P, P)
                w[h + "attn.masked_bias"] = np.array(-1e4, dtype=np.float32)
        w[pre + "ln_f.weight"] = 1 + rnd(C, std=0.1)
        w[pre + "ln_f.bias"] = rnd(C, std=0.1)
    elif family in ("llama", "mistral", "qwen2"):
        NH, NKV, F = 4, 2, 24
        HD = C // NH
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": C,
               "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV,
               "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 1000.0, "rope_scaling": None,
               "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
        if family == "mistral":  # as Mistral 7B v0.2 on: no sliding window
            cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
            del cfg["attention_bias"], cfg["mlp_bias"]
        if family == "qwen2":  # as Qwen2.5 0.5B: tied, the window off
            cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                       use_sliding_window=False, sliding_window=4096, max_window_layers=L)
            del cfg["attention_bias"], cfg["mlp_bias"]
        w["model.embed_tokens.weight"] = rnd(V, C, std=0.5)
        for l in range(L):
            h = f"model.layers.{l}."
            w[h + "input_layernorm.weight"] = 1 + rnd(C, std=0.1)
            w[h + "post_attention_layernorm.weight"] = 1 + rnd(C, std=0.1)
            for n, o, i in (("q_proj", NH * HD, C), ("k_proj", NKV * HD, C), ("v_proj", NKV * HD, C), ("o_proj", C, C)):
                w[h + "self_attn." + n + ".weight"] = rnd(o, i, std=0.4)  # nn.Linear: (out, in)
                if family == "qwen2" and n != "o_proj":
                    w[h + "self_attn." + n + ".bias"] = rnd(o, std=0.3)
            for n, o, i in (("gate_proj", F, C), ("up_proj", F, C), ("down_proj", C, F)):
                w[h + "mlp." + n + ".weight"] = rnd(o, i, std=0.3)
        w["model.norm.weight"] = 1 + rnd(C, std=0.1)
        if not cfg["tie_word_embeddings"]:
            w["lm_head.weight"] = rnd(V, C, std=0.5)
    else:  # mixtral: 4 experts of width 12, top-2, GQA
        NH, NKV, F, E, K = 4, 2, 12, 4, 2
        HD = C // NH
        cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": V, "hidden_size": C,
               "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV,
               "num_local_experts": E, "num_experts_per_tok": K, "router_aux_loss_coef": 0.02,
               "output_router_logits": False, "router_jitter_noise": 0.0, "max_position_embeddings": 64,
               "rms_norm_eps": 1e-5, "rope_theta": 1000.0, "sliding_window": None, "hidden_act": "silu",
               "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
        w["model.embed_tokens.weight"] = rnd(V, C, std=0.5)
        for l in range(L):
            h = f"model.layers.{l}."
            w[h + "input_layernorm.weight"] = 1 + rnd(C, std=0.1)
            w[h + "post_attention_layernorm.weight"] = 1 + rnd(C, std=0.1)
            for n, o, i in (("q_proj", NH * HD, C), ("k_proj", NKV * HD, C), ("v_proj", NKV * HD, C), ("o_proj", C, C)):
                w[h + "self_attn." + n + ".weight"] = rnd(o, i, std=0.4)
            b = h + "block_sparse_moe."
            w[b + "gate.weight"] = rnd(E, C, std=0.5)  # the router, no bias
            for e in range(E):
                for n, o, i in (("w1", F, C), ("w3", F, C), ("w2", C, F)):  # gate, up, down
                    w[f"{b}experts.{e}.{n}.weight"] = rnd(o, i, std=0.3)
        w["model.norm.weight"] = 1 + rnd(C, std=0.1)
        w["lm_head.weight"] = rnd(V, C, std=0.5)
    dtypes = {n: ("F32" if n.endswith("attn.bias") or n.endswith("masked_bias") else dtype) for n in w}
    tokens = rng.integers(0, V, T).astype("<i4")
    return cfg, w, tokens, dtypes


def main(argv):
    if len(argv) >= 3 and argv[0] == "make":
        opts = dict(dtype="F32", shards=1, hub_style=False)
        rest = argv[3:]
        while rest:
            if rest[0] == "--dtype":
                opts["dtype"], rest = rest[1], rest[2:]
            elif rest[0] == "--shards":
                opts["shards"], rest = int(rest[1]), rest[2:]
            elif rest[0] == "--hub-style":
                opts["hub_style"], rest = True, rest[1:]
            else:
                raise SystemExit(f"unknown option {rest[0]}")
        make(argv[1], argv[2], **opts)
    elif len(argv) in (4, 5) and argv[0] == "logits":
        with open(os.path.join(argv[1], "config.json")) as f:
            cfg = json.load(f)
        tokens = np.fromfile(argv[2], dtype="<i4")
        logits, margin = logits_of(cfg, load_model(argv[1]), tokens)
        logits.astype("<f8").tofile(argv[3])
        if len(argv) == 5:
            with open(argv[4], "w") as f:
                f.write(f"{margin!r}\n")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
