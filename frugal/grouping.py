"""Which parameters FRUGAL may split, and which block (layer) each belongs to (docs/library.md, "Inputs").

The paper (Section 5, Appendix D) splits only the 2-D weights of the attention and MLP projections
inside transformer blocks. Embeddings, norms, biases and the output head stay state-full and are
never reset (Table 4: they suffer most from a state-free update); a state-full rule defined only for
weight matrices (Muon) gives them AdamW where the groups are built from a model (`StateFullRule.rest`).

Blocks are found from the module structure, so no model family needs its own names:

- a *block list* is an `nn.ModuleList` or `nn.Sequential` of at least two children of one class, each
  holding a matrix weight; only the outermost lists count (experts belong to their layer).
- a *matrix weight* is the 2-D weight of an `nn.Linear`, of transformers' `Conv1D` (stored (in, out):
  `transposed=True`; matched by class name, transformers is never imported) or an
  `nn.MultiheadAttention` input projection. The projectable tensors are those inside block lists.
- blocks are numbered in module order across all block lists (T5: encoder 0..E-1, then decoder), so
  `block_order="descending"` starts at the layer nearest the output.

`target_modules` (as in PEFT / galore-torch) overrides the projectable set: a list of names matches a
module whose qualified name equals one or ends with `"." + name`; a string is a regular expression
matched against the whole qualified name. Every matrix weight in or below a match is projectable; one
outside any block list is a block of its own, numbered after the layers. `resolve_params` is what
`FRUGAL(params)` does with its first argument: the obvious calls do FRUGAL, or warn loudly why not.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .rules import STATE_FULL

# The kinds a caller may move wholly to the state-free rule (Table 4 of the paper).
STATE_FREE_MODULE_CHOICES = ("embeddings", "norms", "output")
# Param-group keys that FRUGAL reads; a group carrying any of them was split by its author.
FRUGAL_GROUP_KEYS = ("projectable", "block", "transposed", "always_state_free")


# Name rules for the kinds of non-projectable tensors, a fallback where the module class does not
# tell (first match wins). The optional prefix lets wrapped models (`_orig_mod.`) keep working.
_PREFIX = r"(?:^|.*\.)"
_KIND_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(_PREFIX + r"(?:embed_tokens|wte|wpe|embed_positions)\.weight$"), "embeddings"),
    (re.compile(_PREFIX + r"(?:[A-Za-z_]*norm|ln_\w+)\.(?:weight|bias)$"), "norms"),
    (re.compile(_PREFIX + r"lm_head\.weight$"), "output"),
    (re.compile(r".*\.bias$|^bias$"), "bias"),
]
# transformers' GPT-2-family Conv1D weights, for callers that give names but no modules.
_CONV1D_NAME = re.compile(r"(?:^|\.)(?:c_attn|q_attn|c_proj|c_fc)\.weight$")


@dataclass
class TensorRole:
    """What FRUGAL does with one trainable tensor: `block` is None unless it is projectable."""
    name: str
    param: torch.Tensor
    kinds: frozenset[str]  # subset of embeddings, norms, output, bias
    block: int | None = None
    transposed: bool = False


# ---- the module structure ----------------------------------------------------------------------
def _matrix_weights(module: nn.Module) -> list[tuple[str, bool]]:
    """(attribute, transposed) of the matrix weights `module` holds itself."""
    if isinstance(module, nn.Linear):
        return [("weight", False)]
    if type(module).__name__ == "Conv1D":
        return [("weight", True)]
    if isinstance(module, nn.MultiheadAttention):  # its out_proj is an nn.Linear child
        return [(a, False) for a in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")]
    return []


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    children = list(module)
    return (len({type(c) for c in children}) == 1
            and all(any(_matrix_weights(m) for m in c.modules()) for c in children))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _ancestors(name: str) -> list[str]:
    """`name` and every enclosing module name, innermost first ("" is the model itself)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def block_lists(model: nn.Module) -> list[str]:
    """Qualified names of the outermost block lists of `model`, in module order."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(a in found for a in _ancestors(name)[1:]):
            continue
        if _is_block_list(module):
            found.append(name)
    return found


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model`, in module order (the children of its block lists): the one
    rule for FRUGAL's blocks, FSDP2 units, compiled and recomputed modules and the memory planner.
    Raises ValueError when the model has no block list."""
    blocks = [child for name in block_lists(model) for child in model.get_submodule(name).children()]
    if not blocks:
        raise ValueError(f"found no transformer blocks in {type(model).__name__}: no nn.ModuleList or "
                         "nn.Sequential of at least two layers of one class, each holding an nn.Linear / Conv1D "
                         "weight")
    return blocks


