"""End-to-end training throughput of train.py: AdamW, FRUGAL 0.25, FRUGAL 0.0, GaLore and BAdam on the
same model and batch, and each method's ratio to AdamW (the paper's "no slowdown" claim: >= 0.98).

    python -m bench.train_step                                  # CPU, modest: llama_20m, 3 rounds
    python -m bench.train_step --model llama_130m --steps 30 --warmup 10 --rounds 5 \\
        --batch-size 64 --micro-batch-size 64 --seq-len 256 -- train.compile=true   # a GPU
    python -m bench.train_step --in-backward --methods "FRUGAL 0.25" "FRUGAL 0.0"  # the step in backward

Each method runs `python train.py` in its own process on the synthetic corpus; a run's rate is the
median `scored_tokens_per_s` of its steps after the warm-up. Methods are interleaved in rounds and the
ratio to AdamW is taken within each round (median and range over rounds). Arguments after `--` go to
train.py as Hydra overrides. `--in-backward` adds each FRUGAL method with the step inside backward
and its ratio to the ordinary step of the same round (target >= 0.95). docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"AdamW": "adamw", "FRUGAL 0.25": "frugal", "FRUGAL 0.0": "frugal_rho0", "GaLore": "galore",
           "BAdam": "badam"}
TARGET = 0.98  # the paper's "no slowdown", for FRUGAL
IN_BACKWARD = " in backward"  # label suffix of a method's run with train.optimizer_in_backward=true
IN_BACKWARD_TARGET = 0.95  # of the same method's ordinary step


def option_of(label: str) -> str:
    """The train.py overrides of a method label, space-separated."""
    if label.endswith(IN_BACKWARD):
        return f"optimizer={METHODS[label[:-len(IN_BACKWARD)]]} train.optimizer_in_backward=true"
    return f"optimizer={METHODS[label]}"


def run_once(option: str, args, run_dir: Path) -> list[float]:
    """One training process (`option`: overrides, space-separated); the per-step rates after the warm-up."""
    cmd = [sys.executable, str(ROOT / "train.py"), *option.split(), f"model={args.model}", "data=synthetic",
           f"data.seq_len={args.seq_len}", f"train.steps={args.steps}", f"train.batch_size={args.batch_size}",
           f"train.micro_batch_size={args.micro_batch_size}", "train.log_every=1", "train.eval_every=0",
           "train.eval_tokens=256", "checkpoint.every=0", "train.progress_bar=false", "train.plot=false",
           "wandb.mode=disabled", f"train.seed={args.seed}", "train.precision=bf16-mixed",  # the paper's regime
           *args.overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="disabled"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rates = [r["scored_tokens_per_s"] for r in rows if "loss" in r and r["step"] > args.warmup]
    if not rates:
        raise RuntimeError(f"no training rows after the warm-up of {args.warmup} steps in {run_dir}")
    return rates


def benchmark(args) -> dict:
    """{method: {"rates": [median rate per round], "ratios": [ratio to AdamW per round]}}."""
    results = {label: {"rates": [], "ratios": []} for label in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label in args.methods:
                started = time.time()
                rates = run_once(option_of(label), args, Path(tmp) / f"run{args.methods.index(label)}_{r}")
                results[label]["rates"].append(statistics.median(rates))
                print(f"round {r + 1}/{args.rounds} {label:<12} {statistics.median(rates):12,.0f} tokens/s "
                      f"({len(rates)} steps, {time.time() - started:.0f} s)", file=sys.stderr, flush=True)
            base = results["AdamW"]["rates"][-1]
            for label in args.methods:
                results[label]["ratios"].append(results[label]["rates"][-1] / base)
                if label.endswith(IN_BACKWARD):
                    ordinary = results[label[:-len(IN_BACKWARD)]]["rates"][-1]
                    results[label].setdefault("ratios_to_ordinary", []).append(results[label]["rates"][-1] / ordinary)
    return results


def table(results: dict, args) -> str:
    lines = [f"{args.model}, batch {args.batch_size} x {args.seq_len} tokens (micro-batch {args.micro_batch_size}), "
             f"{args.steps} steps of which {args.warmup} warm-up, {args.rounds} rounds"
             + (f", overrides: {' '.join(args.overrides)}" if args.overrides else ""), "",
             "| method | tokens/s (median of rounds) | ratio to AdamW: median | ratio range | target |",
             "|---|---|---|---|---|"]
    for label, res in results.items():
        low, mid, high = min(res["ratios"]), statistics.median(res["ratios"]), max(res["ratios"])
        target = f">= {TARGET}: {'met' if mid >= TARGET else 'missed'}" if label.startswith("FRUGAL") else "-"
        if "ratios_to_ordinary" in res:
            own = res["ratios_to_ordinary"]
            ratio = statistics.median(own)
            target = (f"{ratio:.3f} ({min(own):.3f}-{max(own):.3f}) of the ordinary step, >= {IN_BACKWARD_TARGET}: "
                      f"{'met' if ratio >= IN_BACKWARD_TARGET else 'missed'}")
        lines.append(f"| {label} | {statistics.median(res['rates']):,.0f} | {mid:.3f} | {low:.3f}-{high:.3f} "
                     f"| {target} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_20m")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD",
                    help=f"from {', '.join(METHODS)} (AdamW is always run: the ratios need it)")
    ap.add_argument("--in-backward", action="store_true",
                    help="also run each FRUGAL method with the step inside backward (train.optimizer_in_backward=true)")
    ap.add_argument("--json", action="store_true", help="print the per-round figures as JSON instead of the table")
    args = ap.parse_args(argv)
    args.overrides = overrides
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}; use fewer warm-up steps")
    if "AdamW" not in args.methods:
        args.methods = ["AdamW", *args.methods]
    if args.in_backward:  # each FRUGAL method, then its run in backward (the same round compares them)
        args.methods = [m for label in args.methods
                        for m in ([label, label + IN_BACKWARD] if label.startswith("FRUGAL") else [label])]
    results = benchmark(args)
    print(json.dumps(results) if args.json else table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
