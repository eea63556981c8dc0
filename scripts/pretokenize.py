"""Tokenize a data source once into memory-mapped token files, so sweeps skip tokenization.

    # what one paper run of llama_130m reads: 200,000 steps x 512 rows, and 10M scored validation tokens
    python -m scripts.pretokenize --data c4 --model llama_130m --out tokens/c4_t5_130m data.path=/datasets/c4

    # then train on them:
    python train.py experiment=table2 model=llama_130m data=tokens data.path=tokens/c4_t5_130m

Sizes are counted as a run consumes them, after truncation (docs/data_pipeline.md); the defaults are
the paper's (configs/setup/paper.yaml). Positional ``key=value`` arguments override the data config
(``data.path=...``) or the model config, which supplies the tokenizer and the vocabulary the ids must fit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from omegaconf import OmegaConf

from data.token_files import LAYOUTS, pretokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "configs", "setup", "paper.yaml")


def _config(kind: str, name: str):
    path = name if name.endswith(".yaml") else os.path.join(ROOT, "configs", kind, f"{name}.yaml")
    if not os.path.isfile(path):
        choices = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", kind)) if f.endswith(".yaml"))
        raise SystemExit(f"unknown {kind} config {name!r}; valid choices: {choices}")
    return OmegaConf.load(path)


def paper_settings(model: str, need_steps: bool) -> dict:
    """The paper's steps (per model), global batch and validation tokens, from the presets' config."""
    if not os.path.isfile(PAPER):
        raise SystemExit(f"{PAPER} not found: pass --steps (or --train-rows), --batch-size and --val-tokens")
    paper = OmegaConf.load(PAPER)
    steps = paper.paper.steps
    if need_steps and model not in steps:
        raise SystemExit(f"--model {model!r} has no paper step count in {os.path.relpath(PAPER, ROOT)} "
                         f"(models: {sorted(steps)}); pass --steps or --train-rows")
    return {"steps": int(steps[model]) if model in steps else None, "batch_size": int(paper.train.batch_size),
            "val_tokens": int(paper.train.eval_tokens)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="c4", help="configs/data/<name>.yaml or a yaml file")
    ap.add_argument("--model", default="llama_60m", help="configs/model/<name>.yaml (tokenizer, vocab; paper steps)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of the run (default: the paper's)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per step (default: the paper's 512)")
    ap.add_argument("--train-rows", type=int, default=None, help="rows to write (default: steps x batch size)")
    ap.add_argument("--val-tokens", type=int, default=None, help="scored validation tokens (default: the paper's 10M)")
    ap.add_argument("--layout", default="auto", choices=LAYOUTS,
                    help="rows (truncate-and-pad rows as read) | documents | auto: rows unless the config packs")
    ap.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"])
    ap.add_argument("overrides", nargs="*", help="data.KEY=VALUE or model.KEY=VALUE")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options

    cfg = OmegaConf.create({"model": _config("model", args.model), "data": _config("data", args.data)})
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args.overrides))
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    paper = paper_settings(str(cfg.model.name), need_steps=args.train_rows is None and args.steps is None)
    steps = args.steps if args.steps is not None else paper.get("steps")
    batch = args.batch_size if args.batch_size is not None else paper.get("batch_size")
    rows = args.train_rows if args.train_rows is not None else steps * batch
    val_tokens = args.val_tokens if args.val_tokens is not None else paper["val_tokens"]
    print(f"writing {rows:,} training rows ({steps:,} steps x {batch} rows)" if args.train_rows is None
          else f"writing {rows:,} training rows", f"and {val_tokens:,} scored validation tokens to {args.out}")
    t0 = time.time()
    meta = pretokenize(data_cfg, args.out, train_rows=rows, val_tokens=val_tokens,
                       model_vocab_size=int(cfg.model.vocab_size), layout=args.layout, dtype=args.dtype)
    took = time.time() - t0
    n = sum(s["tokens"] for s in meta["splits"].values())
    print(json.dumps({"layout": meta["layout"], "splits": meta["splits"]}))
    print(f"{n:,} tokens in {took:.1f}s ({n / max(took, 1e-9):,.0f} tokens/s)")
    train = meta["splits"]["train"]
    if train["rows"] < rows:
        print(f"note: the source holds {train['rows']:,} training rows in one epoch, fewer than {rows:,}: a run "
              f"of that length repeats them {rows / max(train['rows'], 1):.2f} times (logged as epoch events)")
    message = short_validation_warning(meta["splits"].get("validation", {}).get("scored_tokens"), val_tokens)
    if message:
        print(message, file=sys.stderr)
    return meta


def short_validation_warning(scored: int | None, wanted: int) -> str | None:
    """A warning when the source's validation split came out shorter than asked for (a paper preset,
    train.require_eval_tokens=true, would then stop before training)."""
    if scored is None or scored >= wanted:
        return None
    return (f"warning: the validation split holds {scored:,} scored tokens, fewer than the {wanted:,} asked for "
            f"(--val-tokens): the source's validation data ran out. A run with train.eval_tokens={wanted} and "
            f"train.require_eval_tokens=true (the paper presets) stops before training; give the source more "
            f"validation data, or run with train.eval_tokens={scored} train.require_eval_tokens=false")


if __name__ == "__main__":
    main()
