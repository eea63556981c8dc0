"""How the ordering of the CPU mini reproduction moves as tokens per parameter grow (docs/budget_study.md).

    nice -n 19 python -m bench.budget_study --corpus tinyshakespeare.txt \\
        --results docs/budget_study.json --plot docs/budget_study.png
    python -m bench.budget_study --corpus tinyshakespeare.txt --results docs/budget_study.json \\
        --plot docs/budget_study.png --report-only      # table and plot from what has run so far

The methods of scripts/mini_repro.py (and Muon, FRUGAL-Muon) on one small model at growing budgets
(--budgets) and seeds (--seeds), through train.py with mini_repro's run helpers, at one learning rate
(--lr) and a fixed number of subspace switches (--switches). Reports per budget each method's
validation loss (mean, seed range), the ordering and the rank correlations. Resumable: each finished
cell is appended to --results at once and skipped on a rerun; budgets run cheapest first;
--stop-after stops starting new cells.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from scripts import mini_repro

ROOT = Path(__file__).resolve().parent.parent

# key -> (configs/optimizer option, extra overrides, label)
METHODS = {
    "adamw": ("adamw", [], "AdamW"),
    "frugal_0.25": ("frugal", ["optimizer.density=0.25"], "FRUGAL 0.25"),
    "frugal_0.0": ("frugal_rho0", [], "FRUGAL 0.0"),
    "galore_0.25": ("galore", ["optimizer.density=0.25"], "GaLore 0.25"),
    "badam_0.25": ("badam", ["optimizer.density=0.25"], "BAdam 0.25"),
    "signsgd": ("signsgd", [], "signSGD"),
    "muon": ("muon", [], "Muon"),
    "frugal_muon_0.25": ("frugal_muon", ["optimizer.density=0.25"], "FRUGAL-Muon 0.25"),
}
# The paper's order of the methods it has (Table 2, 60M: AdamW 22.73 < FRUGAL 0.25 23.59 < FRUGAL 0.0
# 24.06 < BAdam 24.86 < GaLore 25.68; signSGD last: 33.22 at 130M, Table 16): the order a CPU table
# would have to show to say something about the paper's.
PAPER_ORDER = ["adamw", "frugal_0.25", "frugal_0.0", "badam_0.25", "galore_0.25", "signsgd"]
# The settings that determine a cell besides (method, budget, seed): part of its key in --results.
MODEL_SETTINGS = ("vocab", "hidden", "intermediate", "layers", "heads", "seq_len", "batch", "lr", "switches",
                  "val_stride", "eval_tokens", "evals")


def count_params(args) -> int:
    """Parameters of the LLaMA train.py builds for these settings (untied embeddings, RMSNorm, no bias)."""
    h, i, layers, v = args.hidden, args.intermediate, args.layers, args.vocab
    return 2 * v * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h


def steps_for(tokens_per_param: float, params: int, args) -> int:
    return max(1, round(tokens_per_param * params / (args.batch * args.seq_len)))


def cell_key(method: str, budget: float, seed: int, settings_digest: str) -> str:
    return f"{method}|tpp={budget:g}|seed={seed}|{settings_digest}"


def load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_result(path: Path, key: str, row: dict) -> None:
    """Add one cell to the results file atomically (a study stopped mid-write keeps the earlier cells)."""
    results = load_results(path)
    results[key] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _run_args(args, steps: int, seed: int):
    """The namespace mini_repro's run helpers read."""
    return argparse.Namespace(**{**vars(args), "steps": steps, "seed": seed, "force": False,
                                 "update_gap": max(1, round(steps / args.switches))})