def _target_matcher(target_modules):
    if target_modules is None:
        return None
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as err:
            raise ValueError(f"Invalid target_modules regular expression {target_modules!r}: {err}") from None
        return lambda name: pattern.fullmatch(name) is not None
    targets = tuple(target_modules)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"Invalid target_modules {target_modules!r}: expected module names "
                         "(e.g. ['q_proj', 'v_proj']) or one regular expression")
    return lambda name: any(name == t or name.endswith("." + t) for t in targets)


def _kind(name: str, module: nn.Module, output: nn.Module | None) -> str | None:
    if output is not None and module is output:
        return "output"
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if "norm" in type(module).__name__.lower():
        return "norms"
    for pattern, kind in _KIND_RULES:
        if pattern.match(name):
            return kind
    return None


def module_roles(model: nn.Module, target_modules=None) -> list[TensorRole]:
    """The role of every trainable tensor of `model` (tied tensors once), in parameter order."""
    matches = _target_matcher(target_modules)
    lists = block_lists(model)
    unit: dict[str, int] = {}  # block-list child -> block index
    for list_name in lists:
        for child in model.get_submodule(list_name).named_children():
            unit[_join(list_name, child[0])] = len(unit)

    weights: dict[str, tuple[int, bool]] = {}  # qualified weight name -> (block, transposed)
    matched_any = False
    for name, module in model.named_modules():
        attrs = _matrix_weights(module)
        if not attrs:
            continue
        ancestors = _ancestors(name)
        block = next((unit[a] for a in ancestors if a in unit), None)
        if matches is not None:
            if not any(matches(a) for a in ancestors if a):
                continue
            matched_any = True
            if block is None:  # a targeted matrix outside the layers: a block of its own
                block = len(unit)
                unit[name] = block
        if block is None:
            continue
        for attr, transposed in attrs:
            p = getattr(module, attr, None)
            if isinstance(p, nn.Parameter) and p.dim() == 2 and p.is_floating_point():
                weights[_join(name, attr)] = (block, transposed)
    if matches is not None and not matched_any:
        examples = [n for n, m in model.named_modules() if _matrix_weights(m)][:6]
        raise ValueError(f"target_modules {target_modules!r} matched no nn.Linear / Conv1D module of "
                         f"{type(model).__name__}; its matrix modules are named like {examples}")

    get_output = getattr(model, "get_output_embeddings", None)  # transformers' API, duck-typed
    output = get_output() if callable(get_output) else None
    roles: dict[int, TensorRole] = {}
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        kind = None if name in weights else _kind(name, module, output) or "other"
        role = roles.setdefault(id(param), TensorRole(name, param, frozenset()))
        names_of.setdefault(id(param), []).append(name)
        if kind is not None:
            role.kinds = role.kinds | {kind}
    for key, role in roles.items():
        # A tied tensor is projectable only if every name it is reachable by is a matrix weight.
        if not role.kinds:
            role.block, role.transposed = weights[names_of[key][0]]
        role.kinds = role.kinds - {"other"}
    return list(roles.values())


# ---- building param groups ---------------------------------------------------------------------
def _normalise_state_free_modules(state_free_modules) -> tuple[str, ...]:
    if state_free_modules is None:
        return ()
    if isinstance(state_free_modules, str):
        state_free_modules = (state_free_modules,)
    chosen = tuple(str(m) for m in state_free_modules)
    for module in chosen:
        if module not in STATE_FREE_MODULE_CHOICES:
            raise ValueError(
                f"Unknown state_free_modules entry {module!r}; valid choices: "
                f"{sorted(STATE_FREE_MODULE_CHOICES)}"
            )
    return chosen


