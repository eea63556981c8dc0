"""Runs as records: what train.py left in each run directory (`metrics.jsonl`, `.hydra/`), read one way
by every program that reports on runs (scripts/make_tables.py, sweep_view.py, plot_runs.py,
ops/sweep_status.py) and for a table of your own (docs/results.md):

    for run in load_runs(["multirun/table15"]):
        print(run["swept"], run["density_realised"], run["final_ppl"], run["state_bytes"])
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from train_utils.naming import parse_overrides

IGNORED_KEYS = ("experiment",)  # a different preset is a different table already
NAME_KEYS = ("paper", "wandb")  # what a run is called and filed under, not what it trains


def load_runs(paths: list[str], tool: str = "load_runs") -> list[dict]:
    """Every run at or below `paths` (directories holding metrics.jsonl, searched recursively), one record
    each (`load_run`), with `swept`: {key: value} of the override keys the runs differ in (what a sweep
    varied), the same keys for every run; a number or a flag as such, any other value as text."""
    runs = [load_run(d) for d in find_runs(paths, tool)]
    swept = swept_keys(runs)
    for r in runs:
        r["swept"] = {k: _typed(r, k) for k in swept}
    return runs


def _typed(run: dict, key: str):
    try:
        value = None if key in run["choices"] else OmegaConf.select(run["conf"], key, default=None)
    except Exception:  # an interpolation that only resolves inside a live run
        value = None
    return value if isinstance(value, (int, float, bool)) else effective_value(run, key)


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
    unique: dict = {}
    for r in runs:
        unique.setdefault(r.resolve(), r)
    return list(unique.values())


def evaluations(rows: list[dict]) -> dict[int, dict]:
    """{step: evaluation row} of a run's metrics rows (a step evaluated twice, after a resume: the later)."""
    return {r["step"]: r for r in rows if "val_ppl" in r and r.get("event") in (None, "end")}


def final_evaluation(rows: list[dict]) -> dict | None:
    """The run's final evaluation: its `end` row where that has one, else its evaluation of the latest step."""
    end = next((r for r in reversed(rows) if r.get("event") == "end"), None)
    if end is not None and "val_ppl" in end:
        return end
    evals = evaluations(rows)
    return evals[max(evals)] if evals else None


def load_run(run: Path) -> dict:
    """One run directory as a record: `dir`; `overrides` (its command line, {key: text}); `cfg` (the saved
    config, unresolved), `conf` (the same as OmegaConf), `config` (resolved where it resolves here);
    `choices` (Hydra's group options), `option`, `model`, `table` (paper.table), `debug` (debug=toy);
    `start` (the start row), `density_realised`, `density_blocks` (k, L state-full blocks); `evals`
    ({step: eval row}), `final_ppl`, `final_loss`, `final_step`, `finished` (an end row); `state_bytes`
    (the largest measured optimizer state); `eval_mode` (how its perplexities were computed)."""
    hydra_dir = Path(run) / ".hydra"
    if not (hydra_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run}: no .hydra/config.yaml (was it written by train.py?)")
    conf = OmegaConf.load(hydra_dir / "config.yaml")
    cfg = OmegaConf.to_container(conf, resolve=False)
    try:
        config = OmegaConf.to_container(conf, resolve=True)
    except OmegaConfBaseException:  # an interpolation that resolves only inside a live run
        config = cfg
    choices = {}
    if (hydra_dir / "hydra.yaml").is_file():
        choices = OmegaConf.to_container(OmegaConf.load(hydra_dir / "hydra.yaml").hydra.runtime.choices)
    overrides = {}
    if (hydra_dir / "overrides.yaml").is_file():
        overrides = parse_overrides(OmegaConf.to_container(OmegaConf.load(hydra_dir / "overrides.yaml")))
    from train_utils.metrics import read_metrics  # it imports torch: not at import (ops/sweep_status.py stays quick)

    rows = read_metrics(str(Path(run) / "metrics.jsonl"))
    final = final_evaluation(rows)
    state = [r["optimizer_state_bytes"] for r in rows if isinstance(r.get("optimizer_state_bytes"), (int, float))]
    start = next((r for r in rows if r.get("event") == "start"), None) or {}
    blocks = start.get("density_blocks")
    return {
        "dir": str(run), "cfg": cfg, "conf": conf, "config": config, "choices": choices, "overrides": overrides,
        "evals": evaluations(rows),
        "finished": any(r.get("event") == "end" for r in rows), "final_ppl": final and final["val_ppl"],
        "final_loss": final and final.get("val_loss"), "final_step": final and final["step"],
        "state_bytes": max(state) if state else None, "table": (cfg.get("paper") or {}).get("table"),
        "option": choices.get("optimizer") or (cfg.get("optimizer") or {}).get("name"),
        "model": (cfg.get("model") or {}).get("name"), "start": start or None,
        "density_realised": start.get("density_realised"),
        "density_blocks": tuple(blocks) if isinstance(blocks, (list, tuple)) and len(blocks) == 2 else None,
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


def effective_value(run: dict, key: str) -> str:
    """What `key` was in the run: the group option chosen, else the config value, else the override."""
    if key in run["choices"]:
        return str(run["choices"][key])
    value = _config_value(run, key)
    return run["overrides"].get(key, "") if value is _ABSENT or value is None else _text(value)


def swept_keys(runs: list[dict]) -> list[str]:
    """Override keys whose value differs between `runs` (in first-seen order)."""
    keys = list(dict.fromkeys(k for r in runs for k in r["overrides"] if k not in IGNORED_KEYS))
    return [k for k in keys if len({effective_value(r, k) for r in runs}) > 1]


_ABSENT = object()


def _config_value(run: dict, key: str):
    """The run's resolved config value of `key`, or _ABSENT (no such key, or an interpolation that only
    resolves inside a live run)."""
    try:
        return OmegaConf.select(run["conf"], key, default=_ABSENT)
    except Exception:
        return _ABSENT


def _text(value) -> str:
    return str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value).replace("'", "")


def lookup(run: dict, key: str) -> str | None:
    """The run's value of `key` as text (the group option chosen, else the config value, "null" for a
    null), None when the run has no such key at all."""
    if key in run["choices"]:
        return str(run["choices"][key])
    value = _config_value(run, key)
    if value is _ABSENT:
        return run["overrides"].get(key)
    return "null" if value is None else _text(value)


def number(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def num_text(x: float) -> str:
    return f"{round(x, 4):g}"


def same_value(a, b) -> bool:
    """Two spellings of one value: 0.001 and 1e-3, False and false."""
    na, nb = number(a), number(b)
    if na is not None and nb is not None:
        return num_text(na) == num_text(nb)
    return str(a).lower() == str(b).lower()


def asked_value(run: dict, key: str) -> tuple[str | None, str | None]:
    """(the run's saved-config value of `key`, the command line's request where that differs: debug=toy
    writes the values it trains with into the config, the request stays in overrides.yaml)."""
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
    realised (its blocks' density; "no switch"): two runs with the same text trained the same thing."""
    cfg = json.loads(json.dumps(run["config"], default=str))
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
    """{run dir: group number 1, 2, ...} for runs that are one run repeated (same realised_config, as
    debug=toy makes them); runs without a twin are not in the result."""
    groups: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        groups[realised_config(r)].append(r["dir"])
    twins = [dirs for dirs in groups.values() if len(dirs) > 1]
    return {d: i for i, dirs in enumerate(twins, 1) for d in dirs}
