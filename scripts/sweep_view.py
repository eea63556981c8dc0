"""The sweep view of scripts/make_tables.py (`--pivot ROW_KEY COL_KEY`): final validation perplexity over
two keys of a sweep, each cell the mean (min-max, n) of its runs, labelled with what the runs realised;
notes under the grid name what a cell's mean hides. docs/results.md."""
from __future__ import annotations

import math
import os
from collections import defaultdict

from train_utils.naming import short_labels
from train_utils.results import (asked_value, effective_value, lookup, no_switch, num_text, number, repeats,
                                 same_value, swept_keys)


def joined(values) -> str:
    return ", ".join(dict.fromkeys(v for v in values if v))


def blocks_text(run: dict) -> str | None:
    """"k/L" state-full blocks of L, for a blockwise run whose start row says (density_blocks)."""
    blocks = run.get("density_blocks")
    return f"{blocks[0]}/{blocks[1]}" if blocks else None


SEED_KEYS = ("train.seed",)  # runs of one cell that differ only in these are what a cell averages


class PivotKeyError(ValueError):
    """A --pivot key that no run has; its message is the command's one-line error."""


def pivot_key(runs: list[dict], key: str) -> str:
    """The key `--pivot` names (leading + or ~ dropped), or the one swept key it ends ("density")."""
    key = key.lstrip("+~")
    if any(lookup(r, key) is not None for r in runs):
        return key
    swept = swept_keys(runs)
    by_leaf = [k for k in swept if k.rsplit(".", 1)[-1] == key]
    if len(by_leaf) == 1:
        return by_leaf[0]
    raise PivotKeyError(f"--pivot: no run has the key {key!r}; the runs differ in: "
                        f"{', '.join(swept) if swept else 'no key (one configuration)'}")


def realised(run: dict, key: str, asked: str) -> dict | None:
    """What the run realised for `key` (its start row's X_realised, no switch, the model's parameters, what
    `auto` resolved to), None when nothing tells: {"text", "number", "names" (the request), "how"}."""
    start, leaf = run.get("start") or {}, key.rsplit(".", 1)[-1]
    got = start.get(f"{leaf}_realised")
    if key.startswith("optimizer.") and isinstance(got, (int, float)):
        how = f"the start row's {leaf}_realised" + (" (k/L: state-full blocks)" if leaf == "density" else "")
        return {"text": num_text(got), "number": float(got), "names": False, "how": how}
    if key == "optimizer.update_gap" and no_switch(run["conf"]):
        return {"text": f"{asked} (no switch)", "number": number(asked), "names": True,
                "how": "no switch: update_gap >= train.steps, the subspace never changes in the run"}
    if key == "model" and isinstance(start.get("params"), int):
        return {"text": f"{asked} ({start['params'] / 1e6:.3g}M params)", "number": float(start["params"]),
                "names": True, "how": "the parameter count of the model it built (start row)"}
    if key.startswith("train.") and asked == "auto" and start.get(leaf) is not None:
        return {"text": str(start[leaf]), "number": number(start[leaf]), "names": False,
                "how": "what auto resolved to (start row)"}
    return None


def axis_value(run: dict, key: str) -> dict:
    """A run on a pivot axis: label text, number to sort by, value asked, whether they differ, k/L blocks."""
    value, request = asked_value(run, key)
    if value is None:
        return {"text": "unset", "number": None, "asked": "unset", "differs": False, "blocks": None}
    asked = request or value
    got = realised(run, key, value) or {"text": value, "number": number(value), "names": True}
    differs = request is not None or (not got["names"] and not same_value(asked, got["text"]))
    blocks = blocks_text(run) if key.endswith("density") else None
    return {"text": got["text"], "number": got["number"], "asked": asked, "differs": differs, "blocks": blocks}


