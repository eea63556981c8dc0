"""Print finished runs as the paper's tables: our perplexity beside the paper's, and the difference.

    python scripts/make_tables.py multirun/table15                     # every run below a folder
    python scripts/make_tables.py runs/a runs/b --csv results.csv      # markdown on stdout + a CSV
    python scripts/make_tables.py multirun/table15 --format csv        # CSV on stdout
    python scripts/make_tables.py multirun/rho_T --pivot optimizer.density optimizer.update_gap --plot grid.png

Each run directory holds `metrics.jsonl` (written by train.py) and Hydra's `.hydra/` (config.yaml,
hydra.yaml, overrides.yaml). The table a run belongs to is its `paper.table` (set by the experiment
presets); its row comes from the optimizer config (method, density, rules...), its column from the
model size, the schedule, or the evaluation step (Tables 1, 5, 6/7 read the perplexity at 4k/40k/200k...
steps from the eval rows). Runs without `paper.table` are listed in a plain table.

Every run is printed: nothing is averaged or dropped. A key whose value differs between the runs of a
table (read from each run's `.hydra/overrides.yaml`: what a multirun swept, e.g. update_gap in a rho x T
sweep) becomes a CSV column, and where two runs would share a row and column, their row labels are
extended with those values ("FRUGAL, rho=0.25, update_gap=100"). The CSV also names each run's
optimizer option (frugal vs frugal_rho0, galore vs galore_original) and run directory.

Cells: `ours` = validation perplexity at the end of the run (the `end` row, else the last eval row);
`@N` after it means the run stopped at step N, not at the paper's step; `*` means it is not finished;
`[model]` means the run trained another model than the one the table is about: no difference to the
paper's number is computed for it. Table 2 also shows the optimizer-state memory we measured
(`optimizer_state_bytes`, GiB) beside the paper's memory column. Tables 9 and 17, whose memory the
paper does not print, show the measured memory beside the estimate (`frugal.estimate_state_bytes` of
the run's optimizer and model, built on the meta device; for a row no run fills, of the row's
configs/optimizer option: Appendix D's layout, as Table 2's column).

After the cells, each row says what its runs realised and how they were evaluated: `realised rho`, from
the run's start row (the optimizer's density report: k/L state-full blocks for blockwise runs), and
`eval` (tokens: our token-weighted loss; authors: the paper's code's mean of per-batch losses,
eval.mode=authors). A row's label is never a density its run did not realise: a blockwise run whose
whole layers missed the requested rho is filed under what it realised ("0.0833 (asked 0.0625)"), with
no difference to the paper. Table 3 also prints the learning rate at the read-out step (as a share of
the peak, from the run's schedule) and its memory column (weights + optimizer state, GB).

Toy runs (debug=toy, from hydra.yaml's choices, the start row or overrides.yaml) are not the paper's
runs: a table of them prints no paper or difference column and none of the paper's rows without a run,
and says so in a note; a toy run in a table of real runs is marked [debug=toy] and gets no difference.
A row whose run trained with another value than its command line asked (debug=toy writes the update
gaps it fits to its short run into the saved config) names the request: "T=19 (asked update_gap=200)".
Cells that are one run repeated (identical resolved configs apart from names, with the density the
optimizer realised and "no switch" for a constant update gap >= train.steps) are marked [same N].

The sweep view, `--pivot ROW_KEY COL_KEY` (override keys; a key's last part, `density`, does where one
swept key has it): a grid of final validation perplexity, each cell the mean over its runs (usually
seeds) with min-max and n, runs without a finite number counted apart. Rows and columns are what the
runs realised (the start row's density_realised with k/L blocks, "no switch", the model's parameter
count, what `auto` resolved to, the value in the saved config where debug=toy changed the request),
with the request after "asked" where it differs; runs that realised the same value share a row. Notes
under the grid name every other override key that differs inside a cell, cells that count one seed
twice, cells that are one run repeated, unfinished runs and differing final steps. `--format csv` gives
one line per cell; `--plot FILE` draws a heatmap. A key no run has: a one-line error naming the keys
the runs differ in (exit 2).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf  # noqa: E402

from scripts.paper_tables import GIB, MODEL_OF_SIZE, SPECS, STEPS_BY_SIZE, method, size_label  # noqa: E402
from train_utils.metrics import read_metrics  # noqa: E402
from train_utils.naming import parse_overrides, short_labels  # noqa: E402

IGNORED_KEYS = ("experiment",)  # a different preset is a different table already


def runs_argument_parser(description: str) -> argparse.ArgumentParser:
    """The command line shared by the scripts that read run directories."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories, or folders to search for them (multirun dirs)")
    return ap


