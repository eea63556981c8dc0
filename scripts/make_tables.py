"""Print finished runs as the paper's tables: our perplexity beside the paper's, and the difference.

    python scripts/make_tables.py multirun/table15                     # every run below a folder
    python scripts/make_tables.py runs/a runs/b --csv results.csv      # markdown on stdout + a CSV
    python scripts/make_tables.py multirun/table15 --format csv        # CSV on stdout

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
"""
from __future__ import annotations

import argparse
import csv
import io
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
    }


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
        filled = set()
        for r in trs:
            differs = spec.get("model") is not None and r["model"] != spec["model"]
            for col, (ppl, step) in cells[r["dir"]].items():
                p = paper.get(base[r["dir"]], {}).get(col)
                filled.add((base[r["dir"]], col))
                records.append(dict(
                    table=table, row=label[r["dir"]], method=base[r["dir"]], option=r["option"], column=col,
                    ours=ppl, paper=p, diff=None if p is None or differs or ppl is None else ppl - p, step=step,
                    finished=r["finished"], state_gib=_gib(r["state_bytes"]),
                    paper_state_gib=memory.get(base[r["dir"]], {}).get(col),
                    estimate_state_gib=_gib(_run_estimate(r)) if spec.get("estimate") else None,
                    model=r["model"], table_model=spec.get("model"), model_differs=differs, run=r["dir"],
                    density_requested=_start_value(r, "density_requested"),
                    density_realised=_start_value(r, "density_realised"), eval_mode=r["eval_mode"],
                    density_blocks=_blocks(r),
                    lr_at_readout=readout_lr(r, step) if spec.get("readout_lr") else None,
                    memory_gb=model_memory_gb(r) if spec.get("model_memory_gb") else None,
                    paper_memory_gb=spec.get("model_memory_gb", {}).get(base[r["dir"]]),
                    swept={k: effective_value(r, k) for k in swept}))
        for row, by_col in paper.items():
            for col, p in by_col.items():
                if (row, col) not in filled:
                    records.append(dict(table=table, row=row, method=row, column=col, ours=None, paper=p,
                                        paper_state_gib=memory.get(row, {}).get(col),
                                        estimate_state_gib=_gib(_paper_estimate(spec, row, col)),
                                        paper_memory_gb=spec.get("model_memory_gb", {}).get(row),
                                        table_model=spec.get("model"), swept={}))
    return _in_paper_order(records)


def _blocks(run: dict) -> str | None:
    """"k/L" state-full blocks of L, for a blockwise run whose start row says (density_blocks)."""
    blocks = (run.get("start") or {}).get("density_blocks")
    return f"{blocks[0]}/{blocks[1]}" if isinstance(blocks, (list, tuple)) and len(blocks) == 2 else None


def _start_value(run: dict, key: str):
    value = (run.get("start") or {}).get(key)
    return value if isinstance(value, (int, float)) else None


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
    import json

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
        has_mem = table in SPECS and bool(SPECS[table].get("memory"))
        has_est = table in SPECS and bool(SPECS[table].get("estimate"))
        cols = list(dict.fromkeys(r["column"] for r in recs))
        rows = list(dict.fromkeys(r["row"] for r in recs))
        cell = {(r["row"], r["column"]): r for r in recs}
        head = ["method"]
        for c in cols:
            head += [f"{c} ours", f"{c} paper", f"{c} diff"]
            if has_mem:
                head += [f"{c} state GiB ours", f"{c} state GiB paper"]
            if has_est:
                head += [f"{c} state GiB ours", f"{c} state GiB estimate"]
        extras = _row_extras(table, recs)
        head += list(extras)
        out.write(f"### {title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        for row in rows:
            line = [row]
            for c in cols:
                r = cell.get((row, c))
                if r is None:
                    line += ["", "", ""] + (["", ""] if has_mem else []) + (["", ""] if has_est else [])
                    continue
                ours = _f(r["ours"]) if r["ours"] is not None or not r.get("run") else "no eval yet"
                if r["ours"] is not None:
                    want = _paper_step(c)
                    if want is not None and r["step"] is not None and r["step"] != want:
                        ours += f" @{r['step']}"
                    if r["finished"] is False:
                        ours += "*"
                    if r["model_differs"]:
                        ours += f" [{r['model']}]"
                diff = _f(r.get("diff"), 2)
                if diff and not diff.startswith("-"):
                    diff = "+" + diff
                line += [ours, _f(r["paper"]), diff]
                if has_mem:
                    line += [_gib_text(r.get("state_gib")), _f(r["paper_state_gib"])]
                if has_est:
                    line += [_gib_text(r.get("state_gib")), _gib_text(r.get("estimate_state_gib"))]
            line += [value(row) for value in extras.values()]
            out.write("| " + " | ".join(line) + " |\n")
        others = sorted({r["model"] for r in recs if r.get("model_differs")})
        if others:
            out.write(f"\n[model]: trained {', '.join(others)}, not the table's {recs[0]['table_model']}; "
                      f"not comparable to the paper's number (no difference computed).\n")
        if any(r.get("run") for r in recs):
            out.write("\nrealised rho: the density the run realised, from its start row (the optimizer's density "
                      "report: state-full blocks k/L for blockwise runs, as the paper defines rho; the state-full "
                      "share of the projectable weights otherwise); eval: tokens = token-weighted mean loss "
                      "(ours), authors = mean of per-batch mean losses on the seed-42 shuffled validation set "
                      "(the paper's code).\n")
        out.write("\n")
    return out.getvalue()


def _joined(values) -> str:
    return ", ".join(dict.fromkeys(v for v in values if v))


def _row_extras(table: str, recs: list[dict]) -> dict:
    """{column title: row label -> text} printed once per row after the cells: what every run of the
    row realised (density), how it was evaluated, and Table 3's read-out point and memory column."""
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
        extras["memory GB paper"] = lambda row: _f(next((r.get("paper_memory_gb") for r in by_row[row]
                                                         if r.get("paper_memory_gb") is not None), None), 1)
    return extras


def _gib_text(x):
    return _f(x, 4 if (x or 1) < 0.01 else 2)


CSV_FIELDS = ["table", "row", "method", "option", "column", "ours", "paper", "diff", "step", "finished",
              "state_gib", "paper_state_gib", "estimate_state_gib", "model", "table_model", "model_differs",
              "density_requested", "density_realised", "density_blocks", "eval_mode", "lr_at_readout", "memory_gb",
              "paper_memory_gb", "run"]


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
    args = ap.parse_args(argv)
    dirs = find_runs(args.runs)
    if not dirs:
        print("make_tables: no runs found", file=sys.stderr)
        return 1
    records = build([load_run(d) for d in dirs])
    md, cs = markdown(records), to_csv(records)
    print(md if args.format == "markdown" else cs, end="")
    for path, text in ((args.csv, cs), (args.md, md)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            Path(path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