# The order of the weights in a LLaMA layer of the FRUGAL authors' own model (their utils/modeling_llama.py,
# which their torchrun_main.py builds): the MLP registers gate, down, up; transformers' LlamaMLP registers
# gate, up, down. With block_granularity "tensor" the block walk follows this order (tensor_order).
AUTHORS_TENSOR_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj")
TENSOR_ORDERS = ("module", "authors")


def _in_authors_order(roles: list[TensorRole]) -> list[TensorRole]:
    """`roles` (one block's), with the weights named in AUTHORS_TENSOR_ORDER moved, among the places
    they hold, into that order; every other tensor keeps its place."""
    def leaf(role: TensorRole) -> str:
        parts = role.name.split(".")
        return parts[-2] if len(parts) >= 2 else role.name

    known = [i for i, r in enumerate(roles) if leaf(r) in AUTHORS_TENSOR_ORDER]
    ordered = sorted((roles[i] for i in known), key=lambda r: AUTHORS_TENSOR_ORDER.index(leaf(r)))
    out = list(roles)
    for i, role in zip(known, ordered):
        out[i] = role
    return out


def rest_rule(state_full) -> str | None:
    """The state-full rule of the non-projectable tensors when `state_full` is given to a model
    (`StateFullRule.rest`: a rule defined only for the weight matrices of the layers, Muon), or None where
    they take `state_full` itself. Groups given explicitly are left as they are."""
    rule = STATE_FULL.get(state_full) if isinstance(state_full, str) else None
    return rule.rest[0] if rule is not None and rule.rest else None


def _groups(roles: list[TensorRole], state_free_modules: Iterable[str] = (),
            tensor_order: str = "module", state_full_rule: str | None = None) -> list[dict]:
    if tensor_order not in TENSOR_ORDERS:
        raise ValueError(f"Unknown tensor_order {tensor_order!r}; valid choices: {', '.join(TENSOR_ORDERS)}")
    chosen = set(_normalise_state_free_modules(state_free_modules))
    state_full, state_free = [], []
    in_block: dict[tuple[int, bool], list[TensorRole]] = {}
    for role in roles:
        if role.block is not None:
            in_block.setdefault((role.block, role.transposed), []).append(role)
        elif role.kinds & chosen:
            state_free.append(role.param)
        else:
            state_full.append(role.param)
    by_block = {key: [r.param for r in (_in_authors_order(rs) if tensor_order == "authors" else rs)]
                for key, rs in in_block.items()}
    groups: list[dict] = []
    if state_full:
        rest = rest_rule(state_full_rule)
        groups.append({"params": state_full, "projectable": False, **({"state_full": rest} if rest else {})})
    for (block, transposed), params in sorted(by_block.items(), key=lambda kv: kv[0]):
        groups.append({"params": params, "projectable": True, "block": block, "transposed": transposed})
    if state_free:
        groups.append({"params": state_free, "projectable": False, "always_state_free": True})
    return groups


_REMEDY = ("FRUGAL splits the 2-D weights inside transformer blocks, found in a model as an "
           "nn.ModuleList or nn.Sequential of at least two layers of one class (in plain tensors: 2-D "
           "shapes that repeat layer after layer). Name the modules to split with "
           "frugal.param_groups(model, target_modules=[...]) (names as in PEFT, or one regular expression), "
           "or pass the groups yourself: FRUGAL([{'params': [...], 'projectable': True, 'block': i}, ..., "
           "{'params': [embeddings, norms, head]}])")