def run_study(args) -> dict:
    text = mini_repro.read_text(args.corpus)
    corpus_sha256 = mini_repro.digest(text)
    tok_dir = mini_repro.train_tokenizer(text, args.workdir, args.vocab)
    settings = {k: getattr(args, k) for k in MODEL_SETTINGS}
    digest = mini_repro.digest({**settings, "corpus_sha256": corpus_sha256})[:10]
    params = count_params(args)
    started = time.time()
    for budget in args.budgets:
        steps = steps_for(budget, params, args)
        for seed in args.seeds:
            for method in args.methods:
                key = cell_key(method, budget, seed, digest)
                if key in load_results(args.results):
                    continue
                if args.stop_after is not None and time.time() - started > args.stop_after:
                    print(f"budget_study: --stop-after {args.stop_after:g} s reached; rerun to continue", flush=True)
                    return {"stopped": True, "digest": digest}
                opt, extra, _ = METHODS[method]
                ns = _run_args(args, steps, seed)
                run_dir = mini_repro.run_dir_for(method, opt, extra, args.lr, ns, corpus_sha256, tok_dir)
                if mini_repro._end_row(run_dir / "metrics.jsonl") is None:
                    # a cell stopped mid-run (the study was stopped) left checkpoints: it starts afresh
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                t0 = time.time()
                end = mini_repro.run(method, opt, extra, args.lr, ns, tok_dir, run_dir)
                save_result(args.results, key, {
                    "method": method, "tokens_per_param": budget, "seed": seed, "steps": steps,
                    "tokens": steps * args.batch * args.seq_len, "params": params,
                    "val_loss": end["val_loss"], "state_bytes": int(end["optimizer_state_bytes"]),
                    "seconds": round(time.time() - t0, 1), "settings": settings, "digest": digest})
    return {"stopped": False, "digest": digest}


# ---- the report ------------------------------------------------------------------------------
def spearman(a: list[str], b: list[str]) -> float:
    """Spearman's rank correlation of two orderings of the same items."""
    items = [x for x in a if x in b]
    n = len(items)
    if n < 2:
        return float("nan")
    ra = {x: i for i, x in enumerate(x for x in a if x in items)}
    rb = {x: i for i, x in enumerate(x for x in b if x in items)}
    d2 = sum((ra[x] - rb[x]) ** 2 for x in items)
    return 1.0 - 6.0 * d2 / (n * (n * n - 1))


def summarise(results: dict, digest: str | None = None) -> dict:
    """{budget: {method: {"mean", "min", "max", "seeds"}}} from the cells (of one settings digest)."""
    table: dict = {}
    for row in results.values():
        if digest is not None and row["digest"] != digest:
            continue
        cell = table.setdefault(row["tokens_per_param"], {}).setdefault(row["method"], [])
        cell.append(row["val_loss"])
    return {b: {m: {"mean": sum(v) / len(v), "min": min(v), "max": max(v), "seeds": len(v)}
                for m, v in sorted(ms.items())} for b, ms in sorted(table.items())}


def ordering(stats: dict) -> list[str]:
    return sorted(stats, key=lambda m: stats[m]["mean"])