def _axis(runs: list[dict], key: str) -> tuple[dict[str, str], list[str], dict[str, float | None]]:
    """{run dir: label}, the labels in order (numbers ascending, then texts, unset last), {label: number}.
    Runs that realised the same value share a label, which lists every value they asked if one differs."""
    values = {r["dir"]: axis_value(r, key) for r in runs}
    groups: dict[str, list[dict]] = defaultdict(list)
    for v in values.values():
        groups[v["text"]].append(v)
    label = {}
    for text, vs in groups.items():
        parts = [joined(v["blocks"] for v in vs)]
        if any(v["differs"] for v in vs):
            asked = sorted({v["asked"] for v in vs}, key=lambda a: (number(a) is None, number(a) or 0.0, a))
            parts.append("asked " + ", ".join(asked))
        extra = "; ".join(p for p in parts if p)
        label[text] = f"{text} ({extra})" if extra else text
    order = sorted(groups, key=lambda t: (t == "unset", groups[t][0]["number"] is None,
                                          groups[t][0]["number"] or 0.0, t))
    return ({d: label[v["text"]] for d, v in values.items()}, [label[t] for t in order],
            {label[t]: groups[t][0]["number"] for t in order})


def pivot(runs: list[dict], row_key: str, col_key: str) -> dict:
    """The sweep view of `runs` over two override keys (PivotKeyError for a key no run has). `cells`: a
    DataFrame by (row, column) of the final perplexity's mean, min, max, n (no eval and non-finite apart),
    unfinished runs, final steps and run dirs."""
    import pandas as pd

    row_key, col_key = pivot_key(runs, row_key), pivot_key(runs, col_key)
    if row_key == col_key:
        raise PivotKeyError(f"--pivot: give two different keys (both name {row_key})")
    row_of, rows, row_values = _axis(runs, row_key)
    col_of, cols, col_values = _axis(runs, col_key)
    ppl = [number(r["final_ppl"]) for r in runs]
    frame = pd.DataFrame({"row": [row_of[r["dir"]] for r in runs], "col": [col_of[r["dir"]] for r in runs],
                          "ppl": [math.nan if p is None else p for p in ppl], "run": [r["dir"] for r in runs],
                          "no_eval": [r["final_ppl"] is None for r in runs],
                          "non_finite": [p is None and r["final_ppl"] is not None for p, r in zip(ppl, runs)],
                          "unfinished": [not r["finished"] and r["final_ppl"] is not None for r in runs],
                          "step": [r["final_step"] for r in runs]})
    cells = frame.groupby(["row", "col"], sort=False).agg(
        mean=("ppl", lambda s: math.fsum(s.dropna()) / s.count() if s.count() else None),
        min=("ppl", "min"), max=("ppl", "max"), n=("ppl", "count"), no_eval=("no_eval", "sum"),
        non_finite=("non_finite", "sum"), unfinished=("unfinished", "sum"),
        steps=("step", lambda s: sorted({int(x) for x in s.dropna()})), runs=("run", list))
    return {"row_key": row_key, "col_key": col_key, "rows": rows, "cols": cols, "row_values": row_values,
            "col_values": col_values, "cells": cells, "notes": _pivot_notes(runs, frame, cells, row_key, col_key),
            "debug": sorted({r["debug"] for r in runs if r["debug"]})}


