#!/usr/bin/env python3
"""Loss-curve regression: every parallel layout must reproduce the single-rank loss curve.

Trains the model of tiny.ini for a few dozen steps on one rank (per model family) and then
under each layout of layouts.json, all with the same build in the same run, and requires
|loss - loss_single| <= tol * loss_single at every step (fp32, tol = 1e-4). The single-rank
curves are also compared with the stored curves in reference/<family>.json (same tolerance)
so that numerical drift across commits is noticed; --update-reference rewrites them.
For mixture-of-experts families the aux loss curve (metrics field aux_loss) must match too:
|aux - aux_single| <= tol * max(aux_single, AUX_FLOOR) at every step.

Writes results.json (every curve, the deviations, pass/fail) and curves.png into --out, prints
a table and exits 1 when anything failed (2 when it could not run at all). See README.md.
"""
from __future__ import annotations

import argparse
import configparser
import datetime
import glob
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from report import finite_json, fmt_dev, plot, print_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_MPIRUN = "mpirun --allow-run-as-root --oversubscribe --bind-to none"
FORTUNES = "/usr/share/games/fortunes"
# The MoE aux loss is a small number (coefficient 0.01 times a balance statistic near 1 per layer):
# its deviation is taken relative to max(aux_single, AUX_FLOOR), so that an aux loss near 0 is
# compared absolutely (to tol * 1e-3) instead of relatively to a vanishing value.
AUX_FLOOR = 1e-3


class SetupError(Exception):
    """The suite cannot run at all (no binary, no corpus, bad layouts file): exit 2."""


# ---- layouts -------------------------------------------------------------------------------

# A family's "@data" names the dataset it trains on (default: the fortunes as documents).
DATASETS = {"sft": "the fortunes as prompt/response records: loss on the responses only (PREFIX.mask)"}


def option_args(settings: dict) -> list[str]:
    """{"parallel.tp": 2, "engine.distributed_optimizer": true} -> ["--parallel.tp", "2", ...]."""
    args = []
    for key, value in settings.items():
        if key.startswith("@"):  # the suite's own settings, not options
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        args += [f"--{key}", str(value)]
    return args


