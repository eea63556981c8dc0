"""Time `optimizer.step()` for FRUGAL, its baselines and torch's AdamW on LLaMA parameter sets.

    python -m bench.optimizer [--models llama_60m llama_130m] [--rounds 5] [--steps 5]
        [--only "frugal block 0.25" ...] [--sign-update auto|compiled|eager] [--count-ops]

Each method is compared with torch's fused AdamW (timed in rounds, the median per-round ratio) and with
its bandwidth floor (the bytes it must move over the in-place bandwidth of a large `a.add_(b)`); GaLore
is amortised over T=200 with its SVD step. `--count-ops` counts the aten operations of one step on
llama_1b's layout (on a GPU each is a kernel launch). The method, the floors and the runs of record:
docs/benchmarks.md. Optional glibc settings that stop per-step page faults (say which you used):
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=100000000000 MALLOC_TOP_PAD_=1073741824
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import frugal

# (hidden, intermediate, layers); vocab 32000, untied embeddings (the paper's Appendix D shapes)
SHAPES = {"llama_60m": (512, 1376, 8), "llama_130m": (768, 2048, 12), "llama_1b": (2048, 5461, 24)}
VOCAB = 32000


class _Norm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(h))


def llama_params(name: str, shrink: int = 1) -> nn.Module:
    """A parameter-only stand-in with transformers' LLaMA names and shapes; `shrink` divides every width."""
    h, f, layers = SHAPES[name]
    h, f, vocab = h // shrink, f // shrink, VOCAB // shrink
    with torch.device("meta"):
        root = nn.Module()
        root.model = nn.Module()
        root.model.embed_tokens = nn.Embedding(vocab, h)
        root.model.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer.self_attn, proj, nn.Linear(h, h, bias=False))
            layer.mlp = nn.Module()
            for proj, (n_in, n_out) in (("gate_proj", (h, f)), ("up_proj", (h, f)), ("down_proj", (f, h))):
                setattr(layer.mlp, proj, nn.Linear(n_in, n_out, bias=False))
            layer.input_layernorm = _Norm(h)
            layer.post_attention_layernorm = _Norm(h)
            root.model.layers.append(layer)
        root.model.norm = _Norm(h)
        root.lm_head = nn.Linear(h, vocab, bias=False)
    root = root.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    for p in root.parameters():
        p.data.normal_(0, 0.02, generator=gen)
        p.grad = torch.randn(p.shape, generator=gen)
    return root


def bandwidth(n: int = 1 << 26, reps: int = 15) -> float:
    """In-place bandwidth in bytes/s of `a.add_(b)` (12 bytes/element), best of `reps` (as STREAM)."""
    a, b = torch.ones(n), torch.ones(n)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        a.add_(b, alpha=1e-9)
        times.append(time.perf_counter() - t0)
    return 12 * n / min(times[2:])


def time_steps(optimizer, steps: int, warmup: int = 1) -> float:
    """Median seconds of `optimizer.step()` over `steps` timed steps."""
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def counts(model, optimizer) -> dict:
    """Elements by role in the current window: state-full, state-free, projected state-full."""
    n_full = n_free = n_proj_full = 0
    if not isinstance(optimizer, frugal.FRUGAL):
        return {"full": sum(p.numel() for p in model.parameters()), "free": 0, "proj_full": 0}
    active = set(optimizer.active_blocks() or [])
    for g in optimizer.param_groups:
        for p in g["params"]:
            if g["always_state_free"]:
                n_free += p.numel() if g["state_free"] != "none" else 0
            elif not g["projectable"]:
                n_full += p.numel()
            elif g["projection"] == "block":
                if g["block"] in active:
                    n_full += p.numel()
                elif g["state_free"] != "none":
                    n_free += p.numel()
            else:
                k = optimizer.state[p]["exp_avg"].numel()
                n_full += k
                n_proj_full += k
                n_free += p.numel() if g["state_free"] != "none" else 0
    return {"full": n_full, "free": n_free, "proj_full": n_proj_full}


def floor_bytes(kind: str, c: dict) -> float | None:
    if kind == "galore":
        return None
    return 28 * c["full"] + 12 * c["free"] + (24 * c["proj_full"] if kind == "coordinate" else 0)


