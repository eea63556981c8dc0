"""Figure 3 of the paper (Appendix C, fig:reproj_toy): GaLore-like SGDM with and without re-projection
of the momentum when the projection changes, on the toy problem min ||W||^2, W in R^{10x10}.

    python -m scripts.figure3_reprojection --out docs/figure3_reprojection.png \\
        --json docs/figure3_reprojection.json

Every `--update-gap` steps the projection becomes the gradient's top-r right singular vectors; "keep"
reads the old momentum coordinates in the new basis (GaLore), "reproject" moves them into it and keeps
their norm (Flora's Algorithm 2 plus the paper's rescale). Mean and std of log10(loss) over `--runs`
initialisations shared by both variants. docs/figures.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from frugal import subspace as sub

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = ("keep", "reproject")
LABELS = {"keep": "GaLore-like SGDM (state kept)", "reproject": "with momentum re-projection"}


def run_toy(rank: int, reproject: bool, seed: int, *, steps: int = 200, update_gap: int = 10,
            lr: float = 0.05, momentum: float = 0.9, size: int = 10) -> list[float]:
    """Loss ||W||^2 before each step and after the last (steps + 1 values), float64."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(size, size, generator=gen, dtype=torch.float64)
    m = q = None
    losses = [float(w.square().sum())]
    for t in range(steps):
        g = 2.0 * w
        if t % update_gap == 0:
            q_new = sub.top_singular_basis(g, rank, "right")
            if m is None:
                m = torch.zeros(size, rank, dtype=torch.float64)
            elif reproject:
                m = sub.reproject_momentum(m, sub.change_of_basis(q, q_new, "right"), "right",
                                           preserve_norm=True)
            q = q_new
        m.lerp_(sub.reduce(g, q, "right"), 1.0 - momentum)
        w.sub_(sub.lift(m, q, "right"), alpha=lr)
        losses.append(float(w.square().sum()))
    return losses


def compute(ranks=(3, 6), runs: int = 5, **kw) -> dict:
    """{"curves": {rank: {variant: {"mean": [...], "std": [...]}}}, "settings": ...}: mean and std
    of log10(||W||^2) over the runs at every step."""
    out: dict = {"settings": {"ranks": list(ranks), "runs": runs, **kw}, "curves": {}}
    for r in ranks:
        out["curves"][str(r)] = {}
        for variant in VARIANTS:
            runs_ = torch.tensor([run_toy(r, variant == "reproject", seed, **kw) for seed in range(runs)])
            runs_ = runs_.clamp_min(1e-300).log10()
            out["curves"][str(r)][variant] = {"mean": runs_.mean(0).tolist(), "std": runs_.std(0).tolist()}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = result["settings"]["ranks"]
    fig, axes = plt.subplots(1, len(ranks), figsize=(5.2 * len(ranks), 3.8), squeeze=False)
    for ax, r in zip(axes[0], ranks):
        for variant, color in zip(VARIANTS, ("tab:red", "tab:blue")):
            c = result["curves"][str(r)][variant]
            mean, std = torch.tensor(c["mean"]), torch.tensor(c["std"])
            x = range(len(mean))
            ax.plot(x, 10 ** mean, color=color, label=LABELS[variant])
            ax.fill_between(x, 10 ** (mean - std), 10 ** (mean + std), color=color, alpha=0.2)
        ax.set_yscale("log")
        ax.set_title(f"rank {r}, T = {result['settings'].get('update_gap', 10)}")
        ax.set_xlabel("step")
        ax.set_ylabel(r"$\|W\|^2$ (geometric mean $\pm$ std)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[3, 6])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--update-gap", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=Path("figure3_reprojection.png"))
    ap.add_argument("--json", type=Path, default=None, help="also write the curves as JSON")
    args = ap.parse_args(argv)
    for name in ("runs", "steps", "update_gap"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.momentum < 1:
        ap.error(f"--momentum must be in [0, 1), got {args.momentum}")
    for r in args.ranks:
        if not 1 <= r <= 10:
            ap.error(f"--ranks: {r} is not a rank of a 10 x 10 matrix (valid: 1..10)")
    result = compute(tuple(args.ranks), args.runs, steps=args.steps, update_gap=args.update_gap,
                     lr=args.lr, momentum=args.momentum)
    plot(result, args.out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result))
    for r in args.ranks:
        final = {v: 10 ** result["curves"][str(r)][v]["mean"][-1] for v in VARIANTS}
        print(f"rank {r}: final ||W||^2 (geometric mean of {args.runs} runs) keep {final['keep']:.3e}, "
              f"reproject {final['reproject']:.3e}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
