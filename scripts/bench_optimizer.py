"""Time `optimizer.step()` for FRUGAL, its baselines and torch's AdamW on LLaMA parameter sets.

The optimizer step is memory-bound, so each method is compared with two references measured in
the same process: torch's fused AdamW (the baseline to beat) and the method's own bandwidth floor,
the bytes it must move divided by the machine's in-place bandwidth (a large `a.add_(b)`):

    AdamW                     28 B/param   (read p, g, m, v; write p, m, v)
    signSGD                   12 B/param   (read p, g; write p)
    FRUGAL block              28 B per state-full element + 12 B per state-free element
    FRUGAL column / randk     the same + 24 B per state-full projectable element (gather p and g
                              into reduced tensors: 16 B; scatter the updated part back: 8 B);
                              the state-free update runs over the whole tensor (12 B per element)
    BAdam                     28 B per state-full element (frozen blocks cost nothing)
    GaLore                    not a bandwidth-bound method (matrix products, SVD): floor "-"

Gradients are fixed random tensors restored before each timed step (FRUGAL overwrites state-free
gradients in place), outside the timed region. GaLore's time is amortised over T=200 steps with
its SVD step included: (199 * ordinary step + 1 * step with SVD) / 200.

Usage (CPU, 2 threads; run on an otherwise idle machine for stable numbers):

    python scripts/bench_optimizer.py [--models llama_60m llama_130m] [--steps 20]
        [--only "frugal block 0.25" ...] [--compiled-sign]

`--compiled-sign` sets FRUGAL_COMPILED_SIGN=1: the state-free signSGD update runs as one
torch.compile'd pass instead of two eager passes (needs a C++ compiler; compiles on first use,
outside the timed steps thanks to the warm-up).

Optional glibc settings that stop per-step page faults of allocating code paths (both the
numbers with and without them are informative; say which you used):
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=100000000000 MALLOC_TOP_PAD_=1073741824
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import frugal  # noqa: E402

# (hidden, intermediate, layers); vocab 32000, untied embeddings (PAPER_NOTES.md)
SHAPES = {"llama_60m": (512, 1376, 8), "llama_130m": (768, 2048, 12)}
VOCAB = 32000


class _Norm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(h))


def llama_params(name: str) -> nn.Module:
    """A parameter-only stand-in with transformers' LLaMA names and shapes (no forward needed)."""
    h, f, layers = SHAPES[name]
    with torch.device("meta"):
        root = nn.Module()
        root.model = nn.Module()
        root.model.embed_tokens = nn.Embedding(VOCAB, h)
        root.model.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer.self_attn, proj, nn.Linear(h, h, bias=False))
            layer.mlp = nn.Module()
            layer.mlp.gate_proj = nn.Linear(h, f, bias=False)
            layer.mlp.up_proj = nn.Linear(h, f, bias=False)
            layer.mlp.down_proj = nn.Linear(f, h, bias=False)
            layer.input_layernorm = _Norm(h)
            layer.post_attention_layernorm = _Norm(h)
            root.model.layers.append(layer)
        root.model.norm = _Norm(h)
        root.lm_head = nn.Linear(h, VOCAB, bias=False)
    root = root.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    for p in root.parameters():
        p.data.normal_(0, 0.02, generator=gen)
        p.grad = torch.randn(p.shape, generator=gen)
    return root


def bandwidth(n: int = 1 << 26, reps: int = 15) -> float:
    """In-place bandwidth in bytes/s: `a.add_(b)` reads a and b and writes a (12 bytes/element).
    Best of `reps` (as STREAM reports): on a shared machine the median mostly measures the other
    jobs, and a floor should be what the machine can do. Measured again before each model."""
    a, b = torch.ones(n), torch.ones(n)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        a.add_(b, alpha=1e-9)
        times.append(time.perf_counter() - t0)
    return 12 * n / min(times[2:])


