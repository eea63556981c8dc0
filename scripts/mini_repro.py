"""A CPU-sized reproduction of Table 2: AdamW, FRUGAL 0.25, FRUGAL 0.0, GaLore 0.25, BAdam 0.25, signSGD.

    python -m scripts.mini_repro --corpus input.txt                # results in runs/mini_repro/
    python -m scripts.mini_repro --corpus input.txt --extras all   # + the optional rows

The corpus: any text file or directory of them; the documented figures (docs/measurements.md,
docs/mini_repro.md) use tinyshakespeare, not shipped (tests/assets/tinyshakespeare_slice.txt is a slice):

    curl -O https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt

It trains a sentencepiece unigram tokenizer on the corpus (T5's id layout), runs train.py once per
method (a subprocess: the real loop, data and optimizers) on a small LLaMA, tunes AdamW's learning rate
on --lr-grid and reuses the best for every method (the paper's Appendix A.1), then prints the mini
Table 2 beside the paper's 60M column and writes --out JSON ({key: val_loss, val_ppl, state_bytes}),
--md and --plot (default: in --workdir). --extras adds optional rows (Tables 9 and 17's methods,
apollo, adam_mini, muon, frugal_muon; a row whose package is missing is skipped with a note).

Why these defaults: an 8k vocabulary stays near the unigram stage in a CPU budget and byte-level text
hides Table 4's finding; 1024 pieces, hidden 128 and 4 layers keep embeddings + output layer at ~25% of
~1.1M parameters and see ~0.5M tokens per run. The update gap is scaled to the run (T=20: 12 switches in
240 steps); fp32, since CPU bf16 autocast is ~3x slower. A finished run in --workdir is reused only when
the corpus (SHA-256), tokenizer and every setting match (hashed into its directory name, compared with
its settings.json); --force redoes everything (e.g. after changing the code).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from scripts.paper_tables import TABLE2, TABLE9, TABLE17
from train_utils.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent

# key -> (configs/optimizer option, extra overrides, label, Table 2 row)
METHODS = {
    "adamw": ("adamw", [], "AdamW", "AdamW"),
    "frugal_0.25": ("frugal", ["optimizer.density=0.25"], "FRUGAL, rho=0.25", "FRUGAL, rho=0.25"),
    "frugal_0.0": ("frugal_rho0", [], "FRUGAL, rho=0.0", "FRUGAL, rho=0.0"),
    "galore_0.25": ("galore", ["optimizer.density=0.25"], "GaLore, rho=0.25", "GaLore, rho=0.25"),
    "badam_0.25": ("badam", ["optimizer.density=0.25"], "BAdam, rho=0.25", "BAdam, rho=0.25"),
    "signsgd": ("signsgd", [], "signSGD", None),
}
PAPER_SIGNSGD_130M = 33.22  # Table 16, "signSGD only" (130M); Table 2 has no signSGD row
# Optional rows: key -> (configs/optimizer option, extra overrides, label, the paper's number and where).
EXTRAS = {
    "fira": ("fira", [], "Fira, rho=0.25", f"({TABLE17['Fira, rho=0.25']['130M']:.2f} at 130M, Table 17)"),
    "ldadam": ("ldadam", [], "LDAdam, rho=0.25", f"({TABLE17['LDAdam, rho=0.25']['130M']:.2f} at 130M, Table 17)"),
    "adamem": ("adamem", [], "AdaMeM, rho=0.25", f"{TABLE9['AdaMeM, rho=0.25']['60M']:.2f} (Table 9)"),
    "apollo": ("apollo", [], "APOLLO", "-"),
    "adam_mini": ("adam_mini", [], "Adam-mini", "-"),
    # beyond the paper: Muon (its lr convention "match_rms_adamw" lets it run at AdamW's rate; docs/muon.md)
    "muon": ("muon", [], "Muon", "-"),
    "frugal_muon": ("frugal_muon", ["optimizer.density=0.25"], "FRUGAL-Muon, rho=0.25", "-"),
}
# Options whose subspace is refreshed every update_gap steps: the gap is scaled with the run.
GAP_OPTIONS = ("frugal", "frugal_rho0", "galore", "badam", "fira", "adamem", "apollo", "frugal_muon")


def missing_package(key: str) -> str | None:
    """The pip package an optional row needs and lacks (None when it can run)."""
    import importlib.util

    from frugal import external

    if key not in external.PACKAGES:
        return None
    module, pip_name, _ = external.PACKAGES[key]
    return None if importlib.util.find_spec(module) else pip_name


def parse_extras(text: str) -> list[str]:
    keys = list(EXTRAS) if text.strip() == "all" else [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in EXTRAS]
    if unknown:
        raise SystemExit(f"mini_repro: unknown --extras {unknown}; valid choices: all, {', '.join(EXTRAS)}")
    return keys


TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def read_text(corpus: Path) -> str:
    files = [corpus] if corpus.is_file() else sorted(p for p in corpus.rglob("*") if p.is_file()
                                                   and p.suffix in (".txt", ".md", ".text"))
    if not files:
        raise SystemExit(f"mini_repro: no text files at {corpus}. The documented run uses tinyshakespeare: "
                         f"curl -O {TINYSHAKESPEARE_URL}, then --corpus input.txt")
    return "\n\n".join(f.read_text(errors="replace") for f in files)


# How the tokenizer is trained (part of its cache key): unigram model, T5's id layout.
TOKENIZER_SETTINGS = dict(model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
                          hard_vocab_limit=False, input_sentence_size=2_000_000, shuffle_input_sentence=True)
SETTINGS_FILE = "settings.json"


def digest(value) -> str:
    """SHA-256 of text, or of a JSON-able value in a canonical form."""
    data = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()


def cached_dir(parent: Path, label: str, settings: dict) -> Path:
    """`parent/<label>-<hash of settings>` holding settings.json: the cache entry for exactly these settings
    (one whose settings.json disagrees is refused)."""
    path = parent / f"{label}-{digest(settings)[:12]}"
    saved = path / SETTINGS_FILE
    if saved.exists() and json.loads(saved.read_text()) != json.loads(json.dumps(settings)):
        raise SystemExit(f"mini_repro: {path} holds a run of other settings ({saved}); delete it or use --force")
    path.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return path


def train_tokenizer(text: str, workdir: Path, vocab: int, force: bool = False) -> Path:
    """A sentencepiece unigram model in T5's id layout, cached by corpus content and vocabulary."""
    import sentencepiece as spm

    out_dir = cached_dir(workdir / "tokenizers", f"v{vocab}",
                         {"corpus_sha256": digest(text), "vocab": vocab, **TOKENIZER_SETTINGS})
    if (out_dir / "spiece.model").exists() and not force:
        return out_dir
    sample = out_dir / "train.txt"
    sample.write_text(text)
    spm.SentencePieceTrainer.train(input=str(sample), model_prefix=str(out_dir / "spiece"), vocab_size=vocab,
                                   minloglevel=2, **TOKENIZER_SETTINGS)
    sample.unlink()
    return out_dir