def _pivot_notes(runs: list[dict], frame, cells, row_key: str, col_key: str) -> list[str]:
    """The lines under the grid: how its labels were read, and everything a cell's mean hides."""
    notes = []
    for axis, key in (("rows", row_key), ("columns", col_key)):
        how = [(realised(r, key, lookup(r, key) or "") or {}).get("how") for r in runs]
        if any(asked_value(r, key)[1] is not None for r in runs):
            how.append("the value in the run's saved config where the command line asked another: debug=toy "
                       "fits update gaps to its run")
        if any(how):
            notes.append(f"{axis} ({key}): what the runs realised ({joined(how)}); the value asked after 'asked' "
                         f"where it differs")
    others = [k for k in dict.fromkeys(k for r in runs for k in r["overrides"])
              if k not in (row_key, col_key, *SEED_KEYS)]
    for key in [*others, *SEED_KEYS]:
        frame[key] = [effective_value(r, key) for r in runs]
    for key in others:  # what else a cell averages over, besides the seed
        split = frame.groupby(["row", "col"], sort=False)[key].unique()
        split = split[split.map(len) > 1]
        if len(split):
            values = ", ".join(sorted(set().union(*split)))
            notes.append(f"note: {len(split)} of {len(cells)} cells average runs that also differ in {key} "
                         f"({values}), not only in the seed: pivot on it, or give the runs of one value")
    twice = set(frame[frame.duplicated(["row", "col", *others, *SEED_KEYS])].set_index(["row", "col"]).index)
    if twice:
        notes.append(f"note: {len(twice)} cells count runs of the same seed and settings more than once (reruns, "
                     f"copies, or requests realised alike): "
                     f"{'; '.join(f'{r} / {c}' for r, c in cells.index if (r, c) in twice)}")
    notes += _repeated_across_cells(runs, dict(zip(frame["run"], zip(frame["row"], frame["col"]))))
    if cells["unfinished"].any():
        notes.append("*: the cell includes runs that have not finished (their last evaluation is used)")
    steps = sorted(set().union(*cells["steps"]))
    if len(steps) > 1:
        notes.append(f"note: the runs' final evaluations are at different steps ({', '.join(map(str, steps))})")
    debug = sorted({r["debug"] for r in runs if r["debug"]})
    if debug:
        notes.append(f"toy runs ({', '.join(f'debug={d}' for d in debug)}): shrunk models and budgets, "
                     f"not comparable to the paper's numbers")
    return notes


def _repeated_across_cells(runs: list[dict], cell_of: dict[str, tuple[str, str]]) -> list[str]:
    """Cells whose runs are one run repeated (train_utils.results.repeats): their numbers are no comparison."""
    twins = repeats(runs)
    spans: dict[tuple, int] = defaultdict(int)  # the cells one run spans -> for how many seeds
    for n in set(twins.values()):
        cells = tuple(dict.fromkeys(cell_of[d] for d, m in twins.items() if m == n))
        if len(cells) > 1:
            spans[cells] += 1
    return [f"note: cells {'; '.join(f'{r} / {c}' for r, c in cells)} hold one run repeated (identical configs "
            f"apart from names, once realised{f', for each of {k} seeds' if k > 1 else ''})"
            for cells, k in spans.items()]


def _cell(grid: dict, row: str, col: str):
    return grid["cells"].loc[(row, col)] if (row, col) in grid["cells"].index else None


def pivot_cell_text(c) -> str:
    """"24.05 (24.00-24.10, n=2)": mean (min-max, n runs averaged); a single run: "24.10 (n=1)"."""
    if c is None:
        return ""
    parts = []
    if c["n"]:
        spread = f"{c['min']:.2f}-{c['max']:.2f}, " if c["n"] > 1 else ""
        parts.append(f"{c['mean']:.2f} ({spread}n={c['n']})" + ("*" if c["unfinished"] else ""))
    if c["no_eval"]:
        parts.append(f"{c['no_eval']} no eval yet")
    if c["non_finite"]:
        parts.append(f"{c['non_finite']} non-finite")
    return "; ".join(parts)


def pivot_markdown(grid: dict) -> str:
    short = short_labels([grid["row_key"], grid["col_key"]])
    head = [f"{short[grid['row_key']]} \\ {short[grid['col_key']]}", *grid["cols"]]
    lines = [f"### Final validation perplexity: {grid['row_key']} (rows) x {grid['col_key']} (columns)\n",
             "cell: mean of the runs' final validation perplexity (min-max over the runs, n = runs averaged)\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([row, *(pivot_cell_text(_cell(grid, row, col)) for col in grid["cols"])]) + " |"
              for row in grid["rows"]]
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in grid["notes"])