def find_runs(paths: list[str], tool: str = "make_tables") -> list[Path]:
    """Run directories (holding metrics.jsonl) at or below each path, in a stable order."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(m.parent for m in p.rglob("metrics.jsonl")))
        else:
            print(f"{tool}: no run at {p} (expected a directory with metrics.jsonl)", file=sys.stderr)
    seen, out = set(), []
    for r in runs:
        if r.resolve() not in seen:
            seen.add(r.resolve())
            out.append(r)
    return out


def load_run(run: Path) -> dict:
    """Everything the tables need from one run directory."""
    hydra_dir = run / ".hydra"
    if not (hydra_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run}: no .hydra/config.yaml (was it written by train.py?)")
    conf = OmegaConf.load(hydra_dir / "config.yaml")
    cfg = OmegaConf.to_container(conf, resolve=False)
    choices = {}
    if (hydra_dir / "hydra.yaml").is_file():
        choices = OmegaConf.to_container(OmegaConf.load(hydra_dir / "hydra.yaml").hydra.runtime.choices)
    overrides = {}
    if (hydra_dir / "overrides.yaml").is_file():
        overrides = parse_overrides(OmegaConf.to_container(OmegaConf.load(hydra_dir / "overrides.yaml")))
    rows = read_metrics(str(run / "metrics.jsonl"))
    evals = {r["step"]: r for r in rows if "val_ppl" in r and r.get("event") in (None, "end")}
    end = next((r for r in reversed(rows) if r.get("event") == "end"), None)
    last_eval = max(evals.values(), key=lambda r: r["step"]) if evals else None
    final = end if end is not None and "val_ppl" in end else last_eval
    state = [r["optimizer_state_bytes"] for r in rows if isinstance(r.get("optimizer_state_bytes"), (int, float))]
    start = next((r for r in rows if r.get("event") == "start"), None)
    return {
        "dir": str(run), "cfg": cfg, "conf": conf, "evals": evals, "finished": end is not None,
        "final_ppl": final["val_ppl"] if final else None, "final_step": final["step"] if final else None,
        "state_bytes": max(state) if state else None,
        "table": (cfg.get("paper") or {}).get("table"), "choices": choices, "overrides": overrides,
        "option": choices.get("optimizer") or (cfg.get("optimizer") or {}).get("name"),
        "model": (cfg.get("model") or {}).get("name"), "start": start,
        "eval_mode": eval_mode(cfg, [r for r in rows if "val_ppl" in r]),
        "debug": debug_of(choices, overrides, start),
    }


def debug_of(choices: dict, overrides: dict, start: dict | None) -> str | None:
    """The configs/debug option a run was made with (`toy`), None for a run at its real scale: Hydra's
    choice (hydra.yaml), else the start row's `debug`, else the command line's override."""
    for value in (choices.get("debug"), (start or {}).get("debug"), overrides.get("debug")):
        if value not in (None, "", "null", "None"):
            return str(value)
    return None


def eval_mode(cfg: dict, evals: list[dict]) -> str:
    """How the run's perplexities were computed: the `val_mode` its evaluation rows name, else its
    config's `eval.mode`; runs from before the setting existed evaluated token-weighted ("tokens")."""
    modes = {str(r["val_mode"]) for r in evals if r.get("val_mode")}
    if modes:
        return ", ".join(sorted(modes))
    return str((cfg.get("eval") or {}).get("mode") or "tokens")