def unigram_loss(text: str, tok_dir: Path) -> float:
    """Entropy of the corpus' own token frequencies (nats/token): the loss of the 'unigram stage'."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "spiece.model"))
    counts = Counter()
    for doc in re.split(r"\n\s*\n", text):
        if doc.strip():
            counts.update(sp.encode(doc) + [1])
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


# The command-line settings that change what a run trains (everything but output paths and --force).
RUN_SETTINGS = ("vocab", "hidden", "intermediate", "layers", "heads", "seq_len", "batch", "steps", "update_gap",
                "val_stride", "eval_tokens", "evals", "seed")


def run_dir_for(key: str, opt: str, extra: list[str], lr: float, args, corpus_sha256: str, tok_dir: Path) -> Path:
    settings = {"method": key, "optimizer": opt, "overrides": extra, "lr": lr, "corpus_sha256": corpus_sha256,
                "tokenizer": tok_dir.name, **{k: getattr(args, k) for k in RUN_SETTINGS}}
    return cached_dir(args.workdir / "runs", f"{key}-lr{lr:g}", settings)


def overrides_for(opt: str, extra: list[str], lr: float, args, tok_dir: Path, run_dir: Path) -> list[str]:
    """The train.py command line of one run."""
    overrides = [
        "model=llama_tiny", "model.name=llama_mini", f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.intermediate}", f"model.num_hidden_layers={args.layers}",
        f"model.num_attention_heads={args.heads}", f"model.vocab_size={args.vocab}",
        f"model.max_position_embeddings={args.seq_len}",
        "data=local", f"data.path={args.corpus}", f"data.tokenizer={tok_dir}", f"data.seq_len={args.seq_len}",
        "data.packing=true", f"data.val_stride={args.val_stride}",
        f"optimizer={opt}", f"optimizer.lr={lr}", *extra,
        f"train.steps={args.steps}", f"train.batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
        f"train.eval_every={max(1, args.steps // args.evals)}", f"train.eval_tokens={args.eval_tokens}",
        "train.precision=fp32", "train.log_every=1", f"train.seed={args.seed}", "train.resume=never",
        "train.plot=false", "train.progress_bar=false", "checkpoint.every=0", "checkpoint.keep=1",
        "wandb.mode=disabled", f"hydra.run.dir={run_dir}",
    ]
    if opt in GAP_OPTIONS:
        overrides.append(f"optimizer.update_gap={args.update_gap}")
    return overrides


def run(key: str, opt: str, extra: list[str], lr: float, args, tok_dir: Path, run_dir: Path) -> dict:
    """One train.py run in `run_dir` (from run_dir_for); returns its end row."""
    metrics = run_dir / "metrics.jsonl"
    end = _end_row(metrics)
    if end is None or args.force:
        overrides = overrides_for(opt, extra, lr, args, tok_dir, run_dir)
        metrics.unlink(missing_ok=True)
        env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        t0 = time.time()
        proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"mini_repro: run {key} (lr {lr}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        end = _end_row(metrics)
        end["seconds_wall"] = time.time() - t0
        print(f"  {key:12s} lr={lr:<8g} val_loss={end['val_loss']:.4f} ppl={end['val_ppl']:.2f} "
              f"state={end['optimizer_state_bytes'] / 1024:.0f} KiB ({end['seconds_wall']:.0f} s)", flush=True)
    return end


def _end_row(metrics: Path) -> dict | None:
    if not metrics.exists():
        return None
    return next((r for r in reversed(read_metrics(str(metrics))) if r.get("event") == "end"), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, type=Path, help="a text file or a directory of them")
    ap.add_argument("--out", type=Path, help="JSON results (default: <workdir>/results.json)")
    ap.add_argument("--md", type=Path, help="markdown report with the command (default: <workdir>/mini_repro.md)")
    ap.add_argument("--plot", type=Path, help="PNG of the runs' curves (default: <workdir>/mini_repro.png)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "mini_repro")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=352)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--update-gap", type=int, default=20)
    ap.add_argument("--lr-grid", default="1e-3,3e-3,1e-2", help="AdamW learning rates to try")
    ap.add_argument("--val-stride", type=int, default=20, help="every k-th document is held out")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--evals", type=int, default=6, help="evaluations per run (for the curves)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="retrain the tokenizer and rerun every run, even if cached")
    ap.add_argument("--extras", default="", help=f"optional rows: a comma list of {', '.join(EXTRAS)}, or all")
    args = ap.parse_args(argv)
    args.workdir = args.workdir.resolve()  # the runs start in the repository, not in this directory
    args.out = args.out or args.workdir / "results.json"  # never into the tracked docs/ unless asked
    args.md = args.md or args.workdir / "mini_repro.md"
    args.plot = args.plot or args.workdir / "mini_repro.png"
    extras = parse_extras(args.extras)
    args.corpus = args.corpus.resolve()
    started = time.time()

    text = read_text(args.corpus)
    corpus_sha256 = digest(text)
    tok_dir = train_tokenizer(text, args.workdir, args.vocab, force=args.force)
    unigram = unigram_loss(text, tok_dir)
    print(f"corpus {args.corpus.name}: {len(text):,} chars; tokenizer {args.vocab} pieces; unigram-stage loss "
          f"{unigram:.3f} nats (ppl {math.exp(unigram):.1f})", flush=True)

    grid = [float(x) for x in args.lr_grid.split(",")]
    print(f"AdamW learning-rate grid {grid}:", flush=True)
    grid_dirs = {lr: run_dir_for("adamw", "adamw", [], lr, args, corpus_sha256, tok_dir) for lr in grid}
    grid_results = {lr: run("adamw", "adamw", [], lr, args, tok_dir, grid_dirs[lr]) for lr in grid}
    best_lr = min(grid, key=lambda lr: grid_results[lr]["val_loss"])
    print(f"best AdamW lr {best_lr:g}; reused for every method", flush=True)

    results, run_dirs, skipped = {}, {}, {}
    for key, (opt, extra, *_) in [*METHODS.items(), *((k, EXTRAS[k]) for k in extras)]:
        package = missing_package(key) if key in extras else None
        if package:
            skipped[key] = f"skipped: the {package} package is not installed (pip install {package})"
            print(f"  {key:12s} {skipped[key]}", flush=True)
            continue
        if key == "adamw":
            end, run_dirs[key] = grid_results[best_lr], grid_dirs[best_lr]
        else:
            run_dirs[key] = run_dir_for(key, opt, extra, best_lr, args, corpus_sha256, tok_dir)
            end = run(key, opt, extra, best_lr, args, tok_dir, run_dirs[key])
        results[key] = {"val_loss": end["val_loss"], "val_ppl": end["val_ppl"],
                        "state_bytes": int(end["optimizer_state_bytes"])}

    params = read_metrics(str(run_dirs["adamw"] / "metrics.jsonl"))[0].get("params")
    emb_share = 2 * args.vocab * args.hidden / params if params else float("nan")
    tokens = args.steps * args.batch * args.seq_len
    adam_state = results["adamw"]["state_bytes"]
    lines = [
        "| method | val loss | val ppl | optimizer state | vs AdamW | paper 60M ppl (Table 2) |",
        "|---|---|---|---|---|---|",
    ]
    rows = [(key, label, f"{TABLE2[paper_row]['60M']:.2f}" if paper_row else
             f"({PAPER_SIGNSGD_130M:.2f} at 130M, Table 16)") for key, (_, _, label, paper_row) in METHODS.items()]
    rows += [(key, EXTRAS[key][2], EXTRAS[key][3]) for key in extras]
    for key, label, paper_txt in rows:
        if key in skipped:
            lines.append(f"| {label} | {skipped[key]} | | | | {paper_txt} |")
            continue
        r = results[key]
        lines.append(f"| {label} | {r['val_loss']:.4f} | {r['val_ppl']:.2f} | {r['state_bytes'] / 1024:,.0f} KiB | "
                     f"{r['state_bytes'] / adam_state:.0%} | {paper_txt} |")
    table = "\n".join(lines)
    labels = {key: label for key, label, _ in rows}
    order = " < ".join(labels[k] for k in sorted(results, key=lambda k: results[k]["val_loss"]))
    summary = (f"model: LLaMA, {args.layers} layers, hidden {args.hidden}, {params:,} parameters "
               f"(embeddings + output layer {emb_share:.0%}); vocabulary {args.vocab} "
               "(sentencepiece, trained on the corpus)\n"
               f"budget: {args.steps} steps x {args.batch} x {args.seq_len} tokens = {tokens:,} tokens per run; "
               f"update gap T={args.update_gap}; AdamW lr grid {grid} -> {best_lr:g}, reused for all\n"
               f"unigram-stage loss {unigram:.3f} nats; measured order (val loss): {order}\n"
               f"total time {time.time() - started:.0f} s")
    print("\n" + table + "\n\n" + summary)
    print(f"results: {args.out}, {args.md}, {args.plot}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    from scripts.plot_runs import plot

    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot([run_dirs[k] for k in results], str(args.plot), smooth_window=10,
         title=f"mini Table 2 on {args.corpus.name}: {params / 1e6:.1f}M-param LLaMA, {tokens / 1e6:.2f}M tokens")
    args.md.parent.mkdir(parents=True, exist_ok=True)
    # absolute paths (the corpus) are shown by file name only: machine paths do not belong in docs
    cmd = "python -m scripts.mini_repro " + " ".join(
        os.path.basename(a) if a.startswith("/") else a for a in (argv or sys.argv[1:]))
    args.md.write_text(
        f"# Mini reproduction of Table 2 (CPU)\n\nMade with:\n\n    {cmd}\n\n{table}\n\n"
        + "\n".join(f"- {s}" for s in summary.splitlines()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
