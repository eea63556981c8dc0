"""debug=toy keeps a sweep's meaning: the update gaps fitted to the toy run's length (docs/reproducing.md).

A run of S steps switches its subspace (S - 1) // T times, so at toy length (200 steps) the paper's
T = 200..1000 would never switch. Every gap of the sweep becomes ceil(T / k), k the smallest whole
factor with which the sweep's largest gap switches at least twice (ceil(T_max / k) <= (S - 1) // 2;
k = 1 when it already does); if two distinct gaps would meet, k is lowered until they stay apart and
the run lengthened to 2 x (largest toy gap) + 1 steps (not when train.steps is on the command line).
The sweep is the launch's optimizer.update_gap values (preset params overlaid by the command line's)
with this run's own; a preset's single run takes the preset's sweep. Table 15 (T = 10..1000): k = 11,
toy gaps 1, 2, 5, 10, 19, 46, 91; a lone T = 200: k = 3, 67. The main process writes the toy values
into `.hydra/config.yaml` (what scripts/make_tables.py labels rows from) and the console says them.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train_utils.naming import _hydra, _select, debug_option, launch_sweep, parse_overrides

SWITCHES = 2  # every toy run with an update gap changes its state-full subspace at least this often
GAP_KEY = "optimizer.update_gap"


def switches(steps: int, gap: int) -> int:
    """How often a run of `steps` steps changes its subspace with update gap `gap` (windows step // gap
    of steps 0 .. steps - 1, the first window not counted)."""
    return max(steps - 1, 0) // gap


def toy_gaps(gaps, steps: int, steps_fixed: bool = False) -> tuple[int, dict[int, int], int]:
    """(k, {gap: toy gap}, the run's steps) for the update gaps `gaps` of a sweep in a run of `steps`
    steps (the module docstring's rule); `steps_fixed`: the run's length may not grow."""
    gaps = sorted(set(gaps))
    room = max(steps - 1, 0) // SWITCHES  # the largest gap that switches SWITCHES times
    k = max(1, math.ceil(gaps[-1] / room)) if room else 1
    while k > 1 and len({math.ceil(g / k) for g in gaps}) < len(gaps):
        k -= 1
    mapping = {g: math.ceil(g / k) for g in gaps}
    if not steps_fixed:
        steps = max(steps, SWITCHES * mapping[gaps[-1]] + 1)
    return k, mapping, steps


def swept_gaps(hydra_cfg) -> list[int]:
    """optimizer.update_gap's whole-number values in the sweep of this run: the launch's (multirun.yaml
    in the sweep dir) in a multirun job, the preset's `hydra.sweeper.params` in a single run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task, params = launch_sweep(hydra_cfg)
    parser = OverridesParser.create()
    values: list = []
    for line in [f"{k}={v}" for k, v in params.items()] + [str(t) for t in task]:
        override = parser.parse_override(line)
        if override.key_or_group != GAP_KEY:
            continue
        try:
            values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                      else [override.get_value_element_as_str()])  # the last one of the key wins, as in Hydra
        except Exception:  # noqa: BLE001 - a sweep of no listable values (interval): nothing to scale by
            values = []
    out = []
    for v in values:
        try:
            out.append(int(str(v)))
        except ValueError:
            continue
    return [v for v in out if v > 0]


def fit(cfg: DictConfig, hydra_cfg=None) -> dict:
    """Under debug=toy, set `cfg`'s update gap (and max_update_gap, and train.steps where the rule
    lengthens the run) to the toy run's. Returns {"changed": {key: (asked, toy)}, "k": k, "gaps": the
    sweep's {gap: toy gap}} when anything changed, else {} (always outside debug=toy)."""
    hc = _hydra(hydra_cfg)
    if hc is None or debug_option(hc) != "toy":
        return {}
    own = OmegaConf.select(cfg, GAP_KEY, default=None)
    steps = cfg.train.steps
    if isinstance(own, bool) or not isinstance(own, int) or own < 1 or not isinstance(steps, int):
        return {}
    fixed = "train.steps" in parse_overrides(OmegaConf.select(hc, "overrides.task", default=None) or [])
    k, mapping, toy_steps = toy_gaps(swept_gaps(hc) + [own], steps, steps_fixed=fixed)
    changes: dict[str, tuple] = {}
    if mapping[own] != own:
        changes[GAP_KEY] = (own, mapping[own])
        cfg.optimizer.update_gap = mapping[own]
        most = OmegaConf.select(cfg, "optimizer.max_update_gap", default=None)
        if isinstance(most, int) and not isinstance(most, bool):
            changes["optimizer.max_update_gap"] = (most, math.ceil(most / k))
            cfg.optimizer.max_update_gap = math.ceil(most / k)
    if toy_steps != steps:
        changes["train.steps"] = (steps, toy_steps)
        cfg.train.steps = toy_steps
    return {"changed": changes, "k": k, "gaps": mapping} if changes else {}


def notes(fitted: dict, steps: int) -> list[str]:
    """The console's lines for what `fit` changed (`fitted`, its result) in a run of `steps` steps."""
    if not fitted:
        return []
    changes, gaps, k = fitted["changed"], fitted["gaps"], fitted["k"]
    lines = []
    if GAP_KEY in changes:
        asked, toy = changes[GAP_KEY]
        swept = ", ".join(map(str, gaps)) + " -> " + ", ".join(map(str, gaps.values()))
        n = switches(steps, toy)
        lines.append(f"debug=toy: optimizer.update_gap={asked} runs as {toy}: the state-full subspace switches "
                     f"{n} time{'' if n == 1 else 's'} in {steps} steps (the sweep's gaps divided by {k}, rounded "
                     f"up: {swept}; train_utils/toy.py)")
    if "train.steps" in changes:
        asked, toy = changes["train.steps"]
        lines.append(f"debug=toy: train.steps={asked} runs as {toy}, so that the largest update gap of the sweep "
                     f"({max(gaps.values())}) switches {SWITCHES} times while distinct gaps stay distinct")
    return lines


def record(cfg: DictConfig, fitted: dict, hydra_cfg=None) -> None:
    """Write what the toy run trains into its saved config (`<run dir>/.hydra/config.yaml`): `fit`'s
    values and the model's shape, resolved. Main process only; nothing without that file."""
    subdir, out = _select(hydra_cfg, "output_subdir"), _select(hydra_cfg, "runtime.output_dir")
    if debug_option(hydra_cfg) != "toy" or not subdir or not out:
        return
    path = Path(str(out)) / str(subdir) / "config.yaml"
    if not path.is_file():
        return
    saved = OmegaConf.load(path)
    for key in (fitted or {}).get("changed", {}):
        OmegaConf.update(saved, key, OmegaConf.select(cfg, key), merge=False)
    OmegaConf.update(saved, "model", OmegaConf.to_container(cfg.model, resolve=True), merge=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    OmegaConf.save(saved, tmp)
    os.replace(tmp, path)


def apply(cfg: DictConfig, write: bool) -> list[str]:
    """train()'s hook: `fit` the run under debug=toy, `record` it when `write` (the main process);
    returns the console's notes."""
    fitted = fit(cfg)
    if write:
        record(cfg, fitted)
    return notes(fitted, cfg.train.steps)
