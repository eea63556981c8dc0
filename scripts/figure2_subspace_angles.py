"""Figure 2 of the paper: principal angles between the top-r SVD subspaces of one weight's gradient at
different iterations, against two random semi-orthogonal projections.

`record` saves one weight's gradient at chosen iterations, from a short run of its own or from a
train.py run's checkpoints (a fixed validation batch at each checkpoint's weights); `plot` draws the
histograms from that file. What is plotted and what it shows: docs/figures.md.

    python -m scripts.figure2_subspace_angles record --out grads.pt --steps 400 --every 100
    python -m scripts.figure2_subspace_angles record --out grads.pt --checkpoints runs/x/checkpoints/step_*
    python -m scripts.figure2_subspace_angles plot grads.pt --out docs/figure2_subspace_angles.png

The gradient file is `torch.save`d dict {"name": weight name, "steps": [t0, t1, ...],
"grads": float32 tensor (K, m, n), "source": "run" | "checkpoints"}.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from frugal import subspace as sub

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_WEIGHT = "model.layers.1.self_attn.k_proj.weight"


# ----------------------------------------------------------------------------------- the math
def svd_basis(grad: torch.Tensor, rank: int) -> torch.Tensor:
    side = "right" if grad.shape[0] >= grad.shape[1] else "left"
    return sub.top_singular_basis(grad.double(), rank, side)


def principal_cosines(q1: torch.Tensor, q2: torch.Tensor) -> torch.Tensor:
    """Cosines of the principal angles between the column spans of two orthonormal bases."""
    return torch.linalg.svdvals(q1.t() @ q2).clamp(0.0, 1.0)


def random_basis(s: int, r: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(s, r, generator=gen, dtype=torch.float64)).Q


def wachter_edge(rank: int, side: int) -> float:
    """Largest cosine two random rank-r subspaces of R^side have in the large-size limit."""
    c = rank / side
    return math.sqrt(min(1.0, 4 * c * (1 - c)))


def histograms(record: dict, rank: int | None = None, density: float = 0.25,
               pairs: list[tuple[int, int]] | None = None, seed: int = 0) -> dict:
    """Cosines for each pair of recorded iterations (indices into record["steps"]) and for two random
    bases. Default pairs: an anchor (the second recording of three or more: the first is the random
    initialisation's) against the next recording, the middle one and the last."""
    grads, steps = record["grads"], list(record["steps"])
    if len(steps) < 2:
        raise ValueError(f"need gradients from at least 2 iterations, the file has {len(steps)}")
    s = min(grads.shape[1], grads.shape[2])
    rank = rank or max(1, round(density * s))
    if not 1 <= rank <= s:
        raise ValueError(f"rank {rank} is not in [1, {s}] for a {tuple(grads.shape[1:])} weight")
    if pairs is None:
        k = len(steps)
        a = 1 if k >= 3 else 0
        pairs = [(a, j) for j in sorted({a + 1, (a + k) // 2, k - 1} - {a})]
    bases = {}
    out = {"rank": rank, "side": s, "edge": wachter_edge(rank, s), "pairs": []}
    for i, j in pairs:
        for idx in (i, j):
            if not 0 <= idx < len(steps):
                raise ValueError(f"pair index {idx} is outside the {len(steps)} recorded iterations")
            if idx not in bases:
                bases[idx] = svd_basis(grads[idx], rank)
        out["pairs"].append({"steps": (steps[i], steps[j]), "cos": principal_cosines(bases[i], bases[j])})
    out["random"] = principal_cosines(random_basis(s, rank, seed), random_basis(s, rank, seed + 1))
    return out


# ------------------------------------------------------------------------------------ recording
def _load_yaml(group: str, name: str):
    from omegaconf import OmegaConf

    path = Path(name) if name.endswith(".yaml") else ROOT / "configs" / group / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in (ROOT / "configs" / group).glob("*.yaml"))
        raise SystemExit(f"figure2: no {group} config {name!r}; valid choices: {choices} or a .yaml path")
    return OmegaConf.load(path)


def _weight(model, name: str) -> torch.nn.Parameter:
    params = dict(model.named_parameters())
    if name not in params:
        two_d = [n for n, p in params.items() if p.dim() == 2]
        raise SystemExit(f"figure2: the model has no weight {name!r}; 2-D weights: {two_d[:12]} ...")
    return params[name]


def record_run(weight: str, steps: int, every: int, *, model: str = "llama_tiny",
               data: str = "synthetic", optimizer: str = "adamw", lr: float = 1e-3,
               batch: int = 8, seq_len: int = 64, seed: int = 0) -> dict:
    """Train `model` for `steps` steps and keep `weight`'s gradient at steps 0, every, 2*every, ..."""
    import data as data_pkg
    import frugal
    import models

    torch.manual_seed(seed)
    dcfg = _load_yaml("data", data)
    dcfg.seq_len = seq_len
    mcfg = _load_yaml("model", model)
    dm = data_pkg.build_data(dcfg, micro_batch_size=batch, seed=seed, model_vocab_size=mcfg.vocab_size,
                             max_positions=mcfg.get("max_position_embeddings"))
    net = models.build_model(mcfg, vocab_size=dm.vocab_size)
    target = _weight(net, weight)
    opt = frugal.build_optimizer(net, optimizer, lr=lr)
    kept, grads = [], []
    batches = dm.train_batches()
    for t in range(steps + 1):
        b = next(batches)
        opt.zero_grad(set_to_none=True)
        net(input_ids=b["input_ids"], labels=b["labels"]).loss.backward()
        if t % every == 0:
            kept.append(t)
            grads.append(target.grad.detach().float().clone())
        if t < steps:
            opt.step()
    return {"name": weight, "steps": kept, "grads": torch.stack(grads), "source": "run"}


def record_checkpoints(weight: str, checkpoints: list[str], batch: int = 8) -> dict:
    """The gradient of one fixed validation batch at each checkpoint's weights."""
    import data as data_pkg
    import models
    from omegaconf import OmegaConf
    from train_utils import checkpoint as ckpt

    kept, grads, fixed = [], [], None
    for path in sorted(checkpoints, key=lambda p: int(ckpt.load(p, "trainer")["step"])):
        cfg = OmegaConf.load(Path(path) / "config.yaml")
        dm = data_pkg.build_data(cfg.data, micro_batch_size=batch, model_vocab_size=cfg.model.vocab_size)
        net = models.build_model(cfg.model, vocab_size=dm.vocab_size)
        net.load_state_dict(ckpt.load(path, "model"))
        if fixed is None:
            fixed = dm.val_batches(batch * int(cfg.data.seq_len))[0]
        target = _weight(net, weight)
        net(input_ids=fixed["input_ids"], labels=fixed["labels"]).loss.backward()
        kept.append(int(ckpt.load(path, "trainer")["step"]))
        grads.append(target.grad.detach().float().clone())
    if not grads:
        raise SystemExit("figure2: no checkpoints given")
    return {"name": weight, "steps": kept, "grads": torch.stack(grads), "source": "checkpoints"}


# -------------------------------------------------------------------------------------- drawing
def plot(result: dict, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"SVD: step {p['steps'][0]} vs {p['steps'][1]}", p["cos"]) for p in result["pairs"]]
    panels.append(("random R vs R'", result["random"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.0), sharey=True)
    bins = torch.linspace(0, 1, 26).tolist()
    for ax, (label, cos) in zip(axes, panels):
        ax.hist(cos.numpy(), bins=bins, color="tab:gray" if label.startswith("random") else "tab:blue")
        ax.axvline(result["edge"], color="tab:red", lw=1, ls="--")
        ax.set_title(f"{label}\n{int((cos > 0.9).sum())} of {cos.numel()} cosines > 0.9", fontsize=9)
        ax.set_xlabel("cosine of principal angle")
    axes[0].set_ylabel("count")
    fig.suptitle(title or f"rank {result['rank']} of {result['side']}; dashed: random-subspace edge",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pairs(text: list[str] | None):
    if not text:
        return None
    try:
        return [tuple(int(x) for x in p.split(":")) for p in text]
    except ValueError:
        raise SystemExit(f"figure2: --pairs takes index pairs like 0:1 0:3, got {text}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cmd = ap.add_subparsers(dest="cmd", required=True)
    rec = cmd.add_parser("record", help="save a weight's gradient at several iterations")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--weight", default=DEFAULT_WEIGHT)
    rec.add_argument("--checkpoints", nargs="+", help="checkpoint directories of a train.py run")
    rec.add_argument("--steps", type=int, default=400)
    rec.add_argument("--every", type=int, default=100)
    rec.add_argument("--model", default="llama_tiny")
    rec.add_argument("--data", default="synthetic")
    rec.add_argument("--optimizer", default="adamw")
    rec.add_argument("--lr", type=float, default=1e-3)
    rec.add_argument("--batch", type=int, default=8)
    rec.add_argument("--seq-len", type=int, default=64)
    rec.add_argument("--seed", type=int, default=0)
    pl = cmd.add_parser("plot", help="draw the histograms from a gradient file")
    pl.add_argument("grads", type=Path)
    pl.add_argument("--out", type=Path, required=True)
    pl.add_argument("--rank", type=int, default=None, help="default: round(density * min(m, n))")
    pl.add_argument("--density", type=float, default=0.25)
    pl.add_argument("--pairs", nargs="+", help="index pairs into the recorded steps, e.g. 0:1 0:3")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        if args.checkpoints:
            result = record_checkpoints(args.weight, args.checkpoints, args.batch)
        else:
            if args.steps < 1 or not 1 <= args.every <= args.steps:
                ap.error(f"need --steps >= 1 and 1 <= --every <= --steps, got {args.steps}, {args.every}")
            result = record_run(args.weight, args.steps, args.every, model=args.model, data=args.data,
                                optimizer=args.optimizer, lr=args.lr, batch=args.batch,
                                seq_len=args.seq_len, seed=args.seed)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, args.out)
        print(f"wrote {args.out}: {result['name']} {tuple(result['grads'].shape[1:])} at steps {result['steps']}")
        return result
    if not args.grads.exists():
        raise SystemExit(f"figure2: no gradient file {args.grads} (make one with the record command)")
    record = torch.load(args.grads, weights_only=True)
    try:
        result = histograms(record, rank=args.rank, density=args.density, pairs=_pairs(args.pairs))
    except ValueError as exc:
        raise SystemExit(f"figure2: {exc}") from None
    plot(result, args.out, title=f"{record['name']}: rank {result['rank']} of {result['side']}")
    for p in result["pairs"]:
        print(f"steps {p['steps']}: {int((p['cos'] > 0.9).sum())} cosines > 0.9, mean {float(p['cos'].mean()):.3f}")
    print(f"random: {int((result['random'] > 0.9).sum())} cosines > 0.9, max {float(result['random'].max()):.3f} "
          f"(limit {result['edge']:.3f})")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
