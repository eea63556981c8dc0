"""Print finished runs as the paper's tables: our perplexity beside the paper's, and the difference.

    python -m scripts.make_tables multirun/table15                     # every run below a folder
    python -m scripts.make_tables runs/a runs/b --csv results.csv      # markdown on stdout + a CSV
    python -m scripts.make_tables multirun/table15 --format csv        # CSV on stdout
    python -m scripts.make_tables multirun/rho_T --pivot optimizer.density optimizer.update_gap --plot grid.png

Runs are read by train_utils.results.load_runs. A run's table is its `paper.table` (the experiment presets
set it), its row the optimizer config (a row label is never a density its run did not realise), its column
the model size, the schedule or the evaluation step; runs without `paper.table` are listed in a plain table.
Every run is printed, nothing averaged or dropped: a key the runs of a table differ in (a sweep's) becomes a
CSV column and, where two runs would share a cell, part of their row label. Cell marks: `@N` (read at step N,
not the paper's), `*` (not finished), `[model]` (another model than the table's: no difference), `[same N]`
(one run repeated), `[debug=toy]`, `[vote]` (the state-free part voted: no difference); toy runs alone get
no paper column. Tables 2, 3, 9 and 17 add memory columns, each row its realised rho and evaluation mode.
`--pivot ROW_KEY COL_KEY` is the sweep view (scripts/sweep_view.py): mean final perplexity per cell with
min-max and n; `--plot FILE` draws it.
Everything each column means: docs/results.md.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from scripts.paper_tables import GIB, MODEL_OF_SIZE, SPECS, STEPS_BY_SIZE, method, size_label
from scripts.sweep_view import (PivotKeyError, blocks_text, joined, pivot, pivot_csv,  # noqa: F401
                                pivot_figure, pivot_markdown, plot_pivot)
from train_utils.naming import short_labels
from train_utils.results import (asked_value, debug_of, effective_value, find_runs, load_run,  # noqa: F401
                                 load_runs, repeats, runs_argument_parser, swept_keys)

def readout_lr(run: dict, step: int | None) -> float | None:
    """The learning rate at `step` as a share of the peak (Table 3); None when the config does not resolve."""
    from omegaconf.errors import OmegaConfBaseException

    if step is None:
        return None
    try:
        sched = OmegaConf.to_container(run["conf"].schedule, resolve=True)
        total = int(OmegaConf.select(run["conf"], "train.steps", throw_on_missing=True))
    except (OmegaConfBaseException, TypeError, ValueError, AttributeError):
        return None
    from frugal.schedules import build_lambda

    try:
        return float(build_lambda(sched.pop("name"), total, **sched)(step))
    except (TypeError, ValueError, KeyError):
        return None


def model_memory_gb(run: dict) -> float | None:
    """Weights (2 bytes per parameter in bf16, else 4) + measured optimizer state in GB (Table 3's column)."""
    start, state = run.get("start") or {}, run.get("state_bytes")
    if not isinstance(start.get("params"), (int, float)) or state is None:
        return None
    precision = ((run["cfg"].get("train") or {}).get("precision"))
    return (start["params"] * (2 if precision == "bf16" else 4) + state) / 1e9


def _k(step: int) -> str:
    return f"{step // 1000}k" if step % 1000 == 0 and step > 0 else str(step)


def cells_of(run: dict, spec: dict) -> dict[str, tuple[float, int]]:
    """{column label: (perplexity, step)} of one run; one with no evaluation yet holds (None, None)."""
    cfg, kind = run["cfg"], spec["columns"][0]
    out: dict[str, tuple[float | None, int | None]] = {}
    if run["final_ppl"] is None:
        if kind == "model":
            out[size_label(cfg)] = (None, None)
        else:
            prefix = f"{cfg['schedule']['name']} " if kind == "schedule_steps" else ""
            out[spec["columns"][1] if kind == "final" else prefix + "final"] = (None, None)
        return out
    if kind == "model":
        out[size_label(cfg)] = (run["final_ppl"], run["final_step"])
    elif kind == "final":
        out[spec["columns"][1]] = (run["final_ppl"], run["final_step"])
    elif kind in ("steps", "schedule_steps"):
        prefix = f"{cfg['schedule']['name']} " if kind == "schedule_steps" else ""
        for s in spec["columns"][1]:
            if s in run["evals"]:
                out[prefix + _k(s)] = (run["evals"][s]["val_ppl"], s)
        out[prefix + "final"] = (run["final_ppl"], run["final_step"])
    return out


def _paper_step(col: str) -> int | None:
    if col in STEPS_BY_SIZE:
        return STEPS_BY_SIZE[col]
    tail = col.split()[-1]
    return int(tail[:-1]) * 1000 if tail.endswith("k") and tail[:-1].isdigit() else None


def row_labels(runs: list[dict], base: dict[str, str], cells: dict[str, dict], swept: list[str]) -> dict[str, str]:
    """{run dir: row label}: the base label, plus the swept values (or the run) of runs that share a cell."""
    labels = short_labels(swept)
    by_base: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_base[base[r["dir"]]].append(r)
    out = {}
    for label, group in by_base.items():
        cols = [c for r in group for c in cells[r["dir"]]]
        if len(cols) == len(set(cols)):
            out.update({r["dir"]: label for r in group})
            continue
        differing = [k for k in swept if len({effective_value(r, k) for r in group}) > 1]
        for r in group:
            extra = [f"{labels[k]}={effective_value(r, k)}" for k in differing] or [f"run={r['dir']}"]
            out[r["dir"]] = ", ".join([label, *extra])
    return out


def build(runs: list[dict]) -> list[dict]:
    """Long-format records: one per (run, column), plus the paper's cells that no run fills."""
    by_table: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_table[r["table"] if r["table"] in SPECS else "other"].append(r)
    records = []
    for table in [t for t in SPECS if t in by_table] + (["other"] if "other" in by_table else []):
        spec = SPECS.get(table, {"row": lambda c: method(c.get("optimizer", {})), "columns": ("model",), "paper": {}})
        trs, paper, memory = by_table[table], spec["paper"], spec.get("memory", {})
        swept = swept_keys(trs)
        base = {r["dir"]: spec["row"](r["cfg"], r["start"]) if table in SPECS else spec["row"](r["cfg"])
                for r in trs}
        cells = {r["dir"]: cells_of(r, spec) for r in trs}
        label = row_labels(trs, base, cells, swept)
        label = {r["dir"]: label[r["dir"]] + _asked_text(r) for r in trs}
        filled, twins = set(), repeats(trs)
        for r in trs:
            differs = spec.get("model") is not None and r["model"] != spec["model"]
            debug = r["debug"]  # a toy run's number is not comparable to the paper's: none beside it
            vote = (r["start"] or {}).get("state_free_comm") == "vote"  # not the paper's all-reduce
            for col, (ppl, step) in cells[r["dir"]].items():
                p = None if debug else paper.get(base[r["dir"]], {}).get(col)
                filled.add((base[r["dir"]], col))
                records.append(dict(
                    table=table, row=label[r["dir"]], method=base[r["dir"]], option=r["option"], column=col,
                    ours=ppl, paper=p, diff=None if p is None or differs or vote or ppl is None else ppl - p,
                    step=step, state_free_comm="vote" if vote else None,
                    finished=r["finished"], state_gib=_gib(r["state_bytes"]),
                    paper_state_gib=None if debug else memory.get(base[r["dir"]], {}).get(col),
                    estimate_state_gib=_gib(_run_estimate(r)) if spec.get("estimate") else None,
                    model=r["model"], table_model=spec.get("model"), model_differs=differs, run=r["dir"],
                    density_requested=_start_value(r, "density_requested"),
                    density_realised=_start_value(r, "density_realised"), eval_mode=r["eval_mode"],
                    density_blocks=blocks_text(r),
                    lr_at_readout=readout_lr(r, step) if spec.get("readout_lr") else None,
                    memory_gb=model_memory_gb(r) if spec.get("model_memory_gb") else None,
                    paper_memory_gb=None if debug else spec.get("model_memory_gb", {}).get(base[r["dir"]]),
                    debug=debug, same_run=twins.get(r["dir"]), model_shape=model_shape(r) if debug else None,
                    swept={k: effective_value(r, k) for k in swept}))
        if all(r["debug"] for r in trs):
            continue  # toy runs only: the paper's cells beside them would invite a comparison that is not one
        for row, by_col in paper.items():
            for col, p in by_col.items():
                if (row, col) not in filled:
                    records.append(dict(table=table, row=row, method=row, column=col, ours=None, paper=p,
                                        paper_state_gib=memory.get(row, {}).get(col),
                                        estimate_state_gib=_gib(_paper_estimate(spec, row, col)),
                                        paper_memory_gb=spec.get("model_memory_gb", {}).get(row),
                                        table_model=spec.get("model"), swept={}))
    return _in_paper_order(records)


def _asked_text(run: dict) -> str:
    """" (asked update_gap=10)" where the run trained with other values than asked (debug=toy), else ""."""
    asked = {k: a for k in run["overrides"] for a in [asked_value(run, k)[1]] if a is not None}
    short = short_labels(list(asked))
    return f" (asked {', '.join(f'{short[k]}={a}' for k, a in asked.items())})" if asked else ""


def _start_value(run: dict, key: str):
    value = (run.get("start") or {}).get(key)
    return value if isinstance(value, (int, float)) else None


def model_shape(run: dict) -> str:
    """"4 layers x 128, 935,040 parameters": the model a (toy) run really trained."""
    model, params = run["cfg"].get("model") or {}, (run.get("start") or {}).get("params")
    shape = f"{model.get('num_hidden_layers', '?')} layers x {model.get('hidden_size', '?')}"
    return shape + (f", {params:,} parameters" if isinstance(params, int) else "")


def _in_paper_order(records: list[dict]) -> list[dict]:
    """Within a table: the paper's rows first in its order (our variants right after theirs)."""
    out = []
    for table in dict.fromkeys(r["table"] for r in records):
        recs = [r for r in records if r["table"] == table]
        order = list(SPECS.get(table, {}).get("paper", {}))
        rank = {m: i for i, m in enumerate(dict.fromkeys(order + [r["method"] for r in recs]))}
        out += sorted(recs, key=lambda r: rank[r["method"]])  # stable: runs keep their order
    return out


def _gib(b):
    return None if b is None else b / GIB


_ESTIMATES: dict[str, int | None] = {}


def estimate_bytes(opt: dict, model: dict) -> int | None:
    """`frugal.estimate_state_bytes` on the meta device; None when the configs do not build."""
    key = json.dumps([opt, model], sort_keys=True, default=str)
    if key not in _ESTIMATES:
        import torch

        import frugal
        import models
        from omegaconf.errors import OmegaConfBaseException

        try:
            with torch.device("meta"):
                built = models.build_model(model)
            hp = dict(opt)
            _ESTIMATES[key] = frugal.estimate_state_bytes(built, hp.pop("name"), **hp)
        except (ValueError, KeyError, TypeError, OmegaConfBaseException):
            _ESTIMATES[key] = None
    return _ESTIMATES[key]


def _run_estimate(run: dict) -> int | None:
    from omegaconf.errors import OmegaConfBaseException

    try:
        opt = OmegaConf.to_container(run["conf"].optimizer, resolve=True)
        model = OmegaConf.to_container(run["conf"].model, resolve=True)
    except OmegaConfBaseException:  # a config that resolves only inside a live run, or lacks the node
        return None
    return estimate_bytes(opt, model)


def _paper_estimate(spec: dict, row: str, column: str) -> int | None:
    """The estimate of a paper cell no run fills: the row's option on the column's model."""
    option, model = spec.get("estimate", {}).get(row), MODEL_OF_SIZE.get(column)
    if option is None or model is None:
        return None
    from scripts.memory_table import model_config, optimizer_config

    return estimate_bytes(optimizer_config(option), model_config(model))


def _f(x, nd=2):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(records: list[dict]) -> str:
    out = io.StringIO()
    for table in dict.fromkeys(r["table"] for r in records):
        recs = [r for r in records if r["table"] == table]
        title = SPECS[table]["title"] if table in SPECS else "Runs without a paper table (paper.table unset)"
        # toy runs only: no paper column at all (build() left out the paper's cells no run fills)
        show = {"paper": not _toy_only(recs), "mem": table in SPECS and bool(SPECS[table].get("memory")),
                "est": table in SPECS and bool(SPECS[table].get("estimate"))}
        cols = _column_order(table, [r["column"] for r in recs])
        rows = list(dict.fromkeys(r["row"] for r in recs))
        cell = {(r["row"], r["column"]): r for r in recs}
        head = ["method"] + [h for c in cols for h in _cell_head(c, show)]
        extras = _row_extras(table, recs, show["paper"])
        head += list(extras)
        out.write(f"### {title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        for row in rows:
            line = [row] + [t for c in cols for t in _cell_texts(cell.get((row, c)), c, show)]
            line += [value(row) for value in extras.values()]
            out.write("| " + " | ".join(line) + " |\n")
        recs.sort(key=lambda r: (rows.index(r["row"]), cols.index(r["column"])))  # notes list cells as printed
        out.write(_table_notes(recs, show["paper"]) + "\n")
    return out.getvalue()


def _column_order(table: str, columns: list[str]) -> list[str]:
    """The columns in the paper's order (60M before 130M even where only runs fill them), then ours."""
    paper = list(dict.fromkeys(c for by_col in SPECS.get(table, {}).get("paper", {}).values() for c in by_col))
    seen = list(dict.fromkeys(columns))
    return sorted(seen, key=lambda c: (paper.index(c) if c in paper else len(paper), seen.index(c)))


def _toy_only(recs: list[dict]) -> bool:
    runs = [r for r in recs if r.get("run")]
    return bool(runs) and all(r.get("debug") for r in runs)


def _cell_head(column: str, show: dict) -> list[str]:
    head = [f"{column} ours"] + ([f"{column} paper", f"{column} diff"] if show["paper"] else [])
    if show["mem"]:
        head += [f"{column} state GiB ours"] + ([f"{column} state GiB paper"] if show["paper"] else [])
    if show["est"]:
        head += [f"{column} state GiB ours", f"{column} state GiB estimate"]
    return head


def _cell_texts(r: dict | None, column: str, show: dict) -> list[str]:
    """The texts of one (row, column) cell, in _cell_head's order."""
    if r is None:
        return [""] * len(_cell_head(column, show))
    texts = [_ours_text(r, column, show["paper"])]
    if show["paper"]:
        diff = _f(r.get("diff"), 2)
        texts += [_f(r["paper"]), "+" + diff if diff and not diff.startswith("-") else diff]
    if show["mem"]:
        texts += [_gib_text(r.get("state_gib"))] + ([_f(r["paper_state_gib"])] if show["paper"] else [])
    if show["est"]:
        texts += [_gib_text(r.get("state_gib")), _gib_text(r.get("estimate_state_gib"))]
    return texts


def _ours_text(r: dict, column: str, show_paper: bool) -> str:
    """Our number with its marks (the module docstring; no @step for debug runs)."""
    if r["ours"] is None:
        return "no eval yet" if r.get("run") else ""
    ours = _f(r["ours"])
    want = _paper_step(column)
    if want is not None and r["step"] is not None and r["step"] != want and not r.get("debug"):
        ours += f" @{r['step']}"
    if r["finished"] is False:
        ours += "*"
    if r["model_differs"]:
        ours += f" [{r['model']}]"
    if r.get("debug") and show_paper:
        ours += f" [debug={r['debug']}]"
    if r.get("same_run"):
        ours += f" [same {r['same_run']}]"
    if r.get("state_free_comm"):
        ours += " [vote]"
    return ours


def _table_notes(recs: list[dict], show_paper: bool) -> str:
    """The lines under a table: what its marks mean, for the marks it has."""
    runs = [r for r in recs if r.get("run")]
    notes = []
    others = sorted({r["model"] for r in recs if r.get("model_differs")})
    if others:
        notes.append(f"[model]: trained {', '.join(others)}, not the table's {recs[0]['table_model']}; "
                     f"not comparable to the paper's number (no difference computed).")
    debug = sorted({r["debug"] for r in runs if r.get("debug")})
    if debug and not show_paper:
        notes.append(f"toy runs ({', '.join(f'debug={d}' for d in debug)}): shrunk models and budgets; the paper's "
                     f"numbers are not comparable, so no paper or difference column is printed.")
    elif debug:
        notes.append(f"[debug={'/'.join(debug)}]: a toy run; the paper's number is not comparable (none printed "
                     f"beside it, no difference computed).")
    if any(r.get("state_free_comm") for r in runs):
        notes.append("[vote]: the state-free part was communicated as a one-bit majority vote "
                     "(train.state_free_comm=vote, docs/communication.md), not the paper's exact all-reduce "
                     "(no difference computed).")
    notes += _repeat_notes(runs)
    if runs:
        notes.append("realised rho: the density the run realised, from its start row (the optimizer's density "
                     "report: state-full blocks k/L for blockwise runs, as the paper defines rho; the state-full "
                     "share of the projectable weights otherwise); eval: tokens = token-weighted mean loss "
                     "(ours), authors = mean of per-batch mean losses on the seed-42 shuffled validation set "
                     "(the paper's code).")
    return "".join(f"\n{n}\n" for n in notes)


def _repeat_notes(runs: list[dict]) -> list[str]:
    """Runs that are one run repeated ([same N]), and model columns that debug=toy made one model."""
    notes = []
    for n in sorted({r["same_run"] for r in runs if r.get("same_run")}):
        where = joined(f"{r['row']} @ {r['column']}" for r in runs if r.get("same_run") == n)
        notes.append(f"[same {n}]: {where} are one run repeated (identical configs apart from names, once what "
                     f"the optimizer realised replaces what was asked: its density; no switch for an update gap "
                     f">= train.steps).")
    by_shape: dict[str, set] = defaultdict(set)
    for r in runs:
        if r.get("model_shape"):
            by_shape[r["model_shape"]].add(r["model"])
    for shape, models in by_shape.items():
        if len(models) > 1:
            notes.append(f"debug trains {', '.join(sorted(models))} as one model ({shape}): their columns are no "
                         f"comparison of model sizes.")
    return notes


def _row_extras(table: str, recs: list[dict], show_paper: bool = True) -> dict:
    """{column title: row label -> text} after the cells: realised rho, eval, Table 3's read-out and memory."""
    spec = SPECS.get(table, {})
    by_row: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by_row[r["row"]].append(r)
    runs = lambda row: [r for r in by_row[row] if r.get("run")]  # noqa: E731
    extras = {
        "realised rho": lambda row: joined(
            f"{r['density_realised']:.4g}" + (f" ({r['density_blocks']})" if r.get("density_blocks") else "")
            for r in runs(row) if r.get("density_realised") is not None),
        "eval": lambda row: joined(r.get("eval_mode") for r in runs(row)),
    }
    if spec.get("readout_lr"):
        extras["lr/peak at read-out"] = lambda row: joined(
            f"{r['lr_at_readout']:.2f} (step {r['step']})" for r in runs(row) if r.get("lr_at_readout") is not None)
    if spec.get("model_memory_gb"):
        extras["memory GB ours"] = lambda row: joined(_f(r.get("memory_gb"), 1) for r in runs(row))
    if spec.get("model_memory_gb") and show_paper:
        extras["memory GB paper"] = lambda row: _f(next((r.get("paper_memory_gb") for r in by_row[row]
                                                         if r.get("paper_memory_gb") is not None), None), 1)
    return extras


def _gib_text(x):
    return _f(x, 4 if (x or 1) < 0.01 else 2)


CSV_FIELDS = ["table", "row", "method", "option", "column", "ours", "paper", "diff", "step", "finished",
              "state_gib", "paper_state_gib", "estimate_state_gib", "model", "table_model", "model_differs",
              "density_requested", "density_realised", "density_blocks", "eval_mode", "lr_at_readout", "memory_gb",
              "paper_memory_gb", "debug", "same_run", "state_free_comm", "run"]


def to_csv(records: list[dict]) -> str:
    swept = list(dict.fromkeys(k for r in records for k in r["swept"]))
    fields = CSV_FIELDS + [k for k in swept if k not in CSV_FIELDS]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for r in records:
        d = {**r, **r["swept"]}
        w.writerow({k: ("" if d.get(k) is None else d[k]) for k in fields})
    return buf.getvalue()


def main(argv=None) -> int:
    ap = runs_argument_parser(__doc__)
    ap.add_argument("--format", choices=["markdown", "csv"], default="markdown", help="what to print")
    ap.add_argument("--csv", help="also write the CSV here")
    ap.add_argument("--md", help="also write the markdown here")
    ap.add_argument("--pivot", nargs=2, metavar=("ROW_KEY", "COL_KEY"),
                    help="the sweep view over two override keys (e.g. optimizer.density optimizer.update_gap)")
    ap.add_argument("--plot", metavar="FILE", help="with --pivot: draw the grid as a heatmap (PNG)")
    args = ap.parse_args(argv)
    if args.plot and not args.pivot:
        print("make_tables: --plot draws the --pivot grid; give --pivot ROW_KEY COL_KEY "
              "(curves of runs: scripts/plot_runs.py)", file=sys.stderr)
        return 2
    runs = load_runs(args.runs, "make_tables")
    if not runs:
        print("make_tables: no runs found", file=sys.stderr)
        return 1
    if args.pivot:
        try:
            grid = pivot(runs, *args.pivot)
        except PivotKeyError as e:
            print(f"make_tables: {e}", file=sys.stderr)
            return 2
        md, cs = pivot_markdown(grid), pivot_csv(grid)
        if args.plot:
            print(f"make_tables: grid drawn in {plot_pivot(grid, args.plot)}", file=sys.stderr)
    else:
        records = build(runs)
        md, cs = markdown(records), to_csv(records)
    print(md if args.format == "markdown" else cs, end="")
    for path, text in ((args.csv, cs), (args.md, md)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            Path(path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