def readout_lr(run: dict, step: int | None) -> float | None:
    """The learning rate at `step` as a share of the peak, from the run's schedule (Table 3 reads
    its cells where the schedule put them); None when the config does not resolve here."""
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
    """Weights + optimizer state in GB (1e9 bytes): parameters (from the start row) x the bytes of the
    weights' precision (bf16: 2, else fp32's 4) + the measured optimizer state (Table 3's column)."""
    start, state = run.get("start") or {}, run.get("state_bytes")
    if not isinstance(start.get("params"), (int, float)) or state is None:
        return None
    precision = ((run["cfg"].get("train") or {}).get("precision"))
    return (start["params"] * (2 if precision == "bf16" else 4) + state) / 1e9


def effective_value(run: dict, key: str) -> str:
    """What `key` was in the run: the group option chosen, else the config value, else the override."""
    if key in run["choices"]:
        return str(run["choices"][key])
    try:
        value = OmegaConf.select(run["conf"], key, default=None)
    except Exception:  # an interpolation that only resolves inside a live run
        value = None
    if value is None:
        return run["overrides"].get(key, "")
    return str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value).replace("'", "")


def swept_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value differs between `runs` (in first-seen order)."""
    keys = list(dict.fromkeys(k for r in runs for k in r["overrides"] if k not in IGNORED_KEYS))
    return [k for k in keys if len({effective_value(r, k) for r in runs}) > 1]


def _k(step: int) -> str:
    return f"{step // 1000}k" if step % 1000 == 0 and step > 0 else str(step)


def cells_of(run: dict, spec: dict) -> dict[str, tuple[float, int]]:
    """{column label: (perplexity, step)} contributed by one run; a run with no evaluation yet (still
    at its start, or stopped before its first) holds its final cell with (None, None), so it is
    listed as such instead of vanishing from the table."""
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
    """{run dir: row label}: the base label, extended with the swept values that tell apart the runs
    that would otherwise share a row and a column (then with the run directory, if nothing does)."""
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
            for col, (ppl, step) in cells[r["dir"]].items():
                p = None if debug else paper.get(base[r["dir"]], {}).get(col)
                filled.add((base[r["dir"]], col))
                records.append(dict(
                    table=table, row=label[r["dir"]], method=base[r["dir"]], option=r["option"], column=col,
                    ours=ppl, paper=p, diff=None if p is None or differs or ppl is None else ppl - p, step=step,
                    finished=r["finished"], state_gib=_gib(r["state_bytes"]),
                    paper_state_gib=None if debug else memory.get(base[r["dir"]], {}).get(col),
                    estimate_state_gib=_gib(_run_estimate(r)) if spec.get("estimate") else None,
                    model=r["model"], table_model=spec.get("model"), model_differs=differs, run=r["dir"],
                    density_requested=_start_value(r, "density_requested"),
                    density_realised=_start_value(r, "density_realised"), eval_mode=r["eval_mode"],
                    density_blocks=_blocks(r),
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
    """" (asked update_gap=10)" where the run trained with other values than its command line asked
    (debug=toy writes the update gaps it fits to its short run into the saved config the rows are read
    from); "" otherwise."""
    asked = {k: a for k in run["overrides"] for a in [asked_value(run, k)[1]] if a is not None}
    short = short_labels(list(asked))
    return f" (asked {', '.join(f'{short[k]}={a}' for k, a in asked.items())})" if asked else ""


def _blocks(run: dict) -> str | None:
    """"k/L" state-full blocks of L, for a blockwise run whose start row says (density_blocks)."""
    blocks = (run.get("start") or {}).get("density_blocks")
    return f"{blocks[0]}/{blocks[1]}" if isinstance(blocks, (list, tuple)) and len(blocks) == 2 else None


def _start_value(run: dict, key: str):
    value = (run.get("start") or {}).get(key)
    return value if isinstance(value, (int, float)) else None


NAME_KEYS = ("paper", "wandb")  # what a run is called and filed under, not what it trains


def no_switch(conf) -> bool:
    """True when the run's subspace never changes: a constant optimizer.update_gap of at least
    train.steps (a toy run of Table 15's T=200..1000) leaves it in its first window throughout."""
    try:
        gap, steps = (OmegaConf.select(conf, k, default=None) for k in ("optimizer.update_gap", "train.steps"))
        growth = OmegaConf.select(conf, "optimizer.update_gap_growth", default=1.0)
    except Exception:  # an interpolation that only resolves inside a live run
        return False
    return isinstance(gap, int) and isinstance(steps, int) and gap >= steps and growth in (None, 1, 1.0)


def realised_config(run: dict) -> str:
    """The run's resolved config without its names (model.name, paper, wandb), with what its optimizer
    realised in place of what was asked (the density of its blocks; an update gap the run never reaches
    is no switch at all): two runs with the same text trained the same thing."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.to_container(run["conf"], resolve=True)
    except OmegaConfBaseException:  # an interpolation that resolves only inside a live run
        cfg = OmegaConf.to_container(run["conf"], resolve=False)
    for key in NAME_KEYS:
        cfg.pop(key, None)
    if isinstance(cfg.get("model"), dict):
        cfg["model"].pop("name", None)
    start = run.get("start") or {}
    if isinstance(cfg.get("optimizer"), dict) and start.get("density_realised") is not None:
        cfg["optimizer"]["density"] = [start["density_realised"], start.get("density_blocks")]
    if no_switch(run["conf"]):
        cfg["optimizer"]["update_gap"] = "no switch"
    return json.dumps(cfg, sort_keys=True, default=str)


def repeats(runs: list[dict]) -> dict[str, int]:
    """{run dir: group number} for runs that are one run repeated (realised_config): toy runs make them,
    where debug=toy leaves cells differing only in a model's name or in update gaps the short run never
    reaches. Numbered 1, 2, ... in the runs' order; runs without a twin are not in the result."""
    groups: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        groups[realised_config(r)].append(r["dir"])
    twins = [dirs for dirs in groups.values() if len(dirs) > 1]
    return {d: i for i, dirs in enumerate(twins, 1) for d in dirs}


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
    """`frugal.estimate_state_bytes` of a resolved optimizer config on a model config (built on the
    meta device: free for any size); None when the configs do not build (e.g. fabricated runs)."""
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
    """Our number with its marks: @step (not the paper's read-out step; left out for debug runs, whose
    budget is a toy's anyway), * (not finished), [model], [debug=...] (a toy run in a table that prints
    the paper's numbers for its other runs), [same N] (one run repeated)."""
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
        where = _joined(f"{r['row']} @ {r['column']}" for r in runs if r.get("same_run") == n)
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


def _joined(values) -> str:
    return ", ".join(dict.fromkeys(v for v in values if v))


def _row_extras(table: str, recs: list[dict], show_paper: bool = True) -> dict:
    """{column title: row label -> text} printed once per row after the cells: what every run of the
    row realised (density), how it was evaluated, and Table 3's read-out point and memory column (the
    paper's beside ours unless `show_paper` is off: toy runs)."""
    spec = SPECS.get(table, {})
    by_row: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by_row[r["row"]].append(r)
    runs = lambda row: [r for r in by_row[row] if r.get("run")]  # noqa: E731
    extras = {
        "realised rho": lambda row: _joined(
            f"{r['density_realised']:.4g}" + (f" ({r['density_blocks']})" if r.get("density_blocks") else "")
            for r in runs(row) if r.get("density_realised") is not None),
        "eval": lambda row: _joined(r.get("eval_mode") for r in runs(row)),
    }
    if spec.get("readout_lr"):
        extras["lr/peak at read-out"] = lambda row: _joined(
            f"{r['lr_at_readout']:.2f} (step {r['step']})" for r in runs(row) if r.get("lr_at_readout") is not None)
    if spec.get("model_memory_gb"):
        extras["memory GB ours"] = lambda row: _joined(_f(r.get("memory_gb"), 1) for r in runs(row))
    if spec.get("model_memory_gb") and show_paper:
        extras["memory GB paper"] = lambda row: _f(next((r.get("paper_memory_gb") for r in by_row[row]
                                                         if r.get("paper_memory_gb") is not None), None), 1)
    return extras


def _gib_text(x):
    return _f(x, 4 if (x or 1) < 0.01 else 2)


CSV_FIELDS = ["table", "row", "method", "option", "column", "ours", "paper", "diff", "step", "finished",
              "state_gib", "paper_state_gib", "estimate_state_gib", "model", "table_model", "model_differs",
              "density_requested", "density_realised", "density_blocks", "eval_mode", "lr_at_readout", "memory_gb",
              "paper_memory_gb", "debug", "same_run", "run"]


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


# ---- the sweep view: --pivot ROW_KEY COL_KEY --------------------------------------------------------
# A grid of final validation perplexity over two keys of a sweep: each cell is the mean over the runs that
# share its row and column (seeds, usually), with their min-max and count; nothing is dropped. Rows and
# columns are labelled with what the runs report they realised (their start row), not only with what was
# asked: a requested density of 0.125 that the blocks realise as 4 of 28 tensors is the row 0.1429.

SEED_KEYS = ("train.seed",)  # runs of one cell that differ only in these are what a cell averages


class PivotKeyError(ValueError):
    """A --pivot key that no run has; its message is the command's one-line error."""


_ABSENT = object()


def lookup(run: dict, key: str) -> str | None:
    """The run's value of `key` as text (the group option chosen, else the config value, "null" for a
    null), None when the run has no such key at all."""
    if key in run["choices"]:
        return str(run["choices"][key])
    try:
        value = OmegaConf.select(run["conf"], key, default=_ABSENT)
    except Exception:  # an interpolation that only resolves inside a live run
        value = _ABSENT
    if value is _ABSENT:
        return run["overrides"].get(key)
    return "null" if value is None else effective_value(run, key)


def pivot_key(runs: list[dict], key: str) -> str:
    """The key `--pivot` names: as given (an override's leading + or ~ dropped), or the one key the runs
    differ in whose last part it is (`density` for optimizer.density)."""
    key = key.lstrip("+~")
    if any(lookup(r, key) is not None for r in runs):
        return key
    swept = swept_keys(runs)
    by_leaf = [k for k in swept if k.rsplit(".", 1)[-1] == key]
    if len(by_leaf) == 1:
        return by_leaf[0]
    raise PivotKeyError(f"--pivot: no run has the key {key!r}; the runs differ in: "
                        f"{', '.join(swept) if swept else 'no key (one configuration)'}")


def _number(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _num_text(x: float) -> str:
    return f"{round(x, 4):g}"


def realised(run: dict, key: str, asked: str) -> dict | None:
    """What the run realised for `key`, None when nothing tells: {"text", "number" (to sort by), "names"
    (the text names the request already), "how" (for the note under the grid)}. `optimizer.X` from the
    start row's `X_realised` (the density the optimizer's blocks realise), an update gap the run never
    reaches (no switch), the model with the parameter count it built, an `auto` train.X from the start
    row's X (the micro-batch, the precision it resolved to)."""
    start, leaf = run.get("start") or {}, key.rsplit(".", 1)[-1]
    got = start.get(f"{leaf}_realised")
    if key.startswith("optimizer.") and isinstance(got, (int, float)):
        how = f"the start row's {leaf}_realised" + (" (k/L: state-full blocks)" if leaf == "density" else "")
        return {"text": _num_text(got), "number": float(got), "names": False, "how": how}
    if key == "optimizer.update_gap" and no_switch(run["conf"]):
        return {"text": f"{asked} (no switch)", "number": _number(asked), "names": True,
                "how": "no switch: update_gap >= train.steps, the subspace never changes in the run"}
    if key == "model" and isinstance(start.get("params"), int):
        return {"text": f"{asked} ({start['params'] / 1e6:.3g}M params)", "number": float(start["params"]),
                "names": True, "how": "the parameter count of the model it built (start row)"}
    if key.startswith("train.") and asked == "auto" and start.get(leaf) is not None:
        return {"text": str(start[leaf]), "number": _number(start[leaf]), "names": False,
                "how": "what auto resolved to (start row)"}
    return None


def same_value(a, b) -> bool:
    """Two spellings of one value: 0.001 and 1e-3, False and false."""
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return _num_text(na) == _num_text(nb)
    return str(a).lower() == str(b).lower()


def asked_value(run: dict, key: str) -> tuple[str | None, str | None]:
    """(the run's value of `key` in its saved config, the command line's request where that differs):
    debug=toy writes the values its run trains with into the config (update gaps fitted to 200 steps),
    and the request stays in overrides.yaml."""
    value = lookup(run, key)
    asked = run["overrides"].get(key)
    if key not in run["choices"] and _is_node(run, key):
        asked = None  # a group option (optimizer=galore) of a run without hydra.yaml: nothing to compare
    return value, asked if value is not None and asked is not None and not same_value(asked, value) else None


def _is_node(run: dict, key: str) -> bool:
    try:
        return OmegaConf.is_config(OmegaConf.select(run["conf"], key, default=None))
    except Exception:  # an interpolation that only resolves inside a live run
        return False


def axis_value(run: dict, key: str) -> dict:
    """Where a run sits on a pivot axis: its label text, the number it sorts by, the value asked, whether
    that differs from the label, and k/L state-full blocks for a density."""
    value, request = asked_value(run, key)
    if value is None:
        return {"text": "unset", "number": None, "asked": "unset", "differs": False, "blocks": None}
    asked = request or value
    got = realised(run, key, value) or {"text": value, "number": _number(value), "names": True}
    differs = request is not None or (not got["names"] and not same_value(asked, got["text"]))
    blocks = _blocks(run) if key.endswith("density") else None
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
        parts = [_joined(v["blocks"] for v in vs)]
        if any(v["differs"] for v in vs):
            asked = sorted({v["asked"] for v in vs}, key=lambda a: (_number(a) is None, _number(a) or 0.0, a))
            parts.append("asked " + ", ".join(asked))
        extra = "; ".join(p for p in parts if p)
        label[text] = f"{text} ({extra})" if extra else text
    order = sorted(groups, key=lambda t: (t == "unset", groups[t][0]["number"] is None,
                                          groups[t][0]["number"] or 0.0, t))
    return ({d: label[v["text"]] for d, v in values.items()}, [label[t] for t in order],
            {label[t]: groups[t][0]["number"] for t in order})


def cell_stats(runs: list[dict]) -> dict:
    """Mean, min and max of the runs' final validation perplexity and how many runs they are; runs without
    a finite number yet (no evaluation, or a diverged inf/nan) are counted apart, not averaged."""
    ppl = [float(r["final_ppl"]) for r in runs if _number(r["final_ppl"]) is not None]
    no_eval = sum(r["final_ppl"] is None for r in runs)
    return {"mean": math.fsum(ppl) / len(ppl) if ppl else None, "min": min(ppl, default=None),
            "max": max(ppl, default=None), "n": len(ppl), "no_eval": no_eval,
            "non_finite": len(runs) - len(ppl) - no_eval,
            "unfinished": sum(not r["finished"] and r["final_ppl"] is not None for r in runs),
            "steps": sorted({r["final_step"] for r in runs if r["final_step"] is not None}),
            "runs": [r["dir"] for r in runs]}


def pivot(runs: list[dict], row_key: str, col_key: str) -> dict:
    """The sweep view of `runs`: rows by `row_key`, columns by `col_key` (override keys: optimizer.density,
    train.seed, model...); raises PivotKeyError for a key no run has."""
    row_key, col_key = pivot_key(runs, row_key), pivot_key(runs, col_key)
    if row_key == col_key:
        raise PivotKeyError(f"--pivot: give two different keys (both name {row_key})")
    row_of, rows, row_values = _axis(runs, row_key)
    col_of, cols, col_values = _axis(runs, col_key)
    members: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in runs:
        members[(row_of[r["dir"]], col_of[r["dir"]])].append(r)
    cells = {rc: cell_stats(rs) for rc, rs in members.items()}
    return {"row_key": row_key, "col_key": col_key, "rows": rows, "cols": cols, "row_values": row_values,
            "col_values": col_values, "cells": cells, "notes": _pivot_notes(runs, members, cells, row_key, col_key),
            "debug": sorted({r["debug"] for r in runs if r["debug"]})}


def _pivot_notes(runs: list[dict], members: dict, cells: dict, row_key: str, col_key: str) -> list[str]:
    """The lines under the grid: how its labels were read, and everything a cell's mean hides."""
    notes = []
    for axis, key in (("rows", row_key), ("columns", col_key)):
        how = [(realised(r, key, lookup(r, key) or "") or {}).get("how") for r in runs]
        if any(asked_value(r, key)[1] is not None for r in runs):
            how.append("the value in the run's saved config where the command line asked another: debug=toy "
                       "fits update gaps to its run")
        if any(how):
            notes.append(f"{axis} ({key}): what the runs realised ({_joined(how)}); the value asked after 'asked' "
                         f"where it differs")
    others = [k for k in dict.fromkeys(k for r in runs for k in r["overrides"])
              if k not in (row_key, col_key, *SEED_KEYS)]
    for key in others:  # what else a cell averages over, besides the seed
        split = {rc: {effective_value(r, key) for r in rs} for rc, rs in members.items()}
        split = {rc: vals for rc, vals in split.items() if len(vals) > 1}
        if split:
            values = ", ".join(sorted(set().union(*split.values())))
            notes.append(f"note: {len(split)} of {len(members)} cells average runs that also differ in {key} "
                         f"({values}), not only in the seed: pivot on it, or give the runs of one value")
    twice = [rc for rc, rs in members.items()
             if len({tuple(effective_value(r, k) for k in [*others, *SEED_KEYS]) for r in rs}) < len(rs)]
    if twice:
        notes.append(f"note: {len(twice)} cells count runs of the same seed and settings more than once (reruns, "
                     f"copies, or requests realised alike): {'; '.join(f'{r} / {c}' for r, c in twice)}")
    notes += _repeated_across_cells(runs, members)
    if any(c["unfinished"] for c in cells.values()):
        notes.append("*: the cell includes runs that have not finished (their last evaluation is used)")
    steps = sorted({s for c in cells.values() for s in c["steps"]})
    if len(steps) > 1:
        notes.append(f"note: the runs' final evaluations are at different steps ({', '.join(map(str, steps))})")
    debug = sorted({r["debug"] for r in runs if r["debug"]})
    if debug:
        notes.append(f"toy runs ({', '.join(f'debug={d}' for d in debug)}): shrunk models and budgets, "
                     f"not comparable to the paper's numbers")
    return notes


def _repeated_across_cells(runs: list[dict], members: dict) -> list[str]:
    """Cells whose runs are one run repeated (make_tables.repeats: identical configs once realised), such
    as the update gaps a toy run never reaches: their numbers are no comparison."""
    twins = repeats(runs)
    cell_of = {r["dir"]: rc for rc, rs in members.items() for r in rs}
    spans: dict[tuple, int] = defaultdict(int)  # the cells one run spans -> for how many seeds
    for n in set(twins.values()):
        cells = tuple(dict.fromkeys(cell_of[d] for d, m in twins.items() if m == n))
        if len(cells) > 1:
            spans[cells] += 1
    return [f"note: cells {'; '.join(f'{r} / {c}' for r, c in cells)} hold one run repeated (identical configs "
            f"apart from names, once realised{f', for each of {k} seeds' if k > 1 else ''})"
            for cells, k in spans.items()]


def pivot_cell_text(c: dict | None) -> str:
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
    out = io.StringIO()
    out.write(f"### Final validation perplexity: {grid['row_key']} (rows) x {grid['col_key']} (columns)\n\n"
              "cell: mean of the runs' final validation perplexity (min-max over the runs, n = runs averaged)\n\n")
    out.write("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
    for row in grid["rows"]:
        texts = [pivot_cell_text(grid["cells"].get((row, col))) for col in grid["cols"]]
        out.write("| " + " | ".join([row, *texts]) + " |\n")
    out.write("".join(f"\n{n}\n" for n in grid["notes"]))
    return out.getvalue()


PIVOT_CSV_FIELDS = ["row_key", "row", "row_value", "col_key", "col", "col_value", "mean_ppl", "min_ppl", "max_ppl",
                    "n", "no_eval", "non_finite", "unfinished", "steps", "runs"]


def pivot_csv(grid: dict) -> str:
    """One line per cell that has runs (long format: `row_value`/`col_value` are the numbers to plot by)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=PIVOT_CSV_FIELDS)
    w.writeheader()
    for row in grid["rows"]:
        for col in grid["cols"]:
            c = grid["cells"].get((row, col))
            if c is None:
                continue
            d = {"row_key": grid["row_key"], "row": row, "row_value": grid["row_values"][row],
                 "col_key": grid["col_key"], "col": col, "col_value": grid["col_values"][col], "mean_ppl": c["mean"],
                 "min_ppl": c["min"], "max_ppl": c["max"], "n": c["n"], "no_eval": c["no_eval"],
                 "non_finite": c["non_finite"], "unfinished": c["unfinished"],
                 "steps": " ".join(map(str, c["steps"])), "runs": " ".join(c["runs"])}
            w.writerow({k: "" if v is None else v for k, v in d.items()})
    return buf.getvalue()


def pivot_figure(grid: dict):
    """The grid as a heatmap (a matplotlib Figure on the Agg canvas): colour = mean perplexity (lighter is
    lower), each cell annotated with its mean, min-max and n; grey = no run."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure

    rows, cols = grid["rows"], grid["cols"]
    means = np.array([[_cell_mean(grid["cells"].get((r, c))) for c in cols] for r in rows], dtype=float)
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
            c = grid["cells"].get((row, col))
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


def _cell_mean(c: dict | None) -> float:
    return c["mean"] if c is not None and c["mean"] is not None else float("nan")


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


def main(argv=None) -> int:
    ap = runs_argument_parser(__doc__)
    ap.add_argument("--format", choices=["markdown", "csv"], default="markdown", help="what to print")
    ap.add_argument("--csv", help="also write the CSV here")
    ap.add_argument("--md", help="also write the markdown here")
    ap.add_argument("--pivot", nargs=2, metavar=("ROW_KEY", "COL_KEY"),
                    help="the sweep view: final validation perplexity over two keys (override keys, e.g. "
                         "optimizer.density optimizer.update_gap), mean over the runs of a cell (min-max, n)")
    ap.add_argument("--plot", metavar="FILE", help="with --pivot: draw the grid as a heatmap (PNG)")
    args = ap.parse_args(argv)
    if args.plot and not args.pivot:
        print("make_tables: --plot draws the --pivot grid; give --pivot ROW_KEY COL_KEY "
              "(curves of runs: scripts/plot_runs.py)", file=sys.stderr)
        return 2
    dirs = find_runs(args.runs)
    if not dirs:
        print("make_tables: no runs found", file=sys.stderr)
        return 1
    runs = [load_run(d) for d in dirs]
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
