#!/usr/bin/env python3
"""Our exports checked by the real libraries: `convert --to hf` loaded by transformers and
`convert --to peft` loaded by peft must give mpigpt's loss on the same tokens.

For each family (gpt2; llama with grouped-query heads; qwen2, llama with q/k/v biases and a tied
head, exported as Qwen2ForCausalLM; mixtral, a llama-family MoE) it trains a
tiny model on DATA, exports it, trains LoRA adapters on it and exports them, then computes the
mean token loss over four fixed sequences of English text with mpigpt (fp32, CPU backend; the
adapters read back through --init-from-peft) and with transformers (fp32, CPU, eager attention;
the adapters through peft's PeftModel). For llama the adapters are one per projection (q, v, gate,
up), and for llama and qwen2 adapters that peft itself made (its own random A and B per projection, lora_dropout 0.05:
on q_proj, v_proj and up_proj, and rank-stabilised on "all-linear") are read by --init-from-peft too. |ours - theirs| must be at most TOL. Needs python3 with
torch, transformers and peft; exits 77 (skipped) without them, 1 when a comparison fails.

  hf_check.py --mpigpt "build/mpigpt" --data PREFIX --out DIR [--families gpt2,llama,qwen2,mixtral]
"""
import argparse
import json
import shlex
import struct
import subprocess
import sys
from pathlib import Path

# mpigpt's fp32 loss here lies within 1.4e-8 of a float64 forward pass of the export (the numpy
# oracle io/formats/testdata/make_hf_tiny.py); another fp32 implementation rounds differently, but
# by about 1e-7, not 1e-5.
TOL = 1e-5
B, T = 4, 64
TEXT = (b"It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        b"the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it "
        b"was the season of Light, it was the season of Darkness, it was the spring of hope, it was "
        b"the winter of despair, we had everything before us, we had nothing before us.")
FAMILIES = {
    "gpt2": ["--model.family", "gpt2", "--model.num_heads", "4"],
    "llama": ["--model.family", "llama", "--model.num_heads", "4", "--model.num_kv_heads", "2"],
    "qwen2": ["--model.family", "llama", "--model.num_heads", "4", "--model.num_kv_heads", "2",
              "--model.qkv_bias", "true", "--model.tie_embeddings", "true"],
    "mixtral": ["--model.family", "llama", "--model.num_heads", "4", "--model.num_kv_heads", "2",
                "--model.num_experts", "4", "--model.moe_top_k", "2", "--model.moe_norm_topk_prob", "true"],
}
SHAPE = ["--model.num_layers", "2", "--model.hidden", "64"]
# mpigpt's LoRA targets per family: llama an adapter per projection, as peft trains them.
TARGETS = {"gpt2": "qkv,proj,fc1,fc2", "llama": "q,v,proj,gate,up,fc2", "qwen2": "q,k,v,proj,gate,up,fc2",
           "mixtral": "qkv,proj,fc1,fc2"}
TRAIN = ["--model.seq_len", str(T), "--training.micro_batch", "8", "--training.global_batch", "8",
         "--training.warmup_iters", "5", "--training.eval_interval", "0", "--training.log_interval", "10"]


def run(cmd, log):
    with open(log, "a") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            sys.exit(f"hf_check: failed (output in {log}): {shlex.join(cmd)}")


def write_tokens(path):
    """The text as byte tokens in an llm.c token file (version 1: uint16), B*T+1 of them."""
    tokens = list(TEXT[:B * T + 1])
    assert len(tokens) == B * T + 1, "TEXT is too short"
    header = [20240520, 1, len(tokens)] + [0] * 253
    path.write_bytes(struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens))
    return tokens


def mpigpt_loss(mpigpt, out, name, init, tokens_path, log):
    """Iteration 1's loss, before any update: the four sequences in order (no shuffle)."""
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    run(mpigpt + ["train"] + init +
        ["--model.seq_len", str(T), "--data.path", str(tokens_path), "--data.valid_fraction", "0",
         "--data.shuffle", "false", "--training.train_iters", "1", "--training.micro_batch", str(B),
         "--training.global_batch", str(B), "--training.eval_interval", "0", "--training.log_interval", "1",
         "--training.metrics_file", str(metrics)], log)
    return json.loads(metrics.read_text().splitlines()[0])["loss"]


def hf_loss(torch, model, tokens):
    x = torch.tensor(tokens, dtype=torch.long)
    inp = torch.stack([x[b * T:(b + 1) * T] for b in range(B)])
    tgt = torch.stack([x[b * T + 1:(b + 1) * T + 1] for b in range(B)])
    with torch.no_grad():
        logits = model(input_ids=inp).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), tgt.reshape(-1)).item()


