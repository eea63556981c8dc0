"""The config keys a run accepts: those its YAML files declare, each once (configs/config.yaml the
sections train, wandb, checkpoint, paper; an option file of configs/<group>/ its node's keys, following
same-group parents in its defaults list; the optimizer's files are written from the frugal registry by
scripts/write_optimizer_configs.py). Nothing lists keys by hand; configs/ composes with plain Hydra.
train.py hands Hydra plain key overrides as force-adds (`force_add_key_overrides`), so an undeclared
key reaches `unknown_keys` and the start-up check names it, its node's valid keys and the closest one.
"""
from __future__ import annotations

import copy
import difflib
import functools
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PRIMARY = CONFIG_DIR / "config.yaml"
_NOT_SECTIONS = ("defaults", "hydra")


def _yaml(path: Path) -> dict:
    """The file's YAML as plain values (a fresh copy: callers may change it)."""
    stat = path.stat()
    return copy.deepcopy(_load_yaml(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=None)
def _load_yaml(path: str, mtime_ns: int, size: int) -> dict:
    """Read once per version of the file: a sweep's check (sweep_check.py) asks for every job."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def option_keys(group: str, option: str) -> list[str]:
    """The keys configs/<group>/<option>.yaml declares, following same-group parents in its
    defaults list."""
    raw = _yaml(CONFIG_DIR / group / f"{option}.yaml")
    keys: dict[str, None] = {}
    for parent in raw.pop("defaults", []):
        if parent == "_self_" or not isinstance(parent, str):  # {override /x: y}: another node's choice
            continue
        if "/" in parent or "@" in parent:
            raise ValueError(f"configs/{group}/{option}.yaml: an option's defaults list may name only options of "
                             f"the same group (e.g. '- frugal'), not {parent!r}")
        keys.update(dict.fromkeys(option_keys(group, parent)))
    keys.update(dict.fromkeys(raw))
    return list(keys)


def primary_sections() -> dict[str, dict]:
    """train, wandb, checkpoint, paper...: the mapping sections configs/config.yaml declares."""
    raw = _yaml(PRIMARY)
    return {k: v for k, v in raw.items() if k not in _NOT_SECTIONS and isinstance(v, dict)}


def _global(group: str) -> bool:
    """Whether the options of `group` are `# @package _global_` presets (experiment/, ...), which
    set keys of other nodes rather than fill one of their own."""
    return any(p.read_text().lstrip().startswith("# @package _global_") for p in (CONFIG_DIR / group).glob("*.yaml"))


def primary_groups() -> list[str]:
    """Config groups whose option fills a node (model, optimizer, ...): configs/config.yaml's
    defaults list, without the global presets (experiment, ...)."""
    groups = []
    for entry in _yaml(PRIMARY).get("defaults", []):
        if isinstance(entry, dict):
            (key,) = entry
            group = key.split("@")[0].removeprefix("override ").strip("/")
            if group != "experiment" and not _global(group):
                groups.append(group)
    return groups


def _choices(cfg: DictConfig) -> dict | None:
    """The option chosen for each group: Hydra's runtime choices of this run, if known."""
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) if "hydra" in cfg else None
    if choices is None:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            choices = HydraConfig.get().runtime.choices
    return dict(choices) if choices is not None else None


def valid_keys(cfg: DictConfig) -> dict[str, list[str]]:
    """{node: its valid keys} for the top level ('') and every section and group node of `cfg`.
    A group's keys are those of the option this run chose; composed without Hydra's runtime
    information, those of any option of the group."""
    sections = primary_sections()
    groups = [g for g in primary_groups() if (CONFIG_DIR / g).is_dir()]
    out = {"": sorted(set(sections) | set(primary_groups()) | {"hydra"})}
    out.update({name: list(values) for name, values in sections.items()})
    choices = _choices(cfg) or {}
    for group in groups:
        chosen = choices.get(group)
        options = [chosen] if chosen else group_options(group)
        keys: dict[str, None] = {}
        for option in options:
            keys.update(dict.fromkeys(option_keys(group, option)))
        out[group] = list(keys)
    return out


