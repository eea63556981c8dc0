"""Data pipeline throughput beside what a llama_60m training step consumes, on this machine.

    python scripts/bench_data.py [--docs 4000] [--tokenizer DIR] [--train-steps 3]

Paths measured (tokens = batch positions B x seq_len delivered, pads included, because that is what a
training step consumes; the non-pad share is printed too):

* c4-local streaming: a local C4-format shard generated here (``en/c4-train.00000-of-01024.json.gz``,
  documents of C4-like length), read through ``datasets`` streaming, shuffled and tokenized on the fly,
  with 0 DataLoader workers (= the rate of one worker) ;
* tokens: the same shard pre-tokenized by ``data.tokens.pretokenize`` and read from the memory map;
* synthetic: the Markov language generated on the fly.

Without network the T5 tokenizer cannot be downloaded, so by default a sentencepiece unigram model
with T5's id layout is trained on the generated text (8000 pieces); pass ``--tokenizer`` a local
t5-base directory to measure the real one (sentencepiece speed depends little on vocabulary size).

Training consumption: forward+backward of llama_60m on B x 256 tokens with bf16 autocast on this CPU.
The A100 line is an estimate: tokens/s = 0.4 (MFU) x 312e12 bf16 FLOP/s / (6 x params) FLOP/token,
and "workers needed" = that rate / the one-worker streaming rate (tokenization is per-worker work).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

from data import build_data  # noqa: E402
from data.tokens import pretokenize  # noqa: E402
from models import build_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = re.findall(r"[A-Za-z']+", open(os.path.join(ROOT, "tests", "assets", "tinyshakespeare_slice.txt")).read())


def c4_like_docs(n: int, seed: int = 0) -> list[str]:
    """Documents with a C4-like length distribution (median ~250 words, long tail; mean ~400)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        words = max(20, int(rng.lognormvariate(5.5, 0.8)))
        out, k = [], 0
        while k < words:
            m = rng.randint(4, 20)
            s = " ".join(rng.choice(WORDS) for _ in range(m))
            out.append(s[0].upper() + s[1:] + ".")
            k += m
        docs.append(" ".join(out))
    return docs


def make_shard(root: str, n_docs: int) -> str:
    os.makedirs(os.path.join(root, "en"), exist_ok=True)
    for split, name, n, seed in (("train", "c4-train.00000-of-01024.json.gz", n_docs, 0),
                                 ("validation", "c4-validation.00000-of-00008.json.gz", max(50, n_docs // 20), 1)):
        with gzip.open(os.path.join(root, "en", name), "wt") as f:
            for i, text in enumerate(c4_like_docs(n, seed)):
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"u{i}"}) + "\n")
    return root


def make_tokenizer(root: str, shard_root: str) -> str:
    import sentencepiece as spm

    corpus = os.path.join(root, "corpus.txt")
    with gzip.open(os.path.join(shard_root, "en", "c4-train.00000-of-01024.json.gz"), "rt") as f, open(corpus, "w") as out:
        for i, line in enumerate(f):
            if i >= 800:
                break
            out.write(json.loads(line)["text"] + "\n")
    tok_dir = os.path.join(root, "tok")
    os.makedirs(tok_dir, exist_ok=True)
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(tok_dir, "spiece"), vocab_size=8000,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   hard_vocab_limit=False, minloglevel=2)
    return tok_dir


def rate(dm, n_batches: int, warmup: int = 2) -> tuple[float, float]:
    """(batch tokens/s, share of non-pad tokens) over n_batches after warmup."""
    it = dm.train_batches()
    for _ in range(warmup):
        next(it)
    real = 0
    t0 = time.perf_counter()
    for _ in range(n_batches):
        b = next(it)
        real += int((b["labels"] != -100).sum())
    dt = time.perf_counter() - t0
    total = n_batches * b["input_ids"].numel()
    return total / dt, real / total


def train_rate(batch: int, steps: int) -> tuple[float, float, int]:
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "model", "llama_60m.yaml")))
    torch.manual_seed(0)
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 32000, (batch, 256))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first step pays one-off allocation costs
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    return batch * 256 / step, step, params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4000, help="documents in the generated train shard")
    ap.add_argument("--tokenizer", default=None, help="a local tokenizer dir (default: train one here)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    with tempfile.TemporaryDirectory() as tmp:
        shard = make_shard(os.path.join(tmp, "c4"), args.docs)
        tok = args.tokenizer or make_tokenizer(tmp, shard)
        c4 = {"name": "c4", "path": shard, "tokenizer": tok, "seq_len": 256, "packing": False, "num_workers": 0}
        # One whole epoch from a cold start: tokenization happens per window of 1024 documents, so a
        # shorter measurement would time batches already tokenized by the first next().
        n_stream = args.docs // args.batch - 1
        rows = []
        r, share = rate(build_data(c4, micro_batch_size=args.batch, model_vocab_size=32000), n_stream, 0)
        rows.append(("c4-local streaming + tokenize (1 worker)", r, share))
        r, share = rate(build_data(dict(c4, packing=True), micro_batch_size=args.batch, model_vocab_size=32000),
                        n_stream // 2, 0)
        rows.append(("c4-local streaming + tokenize, packing (1 worker)", r, share))
        t0 = time.perf_counter()
        meta = pretokenize(c4, os.path.join(tmp, "tokens"), model_vocab_size=32000, val_tokens=100_000)
        pre = meta["splits"]["train"]["tokens"] / (time.perf_counter() - t0)
        tcfg = {"name": "tokens", "path": os.path.join(tmp, "tokens"), "seq_len": 256, "packing": False}
        r, share = rate(build_data(tcfg, micro_batch_size=args.batch), 2000)
        rows.append(("tokens (pre-tokenized memmap)", r, share))
        r, share = rate(build_data(dict(tcfg, packing=True), micro_batch_size=args.batch), 2000)
        rows.append(("tokens (pre-tokenized memmap), packing", r, share))
        r, share = rate(build_data({"name": "synthetic", "seq_len": 256}, micro_batch_size=args.batch), 300)
        rows.append(("synthetic (Markov language)", r, share))

    train, step, params = train_rate(args.batch, args.train_steps)
    a100 = 0.4 * 312e12 / (6 * params)
    stream = rows[0][1]
    print(f"machine: {os.cpu_count()} CPU cores, SHARED with other jobs while measuring (+-30% or worse); "
          f"torch {torch.__version__}; tokenizer: {'given' if args.tokenizer else 'sentencepiece unigram 8000, T5 ids, trained here'}")
    print(f"pretokenize (write) rate: {pre:,.0f} tokens/s of document tokens")
    print()
    print("| path | tokens/s (B x 256 positions) | non-pad share | x llama_60m CPU step | workers for A100 (est.) |")
    print("|---|---|---|---|---|")
    for name, r, share in rows:
        print(f"| {name} | {r:,.0f} | {share:.2f} | {r / train:,.0f}x | {max(1, -(-a100 // r)):.0f} |")
    print(f"| llama_60m fwd+bwd, bf16 autocast, {args.batch}x256 on this CPU ({step:.2f} s/step) | {train:,.0f} | | 1x | |")
    print(f"| llama_60m on an A100 (estimate: 40% of 312 TFLOP/s, 6 x {params / 1e6:.1f}M FLOP/token) | {a100:,.0f} | | | |")


if __name__ == "__main__":
    main()
