"""How the state-full rule's moments are stored: in the weights' dtype (``param``, the default),
in bfloat16 (``bf16``) or in 8 bits (``8bit``).

Low-precision moments are decoded to float32 for the rule's own update (``rules.STATE_FULL``) and
encoded back, ``CHUNK`` elements at a time (float32 copies of a few MB at most). 8 bits are
bitsandbytes' blockwise dynamic quantisation (Dettmers et al., 2022): blocks of 256 elements with a
float32 absolute maximum each, a signed map (unsigned for the rule's ``nonnegative`` moments); codes
in ``state[name]`` (uint8), scales in ``state[name + "_absmax"]``, so ``state_dict()`` round-trips.
Tensors under ``MIN_8BIT_NUMEL`` elements stay in the weights' dtype (bitsandbytes' ``min_8bit_size``);
bitsandbytes is imported only when 8-bit state is asked for. Whole tensors only (``check``).

``master_weights=True``: a bf16/fp16 tensor, while state-full, holds a float32 copy of its weights
(``state["master"]``, made by ``master``) and float32 moments; the rule updates the copy and the
weights are it rounded to nearest (the ``badam`` package). Whole tensors, elementwise rules (``check``).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import projections as proj
from . import sharding
from .checks import HyperparameterError
from .kernels import stochastic_round_

PRECISIONS = ("param", "bf16", "8bit")
BLOCK = 256  # elements per 8-bit block: bitsandbytes' blockwise optimizer kernels
MIN_8BIT_NUMEL = 4096  # smaller tensors keep full-precision moments (bitsandbytes' min_8bit_size)
CHUNK = 1 << 20  # elements decoded at once (a multiple of BLOCK): 4 MB per float32 moment
ABSMAX = "_absmax"
MASTER = "master"  # the float32 copy of low-precision weights (master_weights)
LOW_WEIGHTS = (torch.bfloat16, torch.float16)  # the weight dtypes master_weights gives a float32 copy
_CODES: dict = {}


def is_low(group: dict) -> bool:
    return group.get("state_precision", "param") != "param"


def storage(group: dict, numel: int) -> str:
    """How a state-full tensor of ``numel`` elements in ``group`` stores its moments."""
    precision = group.get("state_precision", "param")
    if precision == "8bit" and numel < MIN_8BIT_NUMEL:
        return "param"
    return precision


def moment_bytes(precision: str, numel: int, elem: int) -> int:
    """Bytes of one moment of ``numel`` elements stored as ``precision`` (weights of ``elem`` bytes)."""
    if precision == "8bit" and numel >= MIN_8BIT_NUMEL:
        return numel + 4 * math.ceil(numel / BLOCK)
    return numel * (2 if precision == "bf16" else elem)


def _bnb_ops():
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
    except ImportError as err:
        raise ImportError("state_precision='8bit' stores moments in bitsandbytes' blockwise 8-bit format: "
                          "pip install bitsandbytes (or frugal-optim[8bit])") from err
    return torch.ops.bitsandbytes


def _code(signed: bool, device: torch.device) -> Tensor:
    key = (signed, device)
    if key not in _CODES:
        from bitsandbytes.functional import create_dynamic_map
        _CODES[key] = create_dynamic_map(signed=signed).to(device)
    return _CODES[key]


def zeros(state: dict, name: str, shape, like: Tensor, group: dict) -> None:
    """A fresh moment ``name`` of ``shape`` (zeros) in the group's storage."""
    numel = math.prod(shape)
    kind = storage(group, numel)
    if kind == "8bit":
        _bnb_ops()
        state[name] = torch.zeros(shape, dtype=torch.uint8, device=like.device)
        state[name + ABSMAX] = torch.zeros(math.ceil(numel / BLOCK), dtype=torch.float32, device=like.device)
    else:
        dtype = torch.bfloat16 if kind == "bf16" else like.dtype
        state[name] = torch.zeros(shape, dtype=dtype, device=like.device)


def master(state: dict, param: Tensor, group: dict) -> Tensor | None:
    """The float32 copy of state-full ``param``'s weights under ``master_weights`` (``state["master"]``,
    made from the weights if missing; a DTensor for an FSDP2 shard), or None: the group keeps none, or
    the weights are not bfloat16/float16."""
    if not group.get("master_weights") or param.dtype not in LOW_WEIGHTS:
        return None
    copy = state.get(MASTER)
    if copy is None:
        copy = state[MASTER] = param.detach().to(torch.float32, copy=True)
    return copy


