#!/usr/bin/env python3
"""Curves of mpigpt runs from their metrics files (training.metrics_file), several runs overlaid:
training and validation loss, learning rate, gradient norm and throughput against the iteration.
  plot_metrics.py METRICS.jsonl [METRICS.jsonl ...] [--label NAME ...] --output loss.png
"""
import argparse
import json
import sys
from pathlib import Path


def fail(msg: str) -> None:
    print(f"plot_metrics: error: {msg}", file=sys.stderr)
    sys.exit(2)


def read_run(path: str) -> dict:
    """The step records and validation records of one metrics file, by iteration."""
    steps, evals = {}, {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}; give the file training.metrics_file named")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue  # a last line cut short by a run that was killed
            fail(f"{path}:{n} is not a JSON object; is it an mpigpt metrics file?")
        if not isinstance(rec, dict) or "iter" not in rec:
            fail(f"{path}:{n} has no \"iter\"; is it an mpigpt metrics file?")
        (evals if "val_loss" in rec else steps)[rec["iter"]] = rec
    if not steps and not evals:
        fail(f"{path} holds no records; the run logged nothing yet (training.log_interval)")
    return {"steps": [steps[i] for i in sorted(steps)], "evals": [evals[i] for i in sorted(evals)]}


PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm (before clipping)"),
          ("tokens_per_s", "throughput (tokens/s, all ranks)")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", help="metrics files (JSON lines) of one or more runs")
    ap.add_argument("--label", action="append", default=[], help="legend name of each run, in order (default: "
                    "the file name)")
    ap.add_argument("--output", required=True, help="the image to write (.png, .pdf, .svg)")
    a = ap.parse_args()
    if a.label and len(a.label) != len(a.metrics):
        fail(f"{len(a.label)} --label for {len(a.metrics)} metrics files; give one per file or none")
    runs = [read_run(p) for p in a.metrics]
    labels = a.label or [Path(p).name for p in a.metrics]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("matplotlib is missing; `make deps` installs it (python3-matplotlib)")

    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    for k, (run, label) in enumerate(zip(runs, labels)):
        color = plt.cm.tab10(k % 10)
        for ax, (key, title) in zip(axes.flat, PANELS):
            pts = [(s["iter"], s[key]) for s in run["steps"] if key in s]
            if pts:
                ax.plot(*zip(*pts), color=color, lw=1.2, label=f"{label}" + (" (train)" if key == "loss" else ""))
            if key == "loss" and run["evals"]:
                ax.plot([e["iter"] for e in run["evals"]], [e["val_loss"] for e in run["evals"]], "o--",
                        color=color, ms=4, lw=1, label=f"{label} (validation)")
            ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(a.output, dpi=110)
    except (OSError, ValueError) as e:
        fail(f"cannot write {a.output}: {e}")
    n = sum(len(r["steps"]) for r in runs)
    print(f"plot: {a.output} ({len(runs)} run(s), {n} logged steps)")


if __name__ == "__main__":
    main()