def load_layouts(path: Path) -> tuple[dict, list[dict]]:
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SetupError(f"{path}: {e}")
    families = spec.get("families")
    layouts = spec.get("layouts")
    if not isinstance(families, dict) or not families or not isinstance(layouts, list):
        raise SetupError(f"{path}: needs a 'families' object and a 'layouts' list")
    for fam, settings in families.items():
        if settings.get("@data", "sft") not in DATASETS:
            raise SetupError(f"{path}: families.{fam}: '@data' must be one of {list(DATASETS)}")
    default_families = spec.get("default_families", list(families))
    if not isinstance(default_families, list) or any(f not in families for f in default_families):
        raise SetupError(f"{path}: 'default_families' must list families of 'families'")
    names = set()
    for i, lay in enumerate(layouts):
        where = f"{path}: layouts[{i}]"
        if not isinstance(lay.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", lay["name"]):
            raise SetupError(f"{where}: 'name' must be a word of letters, digits and -_.+")
        if lay["name"] in names or lay["name"] == "single":
            raise SetupError(f"{where}: the name '{lay['name']}' is taken")
        names.add(lay["name"])
        if not isinstance(lay.get("ranks"), int) or not 1 <= lay["ranks"] <= 8:
            raise SetupError(f"{where} ({lay['name']}): 'ranks' must be an integer from 1 to 8")
        if not isinstance(lay.get("set", {}), dict):
            raise SetupError(f"{where} ({lay['name']}): 'set' must be an object of option: value")
        fams = lay.setdefault("families", list(default_families))
        unknown = [f for f in fams if f not in families]
        if unknown:
            raise SetupError(f"{where} ({lay['name']}): unknown families {unknown}; known: {list(families)}")
    return families, layouts


# ---- data ----------------------------------------------------------------------------------

def corpus_files(corpus: str) -> list[str]:
    """The fortune files of `corpus` (a directory), without their .dat/.u8 indexes, sorted."""
    files = sorted(f for f in glob.glob(os.path.join(corpus, "*"))
                   if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    if not files:
        raise SetupError(f"no corpus files in {corpus}; install the Debian package 'fortunes' (make deps) "
                         "or pass --corpus DIR")
    return files


def prepare_data(binary: str, prefix: str, corpus: str) -> None:
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    cmd = [binary, "prepare-data", "--overwrite", "--output", prefix, "--tokenizer", "byte", "--format", "delimited",
           "--delimiter", "%"] + corpus_files(corpus)
    print(f"preparing {prefix} from {corpus}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SetupError(f"prepare-data failed with exit code {r.returncode}")


def prepare_sft(binary: str, prefix: str, corpus: str) -> None:
    """Instruction data from the corpus: each fortune of two or more lines becomes a record whose
    prompt is its first line and whose response is the rest; prepare-data writes PREFIX.mask."""
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    records = 0
    with open(prefix + ".jsonl", "w") as out:
        for f in corpus_files(corpus):
            text = Path(f).read_text(encoding="utf-8", errors="replace")
            for fortune in re.split(r"^%$", text, flags=re.M):
                lines = fortune.strip("\n").split("\n")
                if len(lines) >= 2 and lines[0].strip():
                    out.write(json.dumps({"prompt": lines[0] + "\n", "response": "\n".join(lines[1:])}) + "\n")
                    records += 1
    cmd = [binary, "prepare-data", "--overwrite", "--output", prefix, "--tokenizer", "byte", "--format", "jsonl",
           "--prompt-key", "prompt", "--response-key", "response", prefix + ".jsonl"]
    print(f"preparing {prefix} ({records} prompt/response records) from {corpus}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SetupError(f"prepare-data (instruction data) failed with exit code {r.returncode}")


def dataset(ctx, settings: dict) -> str:
    """The dataset prefix a family trains on."""
    return ctx.data + "-" + settings["@data"] if "@data" in settings else ctx.data


# ---- one training run ----------------------------------------------------------------------

def first_error(log: str, rc: int) -> str:
    """The line of a failed run's output that says why."""
    for pattern in (r"mpigpt: error.*", r".*(Segmentation fault|Aborted|Killed|signal \d+).*",
                    r".*(error|Error|ERROR).*"):
        m = re.search(pattern, log)
        if m:
            return m.group(0).strip()[:300]
    tail = [l for l in log.splitlines() if l.strip()]
    return (tail[-1].strip()[:300] if tail else "") or f"exit code {rc}"


def resolved_config(log: str) -> dict:
    """The resolved configuration rank 0 prints at start, as {section.key: value}."""
    m = re.search(r"resolved configuration:\n(.*?)\n(?=mesh:)", log, re.S)
    if not m:
        return {}
    parser = configparser.ConfigParser(inline_comment_prefixes=("#",), interpolation=None)
    try:
        parser.read_string(m.group(1))
    except configparser.Error:
        return {}
    skip = {"data.path", "training.metrics_file", "training.train_iters"}  # differ by run, not by model
    return {f"{s}.{k}": v for s in parser.sections() for k, v in parser[s].items() if f"{s}.{k}" not in skip}


def read_curve(path: Path) -> tuple[list[int], list[float], list[float]]:
    """iterations, losses and MoE aux losses (empty for dense models) of a metrics file."""
    iters, losses, aux = [], [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "loss" in rec:
                    iters.append(int(rec["iter"]))
                    losses.append(float(rec["loss"]))
                    if "aux_loss" in rec:
                        aux.append(float(rec["aux_loss"]))
    return iters, losses, aux


def train(ctx, family: str, name: str, ranks: int, args: list[str], data: str) -> dict:
    """Runs one training job on dataset `data`; returns its record for results.json (losses empty on failure)."""
    tag = f"{family}-{name}"
    metrics = ctx.out / "metrics" / f"{tag}.jsonl"
    log_path = ctx.out / "logs" / f"{tag}.log"
    metrics.unlink(missing_ok=True)
    cmd = ctx.mpirun + ["-np", str(ranks), ctx.binary, "train", "--config", str(ctx.config),
                        "--data.path", data, "--training.train_iters", str(ctx.steps),
                        "--training.log_interval", "1", "--training.metrics_file", str(metrics)] + args
    rec = {"family": family, "layout": name, "ranks": ranks, "args": args, "command": shlex.join(cmd),
           "log": str(log_path), "iters": [], "losses": [], "aux_losses": []}
    print(f"[{tag}] {ranks} rank(s) {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    # Its own session, so that a hang is ended with the whole launcher tree.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ctx.env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=ctx.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc = None
    rec["seconds"] = round(time.monotonic() - t0, 2)
    log_path.write_text(f"$ {rec['command']}\n{output}")
    if rc is None:
        rec["error"] = f"timed out after {ctx.timeout} s (a hang?)"
    elif rc != 0:
        rec["error"] = f"exit code {rc}: {first_error(output, rc)}"
    if metrics.exists():  # also after a failure: the steps before it help the diagnosis
        try:
            rec["iters"], rec["losses"], rec["aux_losses"] = read_curve(metrics)
        except (OSError, ValueError, KeyError, TypeError) as e:  # nlohmann writes a NaN as null
            rec.setdefault("error", f"unreadable metrics file {metrics}: {e}")
        else:
            if "error" not in rec and rec["iters"] != list(range(1, ctx.steps + 1)):
                rec["error"] = (f"the metrics file has iterations {rec['iters'][:3]}...{rec['iters'][-3:]} "
                                f"({len(rec['iters'])} records), expected 1..{ctx.steps}")
    elif "error" not in rec:
        rec["error"] = f"the run wrote no metrics file {metrics}"
    if name == "single":
        rec["config"] = resolved_config(output)
    print(f"[{tag}] {rec['seconds']:.1f} s" + (f": {rec['error']}" if "error" in rec else ""), flush=True)
    return rec


# ---- comparison ----------------------------------------------------------------------------

def compare(losses: list[float], ref: list[float], tol: float, floor: float = 0.0) -> dict:
    """Relative deviation per step of `losses` from `ref` (relative to max(|ref|, floor)); passes
    when every step is within tol."""
    if not losses or not ref:
        return {"rel_dev": [], "max_rel_dev": None, "worst_step": None, "pass": False,
                "reason": "no curve" if not losses else "no reference curve"}
    n = min(len(losses), len(ref))
    dev = []
    for a, b in zip(losses[:n], ref[:n]):
        scale = max(abs(b), floor)
        d = abs(a - b) / scale if scale != 0 else abs(a - b)
        dev.append(d if math.isfinite(d) else math.inf)  # a NaN loss is the worst deviation there is
    worst = max(range(n), key=lambda i: dev[i])
    ok = all(d <= tol for d in dev)
    out = {"rel_dev": dev, "max_rel_dev": dev[worst], "worst_step": worst + 1, "pass": ok}
    if len(losses) != len(ref):
        out["note"] = f"compared the first {n} steps ({len(losses)} run, {len(ref)} in the reference)"
    return out


def config_diff(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(options whose value changed, options added or removed) between two resolved configs."""
    changed = [f"{k}: {old[k]} -> {new[k]}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    other = [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in sorted(set(old) ^ set(new))]
    return changed, other


def check_reference(ctx, family: str, single: dict) -> dict:
    path = ctx.reference_dir / f"{family}.json"
    rec = {"family": family, "path": str(path)}
    if not path.exists():
        rec.update({"pass": False, "reason": f"no stored reference {path}; create it with --update-reference"})
        return rec
    try:
        stored = json.loads(path.read_text())
        rec["losses"] = [float(x) for x in stored["losses"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        rec.update({"pass": False, "reason": f"unreadable reference {path}: {e}; rewrite it with --update-reference"})
        return rec
    rec.update(compare(single["losses"], stored["losses"], ctx.tol))
    if stored.get("aux_losses"):  # a MoE family: the stored aux curve too
        ca = compare(single.get("aux_losses", []), [float(x) for x in stored["aux_losses"]], ctx.tol, AUX_FLOOR)
        rec["aux_max_dev"] = ca["max_rel_dev"]
        if not ca["pass"]:
            rec["pass"] = False
            rec["reason"] = f"aux loss: {ca.get('reason') or 'deviation ' + fmt_dev(ca['max_rel_dev'])}"
    if stored.get("config") and single.get("config"):
        # A changed value makes the reference stale even where the curve stays within the
        # tolerance (a small change of weight_decay does); a new or removed option with its
        # default is only noted, so that adding options to the binary does not fail the suite.
        changed, other = config_diff(stored["config"], single["config"])
        if changed:
            rec["pass"] = False
            rec["reason"] = ("the configuration differs from the one the reference was made with: "
                             + "; ".join(changed) + "; if that is intended, rerun with --update-reference")
        if other:
            rec["note"] = "; ".join(filter(None, [rec.get("note"), "options added or removed since the reference: "
                                                   + "; ".join(other)]))
    return rec


def write_reference(ctx, family: str, single: dict) -> None:
    ctx.reference_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.reference_dir / f"{family}.json"
    doc = {
        "_comment": "Single-rank loss curve of regression/tiny.ini for this family; written by "
                    "regression/run.py --update-reference, compared by every run (same tolerance).",
        "family": family,
        "steps": len(single["losses"]),
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": git_describe(),
        "binary": ctx.version,
        "data": {"corpus": ctx.corpus, "bin_bytes": ctx.data_bytes},
        "args": single["args"],
        "config": single.get("config", {}),
        "losses": single["losses"],
    }
    if single.get("aux_losses"):
        doc["aux_losses"] = single["aux_losses"]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


def binary_version(binary: str) -> str:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        return r.stdout.splitlines()[0].strip() if r.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def git_describe() -> str:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ---- main ----------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--binary", default=str(ROOT / "build" / "mpigpt"), help="the mpigpt executable")
    p.add_argument("--mpirun", default=DEFAULT_MPIRUN, help="launcher command line; -np N is appended")
    p.add_argument("--out", help="output directory (default: regression/ beside the binary)")
    p.add_argument("--data", help="dataset prefix; prepared from --corpus when PREFIX.idx is missing "
                                  "(default: OUT/data/fortunes)")
    p.add_argument("--corpus", default=FORTUNES, help="directory of fortune files for the dataset")
    p.add_argument("--layouts", default="", metavar="REGEX",
                   help="run only layouts whose name matches (re.search); '^$' runs none, only the single-rank "
                        "runs and their reference check")
    p.add_argument("--families", default="", help="comma-separated model families (default: all)")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: training.train_iters of --config)")
    p.add_argument("--tol", type=float, default=1e-4, help="relative tolerance per step")
    p.add_argument("--config", default=str(HERE / "tiny.ini"), help="base INI config")
    p.add_argument("--layouts-file", default=str(HERE / "layouts.json"), help="layouts and families")
    p.add_argument("--reference-dir", default=str(HERE / "reference"), help="stored single-rank curves")
    p.add_argument("--update-reference", action="store_true",
                   help="rewrite reference/<family>.json from this run's single-rank curves")
    p.add_argument("--layout-args", default="", metavar="ARGS",
                   help="extra options for the layout runs only (not the single-rank runs), e.g. "
                        "'--training.lr 1.01e-3' to see that the suite catches a difference")
    p.add_argument("--timeout", type=int, default=120, help="seconds before one training run counts as hung")
    p.add_argument("--prepare-only", action="store_true", help="prepare the dataset and exit")
    p.add_argument("--with-one-rank", action="store_true",
                   help="also run a one-rank layout (with --layout-args: e.g. the GPU against the CPU curve)")
    p.add_argument("--skip-reference", action="store_true",
                   help="do not compare the single-rank runs with the stored curves (other --steps or --config)")
    p.add_argument("--require-gpu", action="store_true",
                   help="exit 77 (skipped) when this machine has no NVIDIA GPU")
    p.add_argument("--list", action="store_true", help="list the layouts and exit")
    return p.parse_args(argv)


class Context:
    pass


def has_gpu() -> bool:
    """An NVIDIA GPU with its driver: nvidia-smi lists one (or, without nvidia-smi, its device node exists)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return out.returncode == 0 and "GPU" in out.stdout
    except (OSError, subprocess.TimeoutExpired):
        return os.path.exists("/dev/nvidia0")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.require_gpu and not has_gpu():
        print("regression: no NVIDIA GPU on this machine: skipped")
        return 77
    families, layouts = load_layouts(Path(a.layouts_file))
    if a.list:
        for lay in layouts:
            print(f"{lay['name']:<30} {lay['ranks']} ranks  {' '.join(option_args(lay.get('set', {})))}"
                  f"  [{', '.join(lay['families'])}]")
        return 0
    ctx = Context()
    ctx.binary = os.path.abspath(a.binary)
    if not os.access(ctx.binary, os.X_OK):
        raise SetupError(f"no mpigpt executable at {ctx.binary}; build it (cmake --build BUILD --target mpigpt) "
                         "or pass --binary")
    ctx.version = binary_version(ctx.binary)
    ctx.out = Path(a.out or Path(ctx.binary).parent / "regression").resolve()
    ctx.data = os.path.abspath(a.data or ctx.out / "data" / "fortunes")
    ctx.corpus = a.corpus
    if a.prepare_only or not os.path.exists(ctx.data + ".idx"):
        prepare_data(ctx.binary, ctx.data, a.corpus)
    for name in sorted({s["@data"] for s in families.values() if "@data" in s}):
        prefix = ctx.data + "-" + name
        if a.prepare_only or not os.path.exists(prefix + ".idx"):
            prepare_sft(ctx.binary, prefix, a.corpus)
    if a.prepare_only:
        return 0
    ctx.data_bytes = os.path.getsize(ctx.data + ".bin") if os.path.exists(ctx.data + ".bin") else None
    ctx.config = Path(a.config).resolve()
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ctx.config)
    ctx.steps = a.steps or ini.getint("training", "train_iters", fallback=32)
    ctx.tol = a.tol
    ctx.timeout = a.timeout
    ctx.reference_dir = Path(a.reference_dir).resolve()
    ctx.mpirun = shlex.split(a.mpirun)
    # One thread per rank: the ranks share the cores, and BLAS threads would only fight them.
    ctx.env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    ctx.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    ctx.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    for sub in ("metrics", "logs"):
        (ctx.out / sub).mkdir(parents=True, exist_ok=True)

    fams = [f for f in a.families.split(",") if f] or list(families)
    unknown = [f for f in fams if f not in families]
    if unknown:
        raise SetupError(f"--families: unknown {unknown}; known: {list(families)}")
    try:
        selected = [lay for lay in layouts if re.search(a.layouts, lay["name"])]
    except re.error as e:
        raise SetupError(f"--layouts '{a.layouts}': {e}")
    if a.with_one_rank:
        selected.insert(0, {"name": "one-rank", "ranks": 1, "set": {}, "families": list(families)})
    extra = shlex.split(a.layout_args)

    t_start = time.monotonic()
    singles, references, runs, rows = {}, {}, [], []
    for fam in fams:
        fam_args = option_args(families[fam])
        s = train(ctx, fam, "single", 1, fam_args, dataset(ctx, families[fam]))
        singles[fam] = s
        row = {"layout": "single vs stored", "family": fam, "ranks": 1, "seconds": s["seconds"], "notes": []}
        if "error" in s:
            row.update(result="ERROR", notes=[s["error"]])
        elif a.update_reference:
            write_reference(ctx, fam, s)
            row.update(result="UPDATED")
        elif a.skip_reference:
            row.update(result="PASS", notes=["not compared with the stored curve (--skip-reference)"])
        else:
            ref = check_reference(ctx, fam, s)
            references[fam] = ref
            row.update(max_rel_dev=ref.get("max_rel_dev"), worst_step=ref.get("worst_step"),
                       aux_max_dev=ref.get("aux_max_dev"), result="PASS" if ref["pass"] else "FAIL")
            for key in ("reason", "note"):
                if ref.get(key):
                    row["notes"].append(ref[key])
        rows.append(row)
    for lay in selected:
        for fam in fams:
            if fam not in lay["families"]:
                continue
            args = option_args(families[fam]) + option_args(lay.get("set", {})) + extra
            r = train(ctx, fam, lay["name"], lay["ranks"], args, dataset(ctx, families[fam]))
            row = {"layout": lay["name"], "family": fam, "ranks": lay["ranks"], "seconds": r["seconds"], "notes": []}
            if "error" in r:
                row.update(result="ERROR", notes=[r["error"]])
                r["pass"] = False
            elif "error" in singles[fam]:
                row.update(result="ERROR", notes=["no single-rank curve to compare with"])
                r["pass"] = False
            else:
                c = compare(r["losses"], singles[fam]["losses"], ctx.tol)
                r.update(c)
                ok = c["pass"]
                if singles[fam].get("aux_losses") or r.get("aux_losses"):  # a MoE family: its aux curve too
                    ca = compare(r.get("aux_losses", []), singles[fam].get("aux_losses", []), ctx.tol, AUX_FLOOR)
                    r["aux"] = ca
                    row["aux_max_dev"] = ca["max_rel_dev"]
                    if not ca["pass"]:
                        ok = False
                        row["notes"].append(f"aux loss: {ca.get('reason') or 'deviation ' + fmt_dev(ca['max_rel_dev'])}"
                                            f" at step {ca.get('worst_step')}")
                row.update(max_rel_dev=c["max_rel_dev"], worst_step=c["worst_step"], result="PASS" if ok else "FAIL")
            runs.append(r)
            rows.append(row)
    total = time.monotonic() - t_start

    ok = all(r["result"] in ("PASS", "UPDATED") for r in rows)
    png = plot(ctx.out, singles, runs, references, ctx.tol)
    results = {
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": git_describe(),
        "binary": ctx.binary,
        "binary_version": ctx.version,
        "mpirun": a.mpirun,
        "config": str(ctx.config),
        "data": ctx.data,
        "steps": ctx.steps,
        "tolerance": ctx.tol,
        "layout_args": extra,
        "seconds": round(total, 1),
        "pass": ok,
        "singles": singles,
        "reference_checks": references,
        "layouts": runs,
        "table": [{k: v for k, v in r.items() if k != "notes"} | {"notes": r["notes"]} for r in rows],
        "plot": png,
    }
    (ctx.out / "results.json").write_text(json.dumps(finite_json(results), indent=1, allow_nan=False) + "\n")
    print_table(rows, ctx.tol, AUX_FLOOR)
    print(f"\n{len(rows)} checks in {total:.0f} s; results in {ctx.out / 'results.json'}"
          + (f", plot {png}" if png else "") + f", logs in {ctx.out / 'logs'}")
    failed = [f"{r['layout']} ({r['family']})" for r in rows if r["result"] not in ("PASS", "UPDATED")]
    print("PASS" if ok else f"FAIL: {', '.join(failed)}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SetupError as e:
        print(f"regression: {e}", file=sys.stderr)
        sys.exit(2)
