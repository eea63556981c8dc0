"""The config schema: every key a run accepts, generated from the YAML defaults and the optimizer registry.

A plain YAML node accepts any key forced in with `+key=value`, so a typo such as `+train.stepz=10`
would be accepted and ignored. `register()` (called when `train_utils` is imported) puts one closed,
structured node per config section into Hydra's ConfigStore, generated from what declares the section:

    schema/sections                 train, wandb, checkpoint, paper: the sections of configs/config.yaml
    schema/model/<option>           configs/model/<option>.yaml     (likewise schema/data/, schema/schedule/)
    schema/optimizer/<entry>        every key `frugal.registry.defaults(entry)` lists, with its default

configs/config.yaml places each under the YAML that fills it (its defaults list), and every
configs/optimizer/<option>.yaml starts from its registry entry, so an option file only says what it
changes and every key the optimizer takes is settable without `+`. Declaring a key in the YAML (or in
the registry) is all it takes to add one: nothing here lists keys by hand. An option is therefore a
file in configs/<group>/ (the schema is generated from that directory when train_utils is imported).

Two checks follow. Hydra rejects a preset or option file that sets an undeclared key (a structured
node is closed to merges); `unknown_keys(cfg)` finds what was forced in with `+` or `++` on the
command line (Hydra's force-add also opens closed nodes), for the start-up check to report with the
section's valid keys. The generated classes are attributes of this module so that composed configs
pickle (the submitit launchers pickle them) and unpickle wherever the repository is importable.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PRIMARY = CONFIG_DIR / "config.yaml"
OPTION_GROUPS = ("model", "schedule", "data")  # groups whose options are plain YAML files
OPTIMIZER_GROUP = "optimizer"
_NOT_SECTIONS = ("defaults", "hydra")


def _structured(type_name: str, values: dict) -> type:
    """A dataclass with one field per key, defaulting to the value (interpolations stay as text)."""
    fields = [(key, Any, dataclasses.field(default_factory=functools.partial(copy.deepcopy, value)))
              for key, value in values.items()]
    cls = dataclasses.make_dataclass(type_name, fields)
    cls.__module__, cls.__qualname__ = __name__, type_name
    globals()[type_name] = cls  # picklable by reference: train_utils.schema.<type_name>
    return cls


def _type_name(group: str, option: str) -> str:
    return re.sub(r"\W", "_", f"{group}__{option}")


def _yaml(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def _option_values(group: str, option: str) -> dict:
    """The keys an option file declares, following parents named in its own defaults list."""
    raw = _yaml(CONFIG_DIR / group / f"{option}.yaml")
    merged: dict = {}
    for parent in raw.pop("defaults", []):
        if parent == "_self_":
            continue
        if not isinstance(parent, str) or "/" in parent or "@" in parent:
            raise ValueError(f"configs/{group}/{option}.yaml: the schema generator follows only parents of the "
                             f"same group in the defaults list (e.g. '- c4'), not {parent!r}")
        merged.update(_option_values(group, parent))
    merged.update(raw)
    return merged


def primary_sections() -> dict[str, dict]:
    """train, wandb, checkpoint, paper...: the mapping sections configs/config.yaml declares."""
    raw = _yaml(PRIMARY)
    return {k: v for k, v in raw.items() if k not in _NOT_SECTIONS and isinstance(v, dict)}


def primary_groups() -> list[str]:
    """Config groups chosen in configs/config.yaml's defaults list (model, optimizer, ...), not schema/."""
    groups = []
    for entry in _yaml(PRIMARY).get("defaults", []):
        if isinstance(entry, dict):
            (key,) = entry
            group = key.split("@")[0].removeprefix("override ").strip("/")
            if not group.startswith("schema") and group != "experiment":
                groups.append(group)
    return groups


def optimizer_schema(entry: str) -> dict:
    """Every key registry entry `entry` takes, with its default; the subspace seed follows the run's."""
    from frugal import registry

    values = {"name": entry}
    for key, value in registry.defaults(entry).items():
        values[key] = list(value) if isinstance(value, tuple) else value
    if "seed" in values:
        values["seed"] = "${train.seed}"
    return values


def register() -> None:
    """Store the schema nodes in Hydra's ConfigStore (idempotent: a second call stores them again)."""
    from hydra.core.config_store import ConfigStore

    from frugal import OPTIMIZERS

    store = ConfigStore.instance()
    sections = {name: _structured(_type_name("section", name), values)
                for name, values in primary_sections().items()}
    store.store(group="schema", name="sections", node=sections)
    for group in OPTION_GROUPS:
        for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
            node = _structured(_type_name(group, path.stem), _option_values(group, path.stem))
            store.store(group=f"schema/{group}", name=path.stem, node=node)
    for entry in OPTIMIZERS:
        node = _structured(_type_name(OPTIMIZER_GROUP, entry), optimizer_schema(entry))
        store.store(group=f"schema/{OPTIMIZER_GROUP}", name=entry, node=node)


def unknown_keys(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """(dotted key, valid keys of its section) for every key of `cfg` that no YAML file or registry
    entry declares: keys forced in with `+`/`++`. Sections built without the schema are skipped."""
    root = set(primary_sections()) | set(primary_groups()) | {"hydra"}
    found = [(key, sorted(root)) for key in cfg if key not in root]
    for key in cfg:
        cls = OmegaConf.get_type(cfg, key)
        if dataclasses.is_dataclass(cls):
            valid = [f.name for f in dataclasses.fields(cls)]
            found += [(f"{key}.{k}", valid) for k in cfg[key] if k not in valid]
    return found