def drop(state: dict, name: str) -> None:
    state.pop(name, None)
    state.pop(name + ABSMAX, None)


def compute_dtype(like: Tensor) -> torch.dtype:
    return torch.promote_types(like.dtype, torch.float32)


def decode(state: dict, name: str, start: int, stop: int, dtype: torch.dtype, signed: bool = True) -> Tensor:
    """Elements ``start:stop`` of the flattened moment ``name``, as ``dtype`` (None: a view of a moment
    stored unquantised; ``signed``: the map of a moment that may be negative)."""
    codes = state[name].view(-1)[start:stop]
    if codes.dtype != torch.uint8:
        return codes if dtype is None else codes.to(dtype)
    ops = _bnb_ops()
    absmax = state[name + ABSMAX][start // BLOCK: math.ceil(stop / BLOCK)]
    return ops.dequantize_blockwise(codes, absmax, _code(signed, codes.device), BLOCK, torch.float32).to(dtype)


def encode_(state: dict, name: str, start: int, stop: int, value: Tensor, signed: bool = True) -> None:
    """Store ``value`` as elements ``start:stop`` of the flattened moment ``name``."""
    codes = state[name].view(-1)[start:stop]
    if codes.dtype != torch.uint8:
        codes.copy_(value)
        return
    ops = _bnb_ops()
    out, absmax = ops.quantize_blockwise(value.float(), _code(signed, codes.device), BLOCK)
    codes.copy_(out)
    state[name + ABSMAX][start // BLOCK: math.ceil(stop / BLOCK)].copy_(absmax)


def chunks(numel: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the chunks a tensor of ``numel`` elements is updated in."""
    return [(start, min(start + CHUNK, numel)) for start in range(0, numel, CHUNK)]


def decode_chunk(state: dict, rule, start: int, stop: int, dtype: torch.dtype) -> dict:
    """The rule's moments over flattened elements ``start:stop`` as ``dtype``, with a copy of the
    step count (the rule advances it once per call; ``advance`` counts the whole tensor's step)."""
    out = {n: decode(state, n, start, stop, dtype, n not in rule.nonnegative) for n in rule.state_names}
    if rule.counts_steps:
        out["step"] = state["step"].clone()
    return out


def encode_chunk(state: dict, rule, start: int, stop: int, moments: dict) -> None:
    for n in rule.state_names:
        encode_(state, n, start, stop, moments[n], n not in rule.nonnegative)


def advance(state: dict, rule) -> None:
    if rule.counts_steps:
        state["step"] += 1


def rounding(param: Tensor, group: dict, step: int, ident: int) -> torch.Generator | None:
    """The generator of the stochastic rounding of bf16 weights (None: round to nearest): a pure
    function of (seed, step, tensor[, shard]), so reruns and resumed runs round alike."""
    if not (group["stochastic_rounding"] and param.dtype == torch.bfloat16):
        return None
    seed = proj.mix_seed(group["seed"], step, ident, *sharding.mesh_coordinate(param))
    return torch.Generator(device=sharding.local(param).device).manual_seed(seed)


def write(p: Tensor, new: Tensor, generator: torch.Generator | None) -> None:
    """The new weights into ``p``: rounded stochastically with ``generator``, else to nearest."""
    if generator is not None:
        stochastic_round_(p, new, generator)
    else:
        p.copy_(new)


def whole_in_chunks(p: Tensor, grad: Tensor, state: dict, group: dict, rule, free_rule, rule_kwargs: dict,
                    free_kwargs: dict, lr_full: float, lr_free: float, decay: float,
                    generator: torch.Generator | None) -> None:
    """The single-tensor step (``frugal.reference``) of a wholly state-full tensor (``rule``, elementwise) or
    state-free one (``rule`` None: ``free_rule``, elementwise), a chunk at a time, so the float32 copies
    stay small. Low-precision moments are decoded to float32 and coded back, the others updated in place;
    the step count is a copy per chunk, advanced once for the whole tensor."""
    local_state = {k: sharding.local(v) for k, v in state.items()}  # views: updated in place
    dtype = compute_dtype(p)
    low = rule is not None and storage(group, p.numel()) != "param"
    for start, stop in chunks(p.numel()):
        flat_p, g = p.view(-1)[start:stop], grad.reshape(-1)[start:stop]
        new = flat_p.to(dtype)
        if rule is not None:
            moments = decode_chunk(local_state, rule, start, stop, dtype if low else None)
            d = rule.direction(g.to(dtype) if low else g, moments, **rule_kwargs)
            new = (new - lr_full * d) * decay if rule.decays_after else new * decay - lr_full * d
            if low:
                encode_chunk(local_state, rule, start, stop, moments)
        else:
            new *= decay
            if free_rule.direction is not None:
                new -= lr_free * free_rule.direction(g, **free_kwargs)
        write(flat_p, new, generator)
    if rule is not None:
        advance(state, rule)


def update_(rule, target: Tensor, grad: Tensor, state: dict, **kwargs) -> None:
    """The state-full ``rule`` (``rules.StateFullRule``) on one whole tensor whose moments are stored
    in low precision: per chunk, the moments, weights and gradient in float32, the rule's own update,
    the results stored back."""
    dtype = compute_dtype(target)
    flat_t, flat_g = target.view(-1), grad.reshape(-1)
    for start, stop in chunks(flat_t.numel()):
        t = flat_t[start:stop].to(dtype)
        moments = decode_chunk(state, rule, start, stop, dtype)
        steps = [moments["step"]] if rule.counts_steps else []
        rule.foreach([t], [flat_g[start:stop].to(dtype)], [[moments[n]] for n in rule.state_names], steps,
                     **kwargs)
        if t.data_ptr() != flat_t[start:stop].data_ptr():
            flat_t[start:stop].copy_(t)
        encode_chunk(state, rule, start, stop, moments)
    advance(state, rule)


def restore_dtypes(state: dict, group: dict, rule) -> None:
    """After torch's ``load_state_dict`` (which casts floating state to the weights' dtype): the
    group's bfloat16 moments as bfloat16 again (exactly: a widened bfloat16 narrows back unchanged)."""
    for p in group["params"]:
        s = state.get(p, {})
        for name in rule.state_names:
            if name in s and storage(group, s[name].numel()) == "bf16":
                s[name] = s[name].to(torch.bfloat16)


def _fits(rule) -> bool:
    """Its state may be updated a slice at a time: elementwise, the target's shape, no gather."""
    return rule.shapes is None and not rule.gathers and rule.elementwise


def check(group: dict, rule, projectable: bool, sharded: bool, rules: dict | None = None) -> None:
    """Raise HyperparameterError for a group whose moments cannot be stored as asked (``rules``: the
    state-full rules registered, for the message)."""
    fitting = ", ".join(sorted(name for name, other in (rules or {}).items() if _fits(other)))
    precision = group.get("state_precision", "param")
    if group.get("master_weights"):
        if not _fits(rule):
            raise HyperparameterError(
                "master_weights=True updates a float32 copy of each whole state-full tensor, which needs an "
                f"elementwise state-full rule; got state_full {group['state_full']!r}; valid choices: "
                f"{fitting} (or master_weights=False)")
        if projectable and group["projection"] != "block":
            raise HyperparameterError(
                f"master_weights=True keeps a float32 copy of whole state-full tensors, but projection "
                f"{group['projection']!r} updates reduced ones; valid choices: projection 'block' (or "
                "master_weights=False)")
        if precision != "param":
            raise HyperparameterError(
                f"master_weights=True keeps float32 moments with the float32 copy; state_precision "
                f"{precision!r} would store them in low precision; valid choices: state_precision 'param' "
                "with master_weights=True, or master_weights=False")
    if precision == "param":
        return
    if not _fits(rule):
        raise HyperparameterError(
            f"state_precision {precision!r} decodes the moments a chunk at a time, which needs an "
            f"elementwise state-full rule; got state_full {group['state_full']!r}; valid choices: "
            f"{fitting} (or state_precision 'param')")
    if projectable and group["projection"] != "block":
        raise HyperparameterError(
            f"state_precision {precision!r} stores whole tensors' moments, but projection "
            f"{group['projection']!r} moves reduced moments between subspaces in the weights' dtype; "
            "valid choices: projection 'block' (or state_precision 'param')")
    if sharded:
        raise HyperparameterError(
            f"state_precision {precision!r} is not supported for FSDP2 shards (its state is checkpointed as "
            "DTensors in the weights' dtype); valid choice with FSDP2: 'param'")
