"""Print finished runs as the paper's tables: our perplexity beside the paper's, and the difference.

    python scripts/make_tables.py multirun/2025-01-01/12-00-00          # every run below a folder
    python scripts/make_tables.py runs/a runs/b --csv results.csv       # markdown on stdout + a CSV
    python scripts/make_tables.py multirun/... --format csv              # CSV on stdout

Each run directory holds `metrics.jsonl` (written by train.py) and `.hydra/config.yaml`. The table a
run belongs to is its `paper.table` (set by the experiment presets); its row comes from the optimizer
config (method, density, rules...), its column from the model size, the schedule, or the evaluation
step (Tables 1, 5, 6/7 read the perplexity at 4k/40k/200k... steps from the eval rows). Runs without
`paper.table` are listed in a plain table. Several runs in one cell (seeds) are averaged.

Cells: `ours` = validation perplexity at the end of the run (the `end` row, else the last eval row);
`@N` after it means the run stopped at step N, not at the paper's step; `*` means it is not finished.
Table 2 also shows the optimizer-state memory we measured (`optimizer_state_bytes`, GiB) beside the
paper's memory column.
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

from scripts.paper_tables import GIB, SPECS, STEPS_BY_SIZE, method, size_label  # noqa: E402


def find_runs(paths: list[str]) -> list[Path]:
    """Run directories (holding metrics.jsonl) at or below each path, in a stable order."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(m.parent for m in p.rglob("metrics.jsonl")))
        else:
            print(f"make_tables: no run at {p} (expected a directory with metrics.jsonl)", file=sys.stderr)
    seen, out = set(), []
    for r in runs:
        if r.resolve() not in seen:
            seen.add(r.resolve())
            out.append(r)
    return out


def read_metrics(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                    pass
    return rows


def load_run(run: Path) -> dict:
    """Everything the tables need from one run directory."""
    cfg_path = run / ".hydra" / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run}: no .hydra/config.yaml (was it written by train.py?)")
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False)
    rows = read_metrics(run / "metrics.jsonl")
    evals = {r["step"]: r for r in rows if "val_ppl" in r and r.get("event") in (None, "end")}
    end = next((r for r in reversed(rows) if r.get("event") == "end"), None)
    last_eval = max(evals.values(), key=lambda r: r["step"]) if evals else None
    final = end if end is not None and "val_ppl" in end else last_eval
    state = [r["optimizer_state_bytes"] for r in rows if isinstance(r.get("optimizer_state_bytes"), (int, float))]
    return {
        "dir": str(run), "cfg": cfg, "evals": evals, "finished": end is not None,
        "final_ppl": final["val_ppl"] if final else None, "final_step": final["step"] if final else None,
        "state_bytes": max(state) if state else None,
        "table": (cfg.get("paper") or {}).get("table"),
    }


def _k(step: int) -> str:
    return f"{step // 1000}k" if step % 1000 == 0 and step > 0 else str(step)


def cells_of(run: dict, spec: dict) -> dict[str, tuple[float, int]]:
    """{column label: (perplexity, step)} contributed by one run."""
    cfg, kind = run["cfg"], spec["columns"][0]
    out: dict[str, tuple[float, int]] = {}
    if run["final_ppl"] is None:
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


