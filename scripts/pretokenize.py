"""Tokenize a data source once into memory-mapped token files, so sweeps skip tokenization.

    python scripts/pretokenize.py --data c4 --model llama_60m --out tokens/c4_t5 \
        data.path=/datasets/c4 --train-tokens 2000000000

    # then train on them:
    python train.py data=tokens data.path=tokens/c4_t5

Positional ``key=value`` arguments override the data config (``data.path=...``, ``data.tokenizer=...``)
or the model config (``model.tokenizer=...``). The model config supplies the tokenizer
(``${model.tokenizer}``) and the vocabulary the ids must fit (T5 sentinels are mapped to unk).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from data.tokens import pretokenize  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(kind: str, name: str):
    path = name if name.endswith(".yaml") else os.path.join(ROOT, "configs", kind, f"{name}.yaml")
    if not os.path.isfile(path):
        choices = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", kind)) if f.endswith(".yaml"))
        raise SystemExit(f"unknown {kind} config {name!r}; valid choices: {choices}")
    return OmegaConf.load(path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="c4", help="configs/data/<name>.yaml or a yaml file")
    ap.add_argument("--model", default="llama_60m", help="configs/model/<name>.yaml (tokenizer, vocab)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--train-tokens", type=int, default=None, help="stop after this many (default: one epoch)")
    ap.add_argument("--val-tokens", type=int, default=10_000_000)
    ap.add_argument("--max-doc-tokens", type=int, default=None, help="truncate documents (default: keep all)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"])
    ap.add_argument("overrides", nargs="*", help="data.KEY=VALUE or model.KEY=VALUE")
    args = ap.parse_args(argv)

    cfg = OmegaConf.create({"model": _config("model", args.model), "data": _config("data", args.data)})
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args.overrides))
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    t0 = time.time()
    meta = pretokenize(data_cfg, args.out, model_vocab_size=int(cfg.model.vocab_size),
                       train_tokens=args.train_tokens, val_tokens=args.val_tokens, dtype=args.dtype,
                       max_doc_tokens=args.max_doc_tokens)
    took = time.time() - t0
    n = sum(s["tokens"] for s in meta["splits"].values())
    print(json.dumps(meta["splits"]), f"{n} tokens in {took:.1f}s ({n / max(took, 1e-9):,.0f} tokens/s)")
    return meta


if __name__ == "__main__":
    main()