PIVOT_CSV_FIELDS = ["row_key", "row", "row_value", "col_key", "col", "col_value", "mean_ppl", "min_ppl", "max_ppl",
                    "n", "no_eval", "non_finite", "unfinished", "steps", "runs"]


def pivot_csv(grid: dict) -> str:
    """One line per cell that has runs (long format: `row_value`/`col_value` are the numbers to plot by)."""
    cells = grid["cells"]
    table = cells.loc[[(r, c) for r in grid["rows"] for c in grid["cols"] if (r, c) in cells.index]].reset_index()
    table = table.rename(columns={"mean": "mean_ppl", "min": "min_ppl", "max": "max_ppl"}).assign(
        row_key=grid["row_key"], col_key=grid["col_key"], row_value=table["row"].map(grid["row_values"]),
        col_value=table["col"].map(grid["col_values"]), steps=table["steps"].map(lambda s: " ".join(map(str, s))),
        runs=table["runs"].map(" ".join))
    return table[PIVOT_CSV_FIELDS].to_csv(index=False, lineterminator="\r\n")


def pivot_figure(grid: dict):
    """The grid as a heatmap (a Figure on the Agg canvas), each cell annotated; grey = no run."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    rows, cols = grid["rows"], grid["cols"]
    means = grid["cells"]["mean"].astype(float).unstack().reindex(index=rows, columns=cols).to_numpy()
    toy = f"; {', '.join(f'debug={d}' for d in grid['debug'])} runs" if grid["debug"] else ""
    title = [f"final validation perplexity: {grid['row_key']} x {grid['col_key']}", f"mean over runs (min-max, n){toy}"]
    width = max(5.0, 1.0 + 0.11 * max(map(len, rows)) + 1.5 * len(cols), 0.09 * max(map(len, title)))
    fig = Figure(figsize=(width, max(3.0, 1.8 + 0.8 * len(rows))), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    finite = means[np.isfinite(means)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 2.0)
    # a diverged corner would wash out the rest on a linear scale
    norm = LogNorm(lo, hi) if lo > 0 and hi / lo > 3 else Normalize(lo, hi if hi > lo else lo + 1e-9)
    cmap = colormaps["viridis_r"].with_extremes(bad="0.88")
    image = ax.imshow(np.ma.masked_invalid(means), cmap=cmap, norm=norm, aspect="auto")
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            c = _cell(grid, row, col)
            if c is None:
                continue
            rgb = cmap(norm(means[i, j]))[:3] if np.isfinite(means[i, j]) else (0.88,) * 3
            dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.5
            ax.text(j, i, _figure_cell_text(c), ha="center", va="center", fontsize=9,
                    color="white" if dark else "black")
    long = max(map(len, cols)) > 8  # long column labels would overlap: slant them
    ax.set_xticks(range(len(cols)), cols, rotation=20 if long else 0, ha="right" if long else "center")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(grid["col_key"])
    ax.set_ylabel(grid["row_key"])
    fig.suptitle("\n".join(title), fontsize=10)
    fig.colorbar(image, ax=ax, label="mean final validation perplexity")
    return fig


def _figure_cell_text(c: dict) -> str:
    lines = []
    if c["n"]:
        lines.append(f"{c['mean']:.2f}" + ("*" if c["unfinished"] else ""))
        if c["n"] > 1:
            lines.append(f"{c['min']:.2f}-{c['max']:.2f}")
        lines.append(f"n={c['n']}")
    if c["no_eval"] or c["non_finite"]:
        lines.append(" ".join(filter(None, [f"{c['no_eval']} no eval" if c["no_eval"] else "",
                                            f"{c['non_finite']} non-finite" if c["non_finite"] else ""])))
    return "\n".join(lines)


def plot_pivot(grid: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pivot_figure(grid).savefig(path, dpi=120)
    return path