def param_groups(model: nn.Module, state_free_modules: Iterable[str] = (),
                 target_modules=None, tensor_order: str = "module", state_full: str | None = None) -> list[dict]:
    """Split `model`'s trainable parameters into FRUGAL param groups, in this order (empty ones omitted):
    the non-projectable tensors (state-full, never reset); one group per block N (`projectable=True,
    block=N`, `transposed=True` for Conv1D weights, so every weight reads as (out, in)); and one
    `always_state_free=True` group of the kinds in `state_free_modules` ("embeddings", "norms", "output":
    Table 4). `target_modules`: module docstring. `tensor_order`: the order the ``block_granularity=
    "tensor"`` walk follows: "module" or "authors" (AUTHORS_TENSOR_ORDER). `state_full`: the optimizer's
    rule; one with `StateFullRule.rest` (Muon) gives the non-projectable group that rule (AdamW).
    Tied parameters are listed once, with every kind of the names they are reachable by (state-free if
    any is listed); `requires_grad=False` ones are left out. Raises ValueError for unknown
    `state_free_modules` entries, target_modules that match nothing, and no projectable weight.
    """
    groups = _groups(module_roles(model, target_modules), state_free_modules, tensor_order, state_full)
    if not any(group["projectable"] for group in groups):
        raise ValueError(f"No projectable weights found in {type(model).__name__}. {_REMEDY}")
    return groups