def time_steps(model, optimizer, steps: int, warmup: int = 3) -> float:
    """Median seconds of `optimizer.step()` over `steps` timed steps, gradients restored before each."""
    params = [p for p in model.parameters()]
    masters = [p.grad.clone() for p in params]
    grads = [p.grad for p in params]
    times = []
    for i in range(warmup + steps):
        torch._foreach_copy_(grads, masters)
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    del masters
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


METHODS = [
    # label, build(model) -> optimizer, floor kind
    ("adamw fused", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, fused=True), "plain"),
    ("adamw foreach", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, foreach=True), "plain"),
    ("frugal block 0.25", lambda m: frugal.build_optimizer(m, "frugal", density=0.25), "plain"),
    ("frugal block 0.0", lambda m: frugal.build_optimizer(m, "frugal", density=0.0), "plain"),
    ("frugal column 0.25", lambda m: frugal.build_optimizer(m, "frugal", density=0.25, projection="column"), "coordinate"),
    ("frugal randk 0.25", lambda m: frugal.build_optimizer(m, "frugal", density=0.25, projection="randk"), "coordinate"),
    ("badam 0.25", lambda m: frugal.build_optimizer(m, "badam", density=0.25), "plain"),
    ("signsgd", lambda m: frugal.build_optimizer(m, "signsgd"), "plain"),
    ("galore 0.25 (T=200)", None, "galore"),
]


def bench_galore(model, steps: int, gap: int = 200) -> float:
    """Amortised GaLore step: ordinary steps timed with T=200, SVD steps timed with T=1."""
    ordinary = time_steps(model, frugal.build_optimizer(model, "galore", density=0.25, update_gap=gap), steps)
    model_state_reset(model)
    with_svd = time_steps(model, frugal.build_optimizer(model, "galore", density=0.25, update_gap=1), 2, warmup=1)
    return ((gap - 1) * ordinary + with_svd) / gap


def model_state_reset(model):
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.02, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="labels of methods to run (default: all)")
    parser.add_argument("--compiled-sign", action="store_true",
                        help="opt-in single-pass signSGD kernel via torch.compile (FRUGAL_COMPILED_SIGN=1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compiled_sign:
        os.environ["FRUGAL_COMPILED_SIGN"] = "1"
    bw = bandwidth()
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"torch {torch.__version__}, {args.threads} threads, in-place bandwidth {bw / 1e9:.1f} GB/s"
          + (f", {malloc}" if malloc else ", default malloc settings")
          + (", compiled sign update (FRUGAL_COMPILED_SIGN=1)" if frugal.rules._compiled_sign_enabled()
             else ", eager sign update"))
    # Other processes compete for the same cores and memory bus: print the load so a reader can
    # judge how much to trust the absolute numbers (ratios within one run are more robust).
    print("load average (1, 5, 15 min) at start: %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count()))
    for model_name in args.models:
        model = llama_params(model_name)
        n = sum(p.numel() for p in model.parameters())
        bw = bandwidth()
        print(f"\n{model_name}: {n / 1e6:.2f}M parameters, median of {args.steps} steps, "
              f"in-place bandwidth {bw / 1e9:.1f} GB/s")
        print(f"| method | ms/step | x fused AdamW | floor ms | x floor |")
        print(f"|---|---|---|---|---|")
        base = None
        for label, build, kind in METHODS:
            if args.only and label not in args.only and label != "adamw fused":
                continue
            model_state_reset(model)
            if kind == "galore":
                seconds, floor = bench_galore(model, args.steps), None
            else:
                optimizer = build(model)
                seconds = time_steps(model, optimizer, args.steps)
                floor = floor_bytes(kind, counts(model, optimizer))
                del optimizer
            base = seconds if base is None else base
            floor_ms = "-" if floor is None else f"{floor / bw * 1e3:.1f}"
            x_floor = "-" if floor is None else f"{seconds / (floor / bw):.2f}"
            print(f"| {label} | {seconds * 1e3:.1f} | {seconds / base:.2f} | {floor_ms} | {x_floor} |",
                  flush=True)
    print("\nload average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
