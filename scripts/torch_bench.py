#!/usr/bin/env python3
"""The PyTorch side of scripts/bench_gpu.sh: training steps of the model an mpigpt configuration
resolves to, written as a PyTorch user writes them (fp32 weights, bf16 autocast, SDPA, fused AdamW,
torch.compile), timed as `mpigpt bench` times its own: the median ms/step after the warm-up steps."""
import argparse
import configparser
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def read_config(path):
    """The [model], [training], [parallel], [engine] and [lora] options of an mpigpt INI file as
    the resolved configuration `mpigpt bench` prints (every option present, derived ones filled)."""
    ini = configparser.ConfigParser(inline_comment_prefixes=("#",), interpolation=None)
    if not ini.read(path):
        sys.exit(f"torch_bench: cannot read {path}")
    cfg = {}
    for section in ("model", "training", "parallel", "engine", "lora"):
        if section not in ini:
            sys.exit(f"torch_bench: {path} has no [{section}]: pass the resolved configuration mpigpt bench prints")
        for key, value in ini[section].items():
            cfg[f"{section}.{key}"] = value.strip().strip('"')
    return cfg


def check_supported(cfg, path):
    """The reference is one dense model on one device: anything else is an error naming the option."""
    expect = {"parallel.tp": "1", "parallel.pp": "1", "parallel.cp": "1", "parallel.ep": "1",
              "model.num_experts": "0", "lora.rank": "0", "engine.recompute": "none"}
    for key, want in expect.items():
        if cfg[key] != want:
            sys.exit(f"torch_bench: {path}: {key} = {cfg[key]}; the PyTorch reference runs only {key} = {want}")
    if cfg["model.family"] not in ("gpt2", "llama"):
        sys.exit(f"torch_bench: {path}: model.family = {cfg['model.family']}; use gpt2 or llama")
    if cfg["training.precision"] not in ("fp32", "bf16"):
        sys.exit(f"torch_bench: {path}: training.precision = {cfg['training.precision']}; use fp32 or bf16")


