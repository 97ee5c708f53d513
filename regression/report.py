"""The loss-curve regression's report (run.py): results.json kept strict JSON, the table it prints
and curves.png, every layout's curve and its deviation from the single-rank one."""
from __future__ import annotations

import math
from pathlib import Path

EXACT_FLOOR = 1e-12  # where an exact match is drawn on the log-scale deviation panel


# ---- report --------------------------------------------------------------------------------

def finite_json(x):
    """x with infinite and NaN floats as strings, so that results.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_json(v) for v in x]
    return x


def fmt_dev(x) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2e}"


def print_table(rows: list[dict], tol: float, aux_floor: float) -> None:
    head = ("layout", "family", "ranks", "max rel dev", "worst step", "aux max dev", "time", "result")
    lines = [head] + [(r["layout"], r["family"], str(r["ranks"]), fmt_dev(r.get("max_rel_dev")),
                       str(r.get("worst_step") or "-"), fmt_dev(r.get("aux_max_dev")),
                       f"{r['seconds']:.1f}s" if r.get("seconds") else "-", r["result"]) for r in rows]
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    print(f"\nloss-curve regression: |loss - loss_single| <= {tol:g} * loss_single at every step; MoE aux loss: "
          f"|aux - aux_single| <= {tol:g} * max(aux_single, {aux_floor:g})")
    for i, l in enumerate(lines):
        print("  ".join(c.rjust(w) if 2 <= j <= 6 else c.ljust(w) for j, (c, w) in enumerate(zip(l, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in rows:
        for note in r.get("notes", []):
            print(f"  {r['layout']} ({r['family']}): {note}")


def plot(out: Path, singles: dict, runs: list[dict], references: dict, tol: float) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"warning: no curves.png ({e}); the Debian python3 with python3-matplotlib draws it")
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    styles = {fam: s for fam, s in zip(sorted(singles), ["-", "--", ":", "-."] * 4)}
    layouts = sorted({r["layout"] for r in runs})
    colors = {name: plt.cm.tab10(i % 10) if len(layouts) <= 10 else plt.cm.tab20(i % 20)
              for i, name in enumerate(layouts)}
    # Each curve is drawn in both panels with the same style; one legend (beside the top panel)
    # names them all.
    for fam, s in sorted(singles.items()):
        if s["losses"]:
            ax1.plot(s["iters"], s["losses"], styles[fam], color="black", lw=3, alpha=0.35,
                     label=f"{fam} single rank")
        ref = references.get(fam, {})
        if ref.get("losses"):
            ax1.plot(range(1, len(ref["losses"]) + 1), ref["losses"], styles[fam], color="black", marker="x",
                     ms=4, lw=0.5, label=f"{fam} stored reference")
            if ref.get("rel_dev"):
                ax2.plot(range(1, len(ref["rel_dev"]) + 1), [max(d, EXACT_FLOOR) for d in ref["rel_dev"]],
                         styles[fam], color="black", marker="x", ms=4, lw=0.5)
    for r in runs:
        if not r["losses"]:
            continue
        label = f"{r['family']} {r['layout']}" + ("" if r.get("pass") else " (FAIL)")
        ax1.plot(r["iters"], r["losses"], styles[r["family"]], color=colors[r["layout"]], lw=1, label=label)
        if r.get("rel_dev"):
            ax2.plot(r["iters"][:len(r["rel_dev"])], [max(d, EXACT_FLOOR) for d in r["rel_dev"]],
                     styles[r["family"]], color=colors[r["layout"]], lw=1)
    ax1.set_ylabel("training loss")
    ax1.set_title("loss curves: every layout against the single-rank run of its family")
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax1.grid(alpha=0.3)
    ax2.set_yscale("log")
    ax2.axhline(tol, color="red", ls="--", lw=1)
    ax2.annotate(f"tolerance {tol:g}", (1.0, tol), xycoords=("axes fraction", "data"), xytext=(4, 0),
                 textcoords="offset points", color="red", fontsize=8, va="center")
    ax2.set_ylabel(f"|loss - single| / single\n(exact agreement drawn at {EXACT_FLOOR:g})")
    ax2.set_xlabel("iteration")
    ax2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