def compare(fam, lib, ours, theirs):
    good = abs(ours - theirs) <= TOL
    print(f"hf_check: {fam} {lib}: mpigpt {ours:.9f}, {lib} {theirs:.9f}, difference {ours - theirs:.2e} "
          f"({'ok' if good else f'over {TOL:g}'})")
    return good


def check_family(fam, args, mpigpt, libs):
    torch, transformers, peft = libs
    out = Path(args.out) / fam
    out.mkdir(parents=True, exist_ok=True)
    log = out / "mpigpt.log"
    log.write_text("")
    tokens = write_tokens(out / "tokens.bin")
    base, hf, lora, peft_dir = (str(out / d) for d in ("base", "hf", "lora", "peft"))
    run(mpigpt + ["train"] + FAMILIES[fam] + SHAPE + TRAIN +
        ["--data.path", args.data, "--training.lr", "3e-3", "--training.train_iters", "60",
         "--checkpoint.save", base], log)
    run(mpigpt + ["convert", "--to", "hf", base, hf], log)
    run(mpigpt + ["train"] + TRAIN + ["--init-from-checkpoint", base, "--lora.rank", "4", "--lora.alpha", "8",
                                      "--lora.targets", TARGETS[fam], "--data.path", args.data, "--training.lr", "1e-2",
                                      "--training.train_iters", "30", "--checkpoint.save", lora], log)
    run(mpigpt + ["convert", "--to", "peft", lora, peft_dir], log)
    ours = mpigpt_loss(mpigpt, out, "base_loss", ["--init-from-checkpoint", base], out / "tokens.bin", log)
    ours_lora = mpigpt_loss(mpigpt, out, "lora_loss", ["--init-from-checkpoint", base, "--init-from-peft", peft_dir],
                            out / "tokens.bin", log)

    ok = True
    try:  # the libraries' own errors are what this check is for: reported, then the next family
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
        ok &= compare(fam, "transformers", ours, hf_loss(torch, model.eval(), tokens))
        adapted = peft.PeftModel.from_pretrained(model, peft_dir)
        ok &= compare(fam, "peft", ours_lora, hf_loss(torch, adapted.eval(), tokens))
        if fam in ("llama", "qwen2"):
            for targets in (["q_proj", "v_proj", "up_proj"], "all-linear"):
                ok &= check_peft_made(torch, transformers, peft, (fam, hf, base, out, mpigpt, tokens, log), targets)
    except Exception as e:  # noqa: BLE001
        print(f"hf_check: {fam}: {type(e).__name__}: {e}")
        return False
    if abs(ours_lora - ours) < 10 * TOL:
        print(f"hf_check: {fam}: the adapters barely change the loss ({ours} -> {ours_lora}): nothing was checked")
        ok = False
    return ok


def check_peft_made(torch, transformers, peft, run_args, targets):
    """An adapter as peft makes one on `targets` (its own A per projection, dropout; B random,
    init_lora_weights=False, so that it is no no-op; "all-linear" saved as full module names) read
    by mpigpt --init-from-peft."""
    fam, hf, base, out, mpigpt, tokens, log = run_args
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=targets, init_lora_weights=False,
                          use_rslora=targets == "all-linear", task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, cfg)
    name = "peft_made_" + ("all_linear" if targets == "all-linear" else "_".join(targets))
    adapted.save_pretrained(str(out / name))
    ours = mpigpt_loss(mpigpt, out, name + "_loss", ["--init-from-checkpoint", base, "--init-from-peft", str(out / name)],
                       out / "tokens.bin", log)
    return compare(fam, f"peft-made adapter on {targets}", ours, hf_loss(torch, adapted.eval(), tokens))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mpigpt", required=True, help="the mpigpt command (may be a command line)")
    p.add_argument("--data", required=True, help="dataset prefix the tiny models train on (byte tokens)")
    p.add_argument("--out", required=True, help="directory for models, exports and logs")
    p.add_argument("--families", default=",".join(FAMILIES), help="of " + ", ".join(FAMILIES))
    args = p.parse_args()
    families = args.families.split(",")
    for f in families:
        if f not in FAMILIES:
            p.error(f"--families: unknown family '{f}' (known: {', '.join(FAMILIES)})")
    try:
        import peft
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_check: skipped, {e} (needs torch, transformers and peft)")
        return 77
    print(f"hf_check: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    ok = [check_family(f, args, shlex.split(args.mpigpt), (torch, transformers, peft)) for f in families]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