class Block(nn.Module):
    """A pre-norm transformer block: GPT-2 (LayerNorm, GELU, biases) or Llama (RMSNorm, SwiGLU,
    RoPE, grouped-query attention, no biases); QKV and [gate; up] are one Linear each, as in mpigpt."""

    def __init__(self, m):
        super().__init__()
        C, self.nh, self.nkv, self.gpt2 = m["C"], m["NH"], m["NKV"], m["gpt2"]
        self.hd = C // self.nh
        Norm = (lambda: nn.LayerNorm(C, eps=m["eps"])) if self.gpt2 else (lambda: nn.RMSNorm(C, eps=m["eps"]))
        self.attn_norm, self.mlp_norm = Norm(), Norm()
        self.qkv = nn.Linear(C, (self.nh + 2 * self.nkv) * self.hd, bias=self.gpt2)
        self.proj = nn.Linear(self.nh * self.hd, C, bias=self.gpt2)
        self.fc = nn.Linear(C, m["F"] if self.gpt2 else 2 * m["F"], bias=self.gpt2)
        self.fc_proj = nn.Linear(m["F"], C, bias=self.gpt2)

    def forward(self, x, rope):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        if self.nkv != self.nh:  # as Hugging Face's Llama does (repeat_kv): the fused SDPA kernels then apply
            k, v = k.repeat_interleave(self.nh // self.nkv, 1), v.repeat_interleave(self.nh // self.nkv, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        h = self.fc(self.mlp_norm(x))
        if self.gpt2:
            h = F.gelu(h, approximate="tanh")
        else:
            gate, up = h.chunk(2, -1)
            h = F.silu(gate) * up
        return x + self.fc_proj(h)


def rotate(x, cos, sin):
    """RoPE on (B, heads, T, HD), the halves convention of Hugging Face's Llama."""
    a, b = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat((-b, a), -1) * sin.to(x.dtype)


class GPT(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.word = nn.Embedding(m["Vp"], m["C"])
        self.position = nn.Embedding(m["maxT"], m["C"]) if m["gpt2"] else None
        self.layers = nn.ModuleList(Block(m) for _ in range(m["L"]))
        self.final_norm = nn.LayerNorm(m["C"], eps=m["eps"]) if m["gpt2"] else nn.RMSNorm(m["C"], eps=m["eps"])
        self.lm_head = nn.Linear(m["C"], m["Vp"], bias=False)
        if m["tied"]:
            self.lm_head.weight = self.word.weight
        hd = m["C"] // m["NH"]
        inv = 1.0 / m["theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(m["T"], dtype=torch.float32), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        out_std = m["std"] / math.sqrt(2 * m["L"])  # residual outputs, as mpigpt initialises them
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=out_std if name.endswith(("proj.weight", "fc_proj.weight")) else m["std"])

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.word(idx)
        rope = None
        if self.position is not None:
            x = x + self.position.weight[:T]
        else:
            rope = (self.cos[:T], self.sin[:T])
        for layer in self.layers:
            x = layer(x, rope)
        logits = self.lm_head(self.final_norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def model_dims(cfg):
    mult = int(cfg["model.vocab_multiple"])  # times tp, which check_supported holds at 1
    V = int(cfg["model.vocab_size"])
    return {"gpt2": cfg["model.family"] == "gpt2", "L": int(cfg["model.num_layers"]), "C": int(cfg["model.hidden"]),
            "NH": int(cfg["model.num_heads"]), "NKV": int(cfg["model.num_kv_heads"]), "F": int(cfg["model.ffn_hidden"]),
            "T": int(cfg["model.seq_len"]), "maxT": int(cfg["model.max_position"]), "V": V,
            "Vp": (V + mult - 1) // mult * mult, "eps": float(cfg["model.norm_eps"]),
            "theta": float(cfg["model.rope_theta"]), "std": float(cfg["model.init_std"]),
            "tied": cfg["model.tie_embeddings"] == "true"}


def flops_per_token(model):
    """Model FLOPs of a training step per token counted from the modules built (not from the
    configuration), as mpigpt counts its own: 3x the forward's GEMMs, causal attention halved."""
    m = model.m
    gemms = sum(2 * mod.in_features * mod.out_features for mod in model.modules() if isinstance(mod, nn.Linear))
    attention = m["L"] * 2 * m["T"] * m["C"]  # QK^T and PV: 2 * 2 * T * NH * HD, halved
    return 3 * (gemms + attention)


def optimizer(model, cfg):
    """Fused AdamW with mpigpt's hyperparameters; biases, norms and embeddings without weight decay."""
    no_decay = {id(p) for mod in model.modules() if isinstance(mod, (nn.Embedding, nn.LayerNorm, nn.RMSNorm))
                for p in mod.parameters(recurse=False)}
    decays = lambda p: p.dim() >= 2 and id(p) not in no_decay
    params = list(model.parameters())
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": float(cfg["training.weight_decay"])},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=float(cfg["training.lr"]), eps=float(cfg["training.eps"]), fused=True,
                             betas=(float(cfg["training.beta1"]), float(cfg["training.beta2"])))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="the resolved configuration `mpigpt bench` printed")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile compiles in the first)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", action="store_true", help="eager PyTorch (not the reference: for a look only)")
    a = ap.parse_args()
    cfg = read_config(a.config)
    check_supported(cfg, a.config)
    m = model_dims(cfg)
    B, gb = int(cfg["training.micro_batch"]), int(cfg["training.global_batch"])
    if gb % B:
        sys.exit(f"torch_bench: {a.config}: training.global_batch {gb} is not a multiple of micro_batch {B}")
    dev = torch.device(a.device)
    torch.manual_seed(int(cfg["training.seed"]))
    model = GPT(m).to(dev)
    fpt = flops_per_token(model)
    nparams = sum(p.numel() for p in model.parameters())
    opt = optimizer(model, cfg)
    step_model = model if a.no_compile else torch.compile(model)
    bf16, clip, accum = cfg["training.precision"] == "bf16", float(cfg["training.clip_grad"]), gb // B
    tokens = torch.randint(0, m["V"], (accum, B, m["T"] + 1), device=dev)
    inputs, targets = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()

    def step():
        for i in range(accum):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = step_model(inputs[i], targets[i]) / accum
            loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach() * accum

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    what = "bf16 autocast over fp32 weights" if bf16 else "fp32"
    print(f"torch: {cfg['model.family']}, {nparams / 1e6:.1f}M parameters, micro-batch {B} x {m['T']} tokens, "
          f"{what}, SDPA, fused AdamW, {'eager' if a.no_compile else 'torch.compile'} (torch {torch.__version__})",
          flush=True)
    times, losses = [], []
    try:
        for _ in range(a.warmup + a.steps):
            sync()
            t0 = time.perf_counter()
            losses.append(step())
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    except torch.cuda.OutOfMemoryError:
        print(f"torch: out of GPU memory at micro-batch {B}", flush=True)
        sys.exit(3)
    t = sorted(times[a.warmup:])
    median, tokens = statistics.median(t), gb * m["T"]
    print(f"torch: {len(t)} steps after {a.warmup} warm-up: median {median:.1f} ms/step (min {t[0]:.1f}, "
          f"max {t[-1]:.1f}), {tokens / (median / 1e3):.0f} tok/s")
    print(f"torch: {fpt * tokens / 1e9:.1f} GFLOP per step (counted from the modules built)")
    print(f"torch: loss first step {losses[0].item():.4f}, last {losses[-1].item():.4f}")
    if dev.type == "cuda":
        print(f"torch: peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
