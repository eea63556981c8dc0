"""Validation perplexity and training loss of any set of runs, against steps and against tokens (PNG).

    python -m scripts.plot_runs multirun/2025-01-01/12-00-00 --out table15.png
    python -m scripts.plot_runs runs/a runs/b --out cmp.png --smooth 50 --logy

Runs are found by train_utils.results (as for make_tables.py). Each curve is labelled by the values of
the keys the runs differ in (`density=0.25 update_gap=200 seed=1`; without any, by method, rho and T);
what every run shares is the title unless --title gives one.
"""
from __future__ import annotations

import sys
from pathlib import Path

from scripts.paper_tables import method
from train_utils.metrics import read_metrics
from train_utils.naming import short_labels
from train_utils.results import asked_value, load_run, load_runs, runs_argument_parser, swept_keys


def label(run: dict, swept: list[str], with_model: bool) -> str:
    """`density=0.25 update_gap=200 seed=1`: the run's values of the swept keys it has (one trained other
    than asked says both: `update_gap=19 (asked 200)`); without any swept key, the method with rho and T."""
    short, values = short_labels(swept), []
    for key in swept:
        value, asked = asked_value(run, key)
        if value is not None:
            values.append(f"{short[key]}={value}" + (f" (asked {asked})" if asked is not None else ""))
    return " ".join(values) if values else describe(run, with_model)


def describe(run: dict, with_model: bool) -> str:
    """"FRUGAL, rho=0.25, T=200" from the run's config (the model first, where the runs differ in it)."""
    opt = run["cfg"].get("optimizer", {})
    text = method(opt)
    if opt.get("name") in ("frugal", "galore", "badam") and "update_gap" in opt:
        text += f", T={opt['update_gap']}"
    return f"{run['model']}: {text}" if with_model else text


def labels(runs: list[dict]) -> list[str]:
    """One legend entry per run, in the runs' order; runs that would look alike get their directory."""
    swept = swept_keys(runs)
    with_model = len({r["model"] for r in runs}) > 1
    names = [label(r, swept, with_model) for r in runs]
    return [f"{n} ({_short_dir(r['dir'])})" if names.count(n) > 1 else n for n, r in zip(names, runs)]


def common_title(runs: list[dict]) -> str:
    """What every run shares, for the title: the model, the optimizer option, the debug option."""
    parts = [next(iter(v)) for v in ({r["model"] for r in runs}, {r["option"] for r in runs}) if len(v) == 1]
    debug = {r["debug"] for r in runs}
    if len(debug) == 1 and None not in debug:
        parts.append(f"debug={next(iter(debug))}")
    return ", ".join(str(p) for p in parts if p)


def _short_dir(path: str) -> str:
    """The run directory's last two parts (`<sweep>/3`): enough to tell runs apart, no machine path."""
    return "/".join(Path(path).parts[-2:])


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: training loss is noisy step to step."""
    if window <= 1:
        return values
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: list, out: str, smooth_window: int = 20, logy: bool = False, title: str = "") -> str:
    import matplotlib.pyplot as plt

    fig = figure(runs, smooth_window, logy, title)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure(runs: list, smooth_window: int = 20, logy: bool = False, title: str = ""):
    """Train loss and validation perplexity against steps and tokens of `runs` (records or run directories)
    as a pyplot figure on the Agg backend; the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r if isinstance(r, dict) else load_run(r) for r in runs]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for r, name in zip(runs, labels(runs)):
        rows = read_metrics(str(Path(r["dir"]) / "metrics.jsonl"))
        train = [x for x in rows if "loss" in x and "event" not in x]
        evals = [r["evals"][step] for step in sorted(r["evals"])]
        tokens_at, color = {x["step"]: x.get("tokens") for x in train}, None
        if train:
            loss = smooth([x["loss"] for x in train], smooth_window)
            line, = axes[0][0].plot([x["step"] for x in train], loss, label=name, lw=1)
            color = line.get_color()
            axes[0][1].plot([x.get("tokens", 0) for x in train], loss, color=color, lw=1)
        if evals:
            axes[1][0].plot([x["step"] for x in evals], [x["val_ppl"] for x in evals], "o-", ms=3,
                            color=color, label=name)
            ev_tok = [(tokens_at.get(x["step"]), x["val_ppl"]) for x in evals if tokens_at.get(x["step"]) is not None]
            if ev_tok:
                axes[1][1].plot(*zip(*ev_tok), "o-", ms=3, color=color)
    from matplotlib.ticker import FuncFormatter

    tokens_fmt = FuncFormatter(lambda v, _: f"{v / 1e9:g}B" if v >= 1e9 else f"{v / 1e6:g}M" if v >= 1e6
                               else f"{v / 1e3:g}k" if v >= 1e3 else f"{v:g}")
    for ax, (y, x) in zip([a for row in axes for a in row],
                          [("train loss", "step"), ("train loss", "tokens"),
                           ("validation perplexity", "step"), ("validation perplexity", "tokens")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y + (f" (moving avg {smooth_window})" if "loss" in y and smooth_window > 1 else ""))
        ax.grid(alpha=0.3)
        if x == "tokens":
            ax.xaxis.set_major_formatter(tokens_fmt)
        if logy or "perplexity" in y:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    title = title or common_title(runs)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    ap = runs_argument_parser(__doc__)
    ap.add_argument("--out", default="runs.png")
    ap.add_argument("--smooth", type=int, default=20, help="moving-average window of the training loss")
    ap.add_argument("--logy", action="store_true", help="log scale for the loss panels too")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    runs = load_runs(args.runs, "plot_runs")
    if not runs:
        print("plot_runs: no runs found", file=sys.stderr)
        return 1
    print(plot(runs, args.out, args.smooth, args.logy, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