def build(runs: list[dict]) -> list[dict]:
    """Long-format records, one per (table, row, column) that has ours or the paper's number."""
    by_table: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_table[r["table"] if r["table"] in SPECS else "other"].append(r)
    records = []
    for table in [t for t in SPECS if t in by_table] + (["other"] if "other" in by_table else []):
        if table == "other":
            for r in by_table["other"]:
                opt = r["cfg"].get("optimizer", {})
                records.append(dict(table="other", row=method(opt), column=size_label(r["cfg"]),
                                    ours=r["final_ppl"], paper=None, step=r["final_step"], n=1,
                                    finished=r["finished"], state_gib=_gib(r["state_bytes"]),
                                    paper_state_gib=None, runs=r["dir"]))
            continue
        spec = SPECS[table]
        acc: dict[tuple[str, str], list] = defaultdict(list)
        for r in by_table[table]:
            row = spec["row"](r["cfg"])
            for col, (ppl, step) in cells_of(r, spec).items():
                acc[(row, col)].append((ppl, step, r))
        paper, memory = spec["paper"], spec.get("memory", {})
        rows = list(paper) + [k[0] for k in acc if k[0] not in paper]
        rows = list(dict.fromkeys(rows))
        cols = list(dict.fromkeys([c for v in paper.values() for c in v] + [k[1] for k in acc]))
        for row in rows:
            for col in cols:
                got = acc.get((row, col), [])
                p = paper.get(row, {}).get(col)
                if not got and p is None:
                    continue
                ours = sum(g[0] for g in got) / len(got) if got else None
                states = [g[2]["state_bytes"] for g in got if g[2]["state_bytes"] is not None]
                records.append(dict(
                    table=table, row=row, column=col, ours=ours, paper=p,
                    step=max(g[1] for g in got) if got else None, n=len(got),
                    finished=all(g[2]["finished"] for g in got) if got else None,
                    state_gib=_gib(sum(states) / len(states)) if states else None,
                    paper_state_gib=memory.get(row, {}).get(col),
                    runs=";".join(g[2]["dir"] for g in got)))
    return records


def _gib(b):
    return None if b is None else b / GIB


def _f(x, nd=2):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(records: list[dict]) -> str:
    out = io.StringIO()
    tables = list(dict.fromkeys(r["table"] for r in records))
    for table in tables:
        recs = [r for r in records if r["table"] == table]
        title = SPECS[table]["title"] if table in SPECS else "Runs without a paper table (paper.table unset)"
        has_mem = any(r["paper_state_gib"] is not None or r["state_gib"] is not None for r in recs) \
            and table in SPECS and SPECS[table].get("memory")
        cols = list(dict.fromkeys(r["column"] for r in recs))
        rows = list(dict.fromkeys(r["row"] for r in recs))
        cell = {(r["row"], r["column"]): r for r in recs}
        head = ["method"]
        for c in cols:
            head += [f"{c} ours", f"{c} paper", f"{c} diff"]
            if has_mem:
                head += [f"{c} state GiB ours", f"{c} state GiB paper"]
        out.write(f"### {title}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        for row in rows:
            line = [row]
            for c in cols:
                r = cell.get((row, c))
                if r is None:
                    line += ["", "", ""] + (["", ""] if has_mem else [])
                    continue
                ours = _f(r["ours"])
                if r["ours"] is not None:
                    want = _paper_step(c)
                    if want is not None and r["step"] is not None and r["step"] != want:
                        ours += f" @{r['step']}"
                    if r["finished"] is False:
                        ours += "*"
                    if r["n"] > 1:
                        ours += f" (n={r['n']})"
                diff = _f(r["ours"] - r["paper"], 2) if r["ours"] is not None and r["paper"] is not None else ""
                if diff and not diff.startswith("-"):
                    diff = "+" + diff
                line += [ours, _f(r["paper"]), diff]
                if has_mem:
                    line += [_f(r["state_gib"], 4 if (r["state_gib"] or 1) < 0.01 else 2), _f(r["paper_state_gib"])]
            out.write("| " + " | ".join(line) + " |\n")
        out.write("\n")
    return out.getvalue()


CSV_FIELDS = ["table", "row", "column", "ours", "paper", "diff", "step", "n", "finished",
              "state_gib", "paper_state_gib", "runs"]


def to_csv(records: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in records:
        d = dict(r)
        d["diff"] = (r["ours"] - r["paper"]) if r["ours"] is not None and r["paper"] is not None else None
        w.writerow({k: ("" if d.get(k) is None else d[k]) for k in CSV_FIELDS})
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories, or folders to search for them (multirun dirs)")
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