def unknown_keys(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """(dotted key, valid keys of its node) for every key of `cfg` that no YAML file declares: keys
    forced in with `+`/`++` (train.py forces plain key overrides too) or set by a preset. The top
    level and one level below it are checked (`paper.steps` maps model names: any key)."""
    valid = valid_keys(cfg)
    found = [(key, valid[""]) for key in cfg if key not in valid[""]]
    for node, keys in valid.items():
        if node and isinstance(cfg.get(node), DictConfig):
            found += [(f"{node}.{k}", keys) for k in cfg[node] if k not in keys]
    return found


def closest(key: str, valid: list[str]) -> str | None:
    """The valid key nearest to `key`'s last component (difflib), if any is close."""
    match = difflib.get_close_matches(key.rpartition(".")[2], valid, n=1, cutoff=0.6)
    return match[0] if match else None


def did_you_mean(near: str | None) -> str:
    return f" (did you mean {near}?)" if near else ""


def unknown_key_line(key: str, valid: list[str], what: str = "a config key") -> str:
    """The one line for a dotted `key` that is not in its node (train.py's config, eval.py's checkpoint
    config): the closest valid key, with its section, and the node's valid keys."""
    section, _, _ = key.rpartition(".")
    near = closest(key, valid)
    return (f"{key} is not {what}{did_you_mean(f'{section}.{near}' if near and section else near)}; "
            f"valid keys of {section or 'the top level'}: {', '.join(valid)}")


_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


def _declared_by_every_option(node: str) -> set[str]:
    """Keys node `node` has whichever option fills it (a section's keys; for a group, the keys every
    option of the group declares); empty for what is neither."""
    sections = primary_sections()
    if node in sections:
        return set(sections[node])
    if node not in primary_groups() or not (CONFIG_DIR / node).is_dir():
        return set()
    options = [set(option_keys(node, option)) for option in group_options(node)]
    return set.intersection(*options) if options else set()


_SWEEP_FUNCTIONS = ("choice(", "range(", "interval(", "glob(", "tag(", "sort(", "shuffle(", "${")


def bad_group_choice(argv: list[str]) -> str | None:
    """One line for the first override of argv (a sweep's values too) that chooses an option a config
    group does not have (`group_option_error`), else None. Checked before Hydra composes anything
    (Hydra's own error is 17 lines, exit 1), so a sweep with a bad value stops before its first job."""
    for arg in argv:
        if "=" not in arg or arg.startswith(("-", "~")):
            continue
        key, value = arg.lstrip("+").split("=", 1)
        group = CONFIG_DIR / key
        if key.split("/")[0] == "hydra" or not _KEY_OR_GROUP.fullmatch(key) or not group.is_dir():
            continue
        options = group_options(key)
        if not options or value.startswith(_SWEEP_FUNCTIONS) or value in ("null", ""):
            continue
        for choice in value.split(","):
            choice = choice.strip()
            if choice and choice not in options:
                return group_option_error(key, choice)
    return None


def group_options(group: str) -> list[str]:
    """The options of configs/<group>/ (its YAML files), sorted."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def group_option_error(group: str, option: str) -> str:
    """The one line for an option configs/<group>/ does not have: the closest and the valid options."""
    options = group_options(group)
    near = closest(option, options)
    return (f"{group}={option!r} is not an option of configs/{group}/{did_you_mean(near)}; "
            f"valid options: {', '.join(options)}")


_KEY_OR_GROUP = re.compile(r"[A-Za-z_][\w-]*(/[\w-]+)*")


def force_add_key_overrides(argv: list[str]) -> list[str]:
    """train.py's command line with every plain key override that might name an undeclared key written as
    a force-add (`++optimizer.densty=0.3`), so `unknown_keys` reports it (exit 2) instead of Hydra's
    advice to append it with `+`. Keys every option of the node has, group choices, `hydra.*`, `+`, `++`,
    `~` overrides and flags (with their values) are left as they are."""
    groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
    takes_value = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
                   "-cd", "--config-dir", "--experimental-rerun"}
    declared: dict[str, set[str]] = {}
    out, after_flag = [], False
    for arg in argv:
        key = arg.split("=", 1)[0]
        plain = not after_flag and "=" in arg and not arg.startswith(("-", "+", "~")) and _KEY.fullmatch(key)
        if plain and key.split(".")[0] != "hydra":
            node, _, rest = key.partition(".")
            if rest:
                known = declared.setdefault(node, _declared_by_every_option(node))
                if rest.split(".")[0] not in known:
                    arg = "++" + arg
            elif node not in groups and node not in primary_sections():
                arg = "++" + arg
        after_flag = arg in takes_value
        out.append(arg)
    return out