# ---- FRUGAL(params): the obvious calls ---------------------------------------------------------
def _repeating_run(shapes: list[tuple]) -> tuple[int, int, int] | None:
    """(start, period, repeats >= 2) of the stretch of `shapes` that repeats with a fixed period and
    covers the most entries; ties go to the shorter period, then the earlier start."""
    best, best_key = None, None
    n = len(shapes)
    for period in range(1, n // 2 + 1):
        run = 0
        for j in range(n - period + 1):
            if j < n - period and shapes[j] == shapes[j + period]:
                run += 1
                continue
            repeats = (run + period) // period
            if repeats >= 2:
                key = (repeats * period, -period, -(j - run))
                if best_key is None or key > best_key:
                    best, best_key = (j - run, period, repeats), key
            run = 0
    return best


def _matrix_like(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.is_floating_point() and t.requires_grad


def _blocks_from_shapes(tensors: list[torch.Tensor]) -> tuple[dict[int, tuple[int, bool]], str]:
    """Plain tensors: the longest stretch of 2-D tensors whose shapes repeat with a fixed period
    is taken for the transformer layers (one period = one layer). Parameter lists follow module
    order, so embeddings come before that stretch and the output head after it."""
    positions = [i for i, t in enumerate(tensors) if _matrix_like(t)]
    run = _repeating_run([tuple(tensors[i].shape) for i in positions])
    if run is None:
        return {}, ""
    start, period, repeats = run
    picked = {id(tensors[positions[start + k]]): (k // period, False) for k in range(period * repeats)}
    return picked, (f"the longest stretch of 2-D tensors whose shapes repeat every {period} tensors, "
                    f"taken for {repeats} transformer layers, every weight read as (out, in) like nn.Linear")


def _blocks_from_names(names: list[str], tensors: list[torch.Tensor]) -> tuple[dict[int, tuple[int, bool]], str]:
    """Named tensors: `<prefix>.<i>.<rest>` with at least two indices i under one prefix is a block
    list; a 2-D `...weight` whose `rest` occurs with the same shape in at least two of its blocks is
    projectable (so a layer-0-only relative position bias, or a narrower last layer, is not)."""
    parsed: list[tuple[str, int, tuple] | None] = []  # (prefix, index, (rest, shape))
    for name, t in zip(names, tensors):
        parts = name.split(".")
        i = next((k for k, part in enumerate(parts[:-1]) if part.isdigit()), None)
        ok = i is not None and _matrix_like(t) and name.endswith("weight")
        parsed.append((".".join(parts[:i]), int(parts[i]), (".".join(parts[i + 1:]), tuple(t.shape)))
                      if ok else None)
    indices: dict[str, set[int]] = {}
    rests: dict[tuple[str, tuple], set[int]] = {}
    for entry in filter(None, parsed):
        indices.setdefault(entry[0], set()).add(entry[1])
        rests.setdefault((entry[0], entry[2]), set()).add(entry[1])
    lists = [p for p in indices if len(indices[p]) >= 2]
    offset, start = 0, {}
    for prefix in lists:
        start[prefix], offset = offset, offset + max(indices[prefix]) + 1
    picked = {}
    for name, t, entry in zip(names, tensors, parsed):
        if entry and entry[0] in start and len(rests[(entry[0], entry[2])]) >= 2:
            picked[id(t)] = (start[entry[0]] + entry[1], bool(_CONV1D_NAME.search(name)))
    return picked, (f"the 2-D weights repeated in the numbered layers of {lists or 'no layer list'} "
                    "(GPT-2's c_attn/c_proj/c_fc read as Conv1D, others as nn.Linear)")


def _params_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _split_groups(groups: list[dict], what: str) -> list[dict]:
    """Split groups without FRUGAL keys (plain or named tensors) into projectable blocks and the
    rest, keeping each group's own settings (e.g. HF Trainer's weight_decay) on its parts."""
    items = [(gi, item) for gi, group in enumerate(groups) for item in _params_list(group["params"])]
    named = bool(items) and all(isinstance(item, tuple) for _, item in items)
    tensors = [item[1] if named else item for _, item in items]
    if named:
        picked, rule = _blocks_from_names([item[0] for _, item in items], tensors)
    elif all(isinstance(t, torch.Tensor) for t in tensors):
        picked, rule = _blocks_from_shapes(tensors)
    else:
        return groups  # mixed or foreign entries: torch's own checks report them

    out: list[dict] = []
    for gi, group in enumerate(groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        own = [(item, t) for (owner, item), t in zip(items, tensors) if owner == gi]
        rest = [item for item, t in own if id(t) not in picked]
        by_block: dict[tuple[int, bool], list] = {}
        for item, t in own:
            if id(t) in picked:
                by_block.setdefault(picked[id(t)], []).append(item)
        if rest or not own:
            out.append({**settings, "params": rest, "projectable": False})
        for (block, transposed), params in sorted(by_block.items(), key=lambda kv: kv[0]):
            out.append({**settings, "params": params, "projectable": True, "block": block,
                        "transposed": transposed})
    n_blocks = len({b for b, _ in picked.values()})
    if picked:
        warnings.warn(
            f"frugal.FRUGAL got {what} without FRUGAL group keys and guessed the split: {len(picked)} "
            f"2-D tensors in {n_blocks} blocks are projectable ({rule}); the other {len(tensors) - len(picked)} "
            "tensors (embeddings, output head, norms, biases, ...) stay state-full. To be exact, pass "
            "the model: FRUGAL(model, ...), with HF Trainer optimizer_cls_and_kwargs=(frugal.FRUGAL, "
            "{'model': model, ...}); frugal.describe(optimizer) prints the split.", stacklevel=4)
    return out


def _no_projectable_warning(what: str) -> None:
    warnings.warn(
        f"frugal.FRUGAL found no projectable parameters in {what}: every tensor is state-full, so this "
        f"runs the state-full rule (AdamW) on everything and saves no memory. {_REMEDY}", stacklevel=4)


def resolve_params(params, state_full: str | None = None) -> list[dict] | object:
    """Param groups for `FRUGAL(params, state_full=...)` from whatever a user passes as `params`: a model
    goes through `param_groups`; groups carrying any FRUGAL key are kept as given; named or plain tensors,
    or groups without FRUGAL keys (HF Trainer's), get projectable tensors guessed from numbered layer
    names or repeating shapes, each group keeping its settings on its parts, with a warning (these are
    not routed by `StateFullRule.rest`). A result with no projectable tensor (unless the groups all say
    so) warns that FRUGAL is the state-full rule alone. What torch would reject is returned as is.
    """
    if isinstance(params, nn.Module):
        groups = _groups(module_roles(params), state_full_rule=state_full)
        if not any(group["projectable"] for group in groups):
            _no_projectable_warning(type(params).__name__)
        return groups
    if isinstance(params, (torch.Tensor, set)):
        return params
    items = list(params)
    if not items:
        return items
    if all(isinstance(item, dict) for item in items):
        if any(key in group for group in items for key in FRUGAL_GROUP_KEYS):
            deliberate = all("projectable" in group or group.get("always_state_free") for group in items)
            if not deliberate and not any(group.get("projectable") for group in items):
                _no_projectable_warning("the given param groups")
            return items
        groups, what = items, "param groups"
    else:
        named = all(isinstance(x, tuple) for x in items)
        groups, what = [{"params": items}], "named parameters" if named else "plain tensors"
    groups = _split_groups(groups, what)
    if not any(group.get("projectable") for group in groups):
        _no_projectable_warning(what)
    return groups
