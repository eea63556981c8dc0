"""Data pipeline throughput per DataLoader worker, and the workers each paper model needs on an A100.

    python -m bench.data [--docs 4000] [--tokenizer DIR] [--train-steps 0]

Rates are batch positions per second (pads included) of one worker with one logical reader, per CPU
second and per wall second, for C4-format streaming (truncate-and-pad and packed), pretokenized files
(rows and documents layouts) and the synthetic corpus, on a generated C4-like shard; without network a
sentencepiece unigram model with T5's id layout is trained on it (``--tokenizer``: a local t5-base).
Workers per A100 rank: ``--safety`` x the positions/s the GPU consumes at ``--mfu`` (PaLM's FLOPs per
position) / one worker's rate, rounded up to a power of two. ``--readers-memory``: the resident memory
of 64 C4 readers in one process. Method and runs of record: docs/data_pipeline.md, docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import yaml

from data import build_data
from data.token_files import pretokenize
from models import build_model, count_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = re.findall(r"[A-Za-z']+", open(os.path.join(ROOT, "tests", "assets", "tinyshakespeare_slice.txt")).read())
PAPER_MODELS = ("llama_60m", "llama_130m", "llama_350m", "llama_1b", "llama_3b", "gpt2_124m")
A100_BF16 = 312e12  # dense bf16 tensor-core peak, FLOP/s (NVIDIA A100 datasheet)
SEQ_LEN = 256


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
    for name, n, seed in (("c4-train.00000-of-01024.json.gz", n_docs, 0),
                          ("c4-validation.00000-of-00008.json.gz", max(50, n_docs // 20), 1)):
        with gzip.open(os.path.join(root, "en", name), "wt") as f:
            for i, text in enumerate(c4_like_docs(n, seed)):
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"u{i}"}) + "\n")
    return root


def make_tokenizer(root: str, shard_root: str) -> str:
    import sentencepiece as spm

    corpus = os.path.join(root, "corpus.txt")
    with gzip.open(os.path.join(shard_root, "en", "c4-train.00000-of-01024.json.gz"), "rt") as f, \
            open(corpus, "w") as out:
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


def rate(dm, n_batches: int, warmup: int = 0) -> tuple[float, float, float]:
    """(positions per wall second, per CPU second of this process, non-pad share) over n_batches."""
    it = dm.train_batches()
    for _ in range(warmup):
        next(it)
    real = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n_batches):
        b = next(it)
        real += int((b["labels"] != -100).sum())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    total = n_batches * b["input_ids"].numel()
    return total / wall, total / cpu, real / total


def flops_per_token(name: str) -> tuple[float, int]:
    """Training FLOPs per position (PaLM's formula) and total parameters of a model config."""
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "model", f"{name}.yaml")))
    with torch.device("meta"):
        counts = count_parameters(build_model(cfg))
    matmul = counts["linear_in_blocks"] + cfg["hidden_size"] * cfg["vocab_size"]  # + the output head
    attention = 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * SEQ_LEN
    return 6 * matmul + attention, counts["total"]


def cpu_train_rate(batch: int, steps: int) -> tuple[float, float]:
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "model", "llama_60m.yaml")))
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 32000, (batch, SEQ_LEN))
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
    return batch * SEQ_LEN / step, step