def report(summary: dict, methods: list[str], min_seeds: int) -> str:
    """Markdown: method x budget (mean val loss, seed range); orderings and rank correlations of complete budgets."""
    if not summary:
        return "(no finished cells yet)"
    budgets = [b for b in summary if all(summary[b].get(m, {}).get("seeds", 0) >= min_seeds for m in methods)]
    partial = [b for b in summary if b not in budgets]
    cols = budgets + partial
    lines = ["| method | " + " | ".join(f"{b:g} tok/param" + ("" if b in budgets else " (partial)")
                                        for b in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for m in methods:
        cells = []
        for b in cols:
            s = summary[b].get(m)
            cells.append("-" if s is None else f"{s['mean']:.3f} ({s['min']:.3f}-{s['max']:.3f}, n={s['seeds']})")
        lines.append(f"| {METHODS[m][2]} | " + " | ".join(cells) + " |")
    out = ["\n".join(lines), ""]
    orders = {b: ordering({m: summary[b][m] for m in methods}) for b in budgets}
    for b in budgets:
        out.append(f"- {b:g} tokens/param: " + " < ".join(METHODS[m][2] for m in orders[b]))
    for b0, b1 in zip(budgets, budgets[1:]):
        out.append(f"- rank correlation (Spearman) {b0:g} -> {b1:g} tokens/param: "
                   f"{spearman(orders[b0], orders[b1]):.2f}")
    for b in budgets:
        paper = [m for m in PAPER_ORDER if m in methods]
        out.append(f"- {b:g} tokens/param, rank correlation with the paper's order of its {len(paper)} methods "
                   f"({' < '.join(METHODS[m][2] for m in paper)}): {spearman(orders[b], paper):.2f}")
    if budgets:
        last = budgets[-1]
        out += [f"- rank correlation of each budget's ordering with the largest complete one ({last:g}): "
                + ", ".join(f"{b:g}: {spearman(orders[b], orders[last]):.2f}" for b in budgets)]
    return "\n".join(out)


def plot(summary: dict, methods: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    markers = "osD^v<>xP*"
    for panel, ax in enumerate(axes):
        for i, m in enumerate(methods):
            pts = [(b, summary[b][m]) for b in summary if m in summary[b]]
            if panel == 1:  # the gap to AdamW's mean at the same budget: the ordering's movement
                pts = [(b, s) for b, s in pts if "adamw" in summary[b]]
            if not pts:
                continue
            ref = [summary[b]["adamw"]["mean"] if panel == 1 else 0.0 for b, _ in pts]
            xs = [b for b, _ in pts]
            mean = [s["mean"] - r for (_, s), r in zip(pts, ref)]
            lo = [s["mean"] - s["min"] for _, s in pts]
            hi = [s["max"] - s["mean"] for _, s in pts]
            ax.errorbar(xs, mean, yerr=[lo, hi], marker=markers[i % len(markers)], capsize=3,
                        label=f"{METHODS[m][2]}"
                        + ("" if all(s["seeds"] > 1 for _, s in pts) else " (1 seed at some budgets)"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per parameter (log scale)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (mean over seeds; bars: min-max)")
    axes[1].set_ylabel("validation loss - AdamW's mean at that budget")
    axes[1].axhline(0.0, color="black", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_list(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, type=Path, help="a text file or a directory of them")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "budget_study.json",
                    help="JSON of finished cells: read (finished cells are skipped) and appended to")
    ap.add_argument("--plot", type=Path, help="PNG: validation loss against tokens per parameter")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "budget_study")
    ap.add_argument("--budgets", default="0.5,1,2,4,8,16", help="tokens per parameter, cheapest first")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"a comma list of {', '.join(METHODS)}")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=88)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=3e-3, help="one learning rate for every method")
    ap.add_argument("--switches", type=int, default=12, help="subspace switches per run (update gap = steps / this)")
    ap.add_argument("--val-stride", type=int, default=20)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--evals", type=int, default=2, help="evaluations per run")
    ap.add_argument("--stop-after", type=float, default=None, help="seconds after which no new cell starts")
    ap.add_argument("--report-only", action="store_true", help="no training: table and plot from --results")
    args = ap.parse_args(argv)
    args.budgets = sorted(parse_list(args.budgets))
    args.seeds = parse_list(args.seeds, int)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"budget_study: unknown --methods {unknown}; valid choices: {', '.join(METHODS)}")
    if any(b <= 0 for b in args.budgets):
        raise SystemExit(f"budget_study: --budgets must be positive, got {args.budgets}")
    args.corpus = args.corpus.resolve()
    params = count_params(args)
    if args.report_only:
        text = mini_repro.read_text(args.corpus)
        settings = {k: getattr(args, k) for k in MODEL_SETTINGS}
        digest = mini_repro.digest({**settings, "corpus_sha256": mini_repro.digest(text)})[:10]
    else:
        digest = run_study(args)["digest"]
    summary = summarise(load_results(args.results), digest)
    print(f"model: LLaMA, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {params:,} parameters; "
          f"budgets (tokens/param -> steps): "
          + ", ".join(f"{b:g} -> {steps_for(b, params, args)}" for b in args.budgets))
    most = max((c["seeds"] for ms in summary.values() for c in ms.values()), default=0)
    print(report(summary, args.methods, max(len(args.seeds), most)))  # fewer seeds than elsewhere: partial
    if args.plot and summary:
        plot(summary, args.methods, args.plot,
             f"{args.corpus.name}: {params / 1e6:.2f}M-param LLaMA, lr {args.lr:g}, seeds {args.seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