def methods(sign_update: str) -> list:
    """(label, build(model) -> optimizer, floor kind)."""
    def build(name, **hp):
        if "sign_update" in frugal.registry.accepted_keys(name):
            hp["sign_update"] = sign_update
        return lambda m: frugal.build_optimizer(m, name, **hp)
    return [
        ("adamw fused", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, fused=True), "plain"),
        ("adamw foreach", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, foreach=True),
         "plain"),
        ("frugal block 0.25", build("frugal", density=0.25), "plain"),
        ("frugal block 0.0", build("frugal", density=0.0), "plain"),
        ("frugal column 0.25", build("frugal", density=0.25, projection="column"), "coordinate"),
        ("frugal randk 0.25", build("frugal", density=0.25, projection="randk"), "coordinate"),
        ("badam 0.25", build("badam", density=0.25), "plain"),
        ("signsgd", build("signsgd"), "plain"),
        ("galore 0.25 (T=200)", None, "galore"),
    ]


def bench_galore(model, steps: int, sign_update: str, gap: int = 200) -> float:
    """Amortised GaLore step: ordinary steps timed with T=200, SVD steps timed with T=1."""
    kw = dict(density=0.25, sign_update=sign_update)
    ordinary = time_steps(frugal.build_optimizer(model, "galore", update_gap=gap, **kw), steps)
    with_svd = time_steps(frugal.build_optimizer(model, "galore", update_gap=1, **kw), 2)
    return ((gap - 1) * ordinary + with_svd) / gap


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and not name.startswith("_record_function"):  # kernels only
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops() -> None:
    """Kernel-launching aten operations (views excluded) per step on llama_1b's layout."""
    model = llama_params("llama_1b", shrink=64)
    print("\nllama_1b layout (24 layers x 7 weights; widths / 64): kernels per step (2nd step)")
    print("| method | eager ops | with the compiled sign update | of which gathers/scatters |")
    print("|---|---|---|---|")
    for label, hp in [("adamw (torch, fused)", None), ("frugal block 0.25", {}),
                      ("frugal block 0.0", {"density": 0.0}), ("frugal column 0.25", {"projection": "column"}),
                      ("frugal randk 0.25", {"projection": "randk"})]:
        if hp is None:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        else:
            opt = frugal.build_optimizer(model, "frugal", sign_update="eager", **hp)
        opt.step()
        with _CountOps() as counter:
            opt.step()
        moves = sum(n for op, n in counter.ops.items() if op in ("index_select", "scatter_", "index_copy_"))
        total = sum(counter.ops.values())
        print(f"| {label} | {total} | {total - counter.ops['sign']} | {moves} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama_60m", "llama_130m"],
                        choices=["llama_60m", "llama_130m"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="labels of methods to run (default: all)")
    parser.add_argument("--sign-update", default="auto", choices=frugal.kernels.SIGN_UPDATES)
    parser.add_argument("--count-ops", action="store_true", help="also count ops on llama_1b's layout")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"torch {torch.__version__}, {args.threads} threads, sign_update={args.sign_update}"
          + (f", {malloc}" if malloc else ", default malloc settings"))
    # the load tells how far to trust the absolute numbers (ratios within one run are more robust)
    print("load average (1, 5, 15 min) at start: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count()))
    for model_name in args.models:
        model = llama_params(model_name)
        n = sum(p.numel() for p in model.parameters())
        chosen = [m for m in methods(args.sign_update)
                  if not args.only or m[0] in args.only or m[0] == "adamw fused"]
        built = [(label, build(model), kind) for label, build, kind in chosen if kind != "galore"]
        times = {label: [] for label, _, _ in built}
        for _ in range(args.rounds):
            for label, optimizer, _ in built:
                times[label].append(time_steps(optimizer, args.steps))
        bw = bandwidth()
        print(f"\n{model_name}: {n / 1e6:.2f}M parameters, {args.rounds} rounds x {args.steps} steps, "
              f"in-place bandwidth {bw / 1e9:.1f} GB/s (best of 15)")
        print("| method | ms/step | x fused AdamW | (quartiles over rounds) | best / best AdamW | floor ms | x floor |")
        print("|---|---|---|---|---|---|---|")
        base = times["adamw fused"]
        for label, optimizer, kind in built:
            ms = statistics.median(times[label])
            ratios = [t / b for t, b in zip(times[label], base)]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            floor = floor_bytes(kind, counts(model, optimizer)) / bw
            best = min(times[label]) / min(base)
            print(f"| {label} | {ms * 1e3:.1f} | {statistics.median(ratios):.2f} | {q1:.2f}-{q3:.2f} | "
                  f"{best:.2f} | {floor * 1e3:.1f} | {ms / floor:.2f} |", flush=True)
        del built
        if any(kind == "galore" for _, _, kind in chosen):
            adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            base_s = time_steps(adamw, args.steps)
            seconds = bench_galore(model, args.steps, args.sign_update)
            print(f"| galore 0.25 (T=200) | {seconds * 1e3:.1f} | {seconds / base_s:.2f} | - | - | - | - |")
    if args.count_ops:
        count_ops()
    print("\nload average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