def readers_memory(shard: str, tok: str, readers: int = 64) -> tuple[float, float]:
    """RSS (MB) of one process before and after each of `readers` C4 readers opened its own shard."""
    import psutil

    links = os.path.join(os.path.dirname(shard), "many")
    os.makedirs(os.path.join(links, "en"), exist_ok=True)
    src = os.path.join(shard, "en", "c4-train.00000-of-01024.json.gz")
    for i in range(readers):  # one file per reader: gcd(files, readers) = readers
        os.symlink(src, os.path.join(links, "en", f"c4-train.{i:05d}-of-01024.json.gz"))
    os.symlink(os.path.join(shard, "en", "c4-validation.00000-of-00008.json.gz"),
               os.path.join(links, "en", "c4-validation.00000-of-00008.json.gz"))
    cfg = {"name": "c4", "path": links, "tokenizer": tok, "seq_len": SEQ_LEN, "readers": readers}
    dm = build_data(cfg, micro_batch_size=8, model_vocab_size=32000)
    it = dm.train_batches()
    next(it)
    before = psutil.Process().memory_info().rss / 1e6
    for _ in range(readers - 1):
        next(it)
    return before, psutil.Process().memory_info().rss / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4000, help="documents in the generated train shard")
    ap.add_argument("--tokenizer", default=None, help="a local tokenizer dir (default: train one here)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mfu", type=float, default=0.5, help="the A100's assumed model FLOPs utilisation")
    ap.add_argument("--safety", type=float, default=2.0, help="workers = safety x the GPU's rate / one worker's")
    ap.add_argument("--train-steps", type=int, default=0, help="also time llama_60m fwd+bwd on this CPU")
    ap.add_argument("--readers-memory", action="store_true", help="also measure the RSS of 64 C4 readers")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shard = make_shard(os.path.join(tmp, "c4"), args.docs)
        tok = args.tokenizer or make_tokenizer(tmp, shard)
        c4 = {"name": "c4", "path": shard, "tokenizer": tok, "seq_len": SEQ_LEN, "packing": False, "readers": 1}
        # One whole epoch from a cold start: documents are tokenized in chunks as windows are read.
        n_stream = args.docs // args.batch - 1
        rows.append(("c4-local streaming + tokenize, truncate-and-pad",
                     *rate(build_data(c4, micro_batch_size=args.batch, model_vocab_size=32000), n_stream)))
        stream_rate = rows[-1][2]
        rows.append(("c4-local streaming + tokenize, packing",
                     *rate(build_data(dict(c4, packing=True), micro_batch_size=args.batch, model_vocab_size=32000),
                           n_stream // 2)))
        t0 = time.perf_counter()
        meta = pretokenize(c4, os.path.join(tmp, "rows"), train_rows=args.docs, val_tokens=100_000,
                           model_vocab_size=32000)
        pre = meta["splits"]["train"]["docs"] / (time.perf_counter() - t0)
        pretokenize(dict(c4, packing=True), os.path.join(tmp, "docs"), train_rows=10**9, val_tokens=100_000,
                    model_vocab_size=32000)
        tcfg = {"name": "tokens", "seq_len": SEQ_LEN, "readers": 1}
        for name, cfg, n in (("tokens, rows layout (memmap)", dict(tcfg, path=os.path.join(tmp, "rows")), 2000),
                             ("tokens, documents layout, packing (memmap)",
                              dict(tcfg, path=os.path.join(tmp, "docs"), packing=True), 2000),
                             ("synthetic (Markov language)", {"name": "synthetic", "seq_len": SEQ_LEN, "readers": 1},
                              300)):
            rows.append((name, *rate(build_data(cfg, micro_batch_size=args.batch), n, 2)))
        memory = readers_memory(shard, tok) if args.readers_memory else None

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(f"machine: {cores} CPU cores, load average {load[0]:.1f} (SHARED with other jobs: +-30% or worse); "
          f"torch {torch.__version__}; tokenizer: "
          f"{'given' if args.tokenizer else 'sentencepiece unigram 8000, T5 ids, trained here'}; "
          f"batch {args.batch} x {SEQ_LEN}")
    print(f"pretokenize (rows layout) wrote {pre:,.0f} documents/s\n")
    print("| path (one worker, one reader) | positions per CPU second | positions per wall second | non-pad share |")
    print("|---|---|---|---|")
    for name, wall, cpu, share in rows:
        print(f"| {name} | {cpu:,.0f} | {wall:,.0f} | {share:.2f} |")
    if args.train_steps:
        train, step = cpu_train_rate(args.batch, args.train_steps)
        print(f"| (llama_60m fwd+bwd, bf16 autocast, on this CPU: {step:.2f} s/step) | | {train:,.0f} | |")
    print(f"\nWorkers per A100 rank for C4 streaming (truncate-and-pad): MFU {args.mfu}, "
          f"{A100_BF16 / 1e12:.0f} TFLOP/s bf16, one worker {stream_rate:,.0f} positions per CPU second, "
          f"safety x{args.safety}\n")
    print("| model | parameters | training GFLOP/position | A100 positions/s | workers (x safety) | num_workers |")
    print("|---|---|---|---|---|---|")
    for name in PAPER_MODELS:
        flops, params = flops_per_token(name)
        need = args.mfu * A100_BF16 / flops
        exact = args.safety * need / stream_rate
        print(f"| {name} | {params / 1e6:,.1f}M | {flops / 1e9:.3f} | {need:,.0f} | {exact:.2f} | "
              f"{2 ** max(0, math.ceil(math.log2(exact))) if exact > 1 else 1} |")
    if memory:
        before, after = memory
        print(f"\n64 C4 readers in one process (each with its own open shard): RSS {before:,.0f} MB after the first "
              f"reader's batch, {after:,.0f} MB after all 64 ({(after - before) / 63:.1f} MB per reader)")


if __name__ == "__main__":
    main()
