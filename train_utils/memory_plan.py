"""Per-rank peak device memory of a training run, planned before anything is allocated.

    plan = plan_memory(model_cfg, {"name": "frugal", "density": 0.0}, micro_batch_size=8, seq_len=256)
    micro, plan = largest_micro_batch(model_cfg, opt_cfg, device_bytes=DEVICES["a100-80gb"], seq_len=256)

The model is built on the meta device (no memory), so the loop can refuse at start-up a run that cannot
fit. Counted per rank (sharded by the world size under FSDP): weights, gradients, communication buffers,
optimizer state and its in-step transient, bf16 working weights, activations (`_layer_terms`), logits
and loss; `allowance` (2 GiB context + 5% fragmentation) is on top of the total. The peak is the largest
of the step's moments (``MemoryPlan.phases``), gradients resident in all. Derivations and the
validation against measured peaks: docs/memory_plan.md, "What is counted".
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from frugal.checks import check_integer
from frugal.grouping import transformer_blocks

from .distributed import PARALLELISMS
from .validation import PRECISIONS

__all__ = ["MemoryPlan", "plan_memory", "largest_micro_batch", "device_memory", "optimizer_gather_bytes", "DEVICES",
           "PARALLELISMS", "PRECISIONS", "GIB"]

GIB = 2**30
DEVICE_TYPES = ("cuda", "cpu")
# Usable memory as torch reports it ("GPU 0 has a total capacity of 79.15 GiB"), not the nominal size.
# The A100s' are torch's figures; the others are approximate, rounded down from the totals torch reports
# for those cards: for the exact one, --device-gib with torch.cuda.get_device_properties(0).total_memory / 2**30.
DEVICES = {
    "rtx-24gb": int(23.65 * GIB),  # 24 GB consumer / workstation cards: RTX 3090, 4090, A5000
    "l4": int(22.0 * GIB),
    "a10": int(22.0 * GIB),
    "a100-40gb": int(39.39 * GIB),
    "a100-80gb": int(79.15 * GIB),
    "h100-80gb": int(79.1 * GIB),
    "h200": int(139.7 * GIB),
}
CONTEXT_BYTES = 2 * GIB  # CUDA context (~0.5 GiB), NCCL buffers (~0.5-1 GiB), cuBLAS workspaces
FRAGMENTATION = 0.05  # reserved-but-unused share of the caching allocator (less with expandable_segments)


def _plain(cfg) -> dict:
    if isinstance(cfg, Mapping) and not isinstance(cfg, dict):  # OmegaConf DictConfig
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


# ---- what the model and the optimizer hold, from the meta-device model -------------------------------
@dataclass(frozen=True)
class _Facts:
    activations: Any  # models.Activations: the kinds of the family's norm, MLP and positions
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    params: int  # unique parameters (a tied head counted once)
    param_bytes: int  # storage element size: 4, or 2 for pure bf16
    matmul_weights: int  # elements of the weights that run through a matmul (Linear, Conv1D, the head)
    layer_params: int
    layer_matmul_weights: int
    largest_layer_weight: int
    head_weight: int  # elements of the output head's weight
    dropout: tuple[float, float, float]  # embeddings, attention, residual (0 where the family has none)
    optimizer_state: int
    optimizer_transient: int
    # A rule that orthogonalises whole matrices (Muon): the orthogonalisation of one matrix at a time, which
    # FSDP does not shard (every rank gathers the matrix), and the bf16 bytes gathered per step under FSDP.
    matrix_transient: tuple[int, int] = (0, 0)  # (unsharded, FSDP)
    gathered_per_step: int = 0
    # The step inside backward (frugal.in_backward): elements whose gradients wait for the clipping
    # norm until the end of backward; None when the optimizer is not built on FRUGAL (no such mode).
    clip_waiting: int | None = None


def _weight_numel(module: nn.Module) -> list[int]:
    """Elements of each weight used in a matmul (nn.Linear, transformers' Conv1D) under `module`."""
    return [m.weight.numel() for m in module.modules()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]


# Bytes per index drawn by frugal.projections.random_subset (randk's coordinates at a window change):
# the int64 draws, torch.unique's values, inverse and sort buffers, the first-draw positions. Measured
# on CPU with the profiler: 44-47 bytes per draw at densities 0.1-0.5.
_DRAW_BYTES = 48


def _draws(n: int, k: int) -> int:
    """Indices random_subset draws to pick k of n (the complement when k > n/2, plus its n-byte mask)."""
    k = min(k, n - k)
    return int(-n * math.log1p(-k / n) * 1.05) + 16 if k > 0 else 0


# Bytes per element that the single-tensor path (frugal.reference.update_tensor) allocates while it
# updates one bf16 tensor with stochastic rounding: its fp32 copy, the update, the rounding noise.
# Measured on CPU with the profiler's allocation events (4M-element tensors): 21 for an AdamW tensor,
# 19 for a signSGD one.
_ROUNDED_FULL, _ROUNDED_FREE = 21, 19


def _optimizer_transient(model: nn.Module, optimizer) -> int:
    """Bytes `optimizer.step()` allocates on top of the state it holds, at its peak, read from the FRUGAL
    optimizer built on the meta-device model: the larger of the whole tensors' batch (a block switch at
    the contract, state-free and bucket temporaries) and one batch of at most 8 split tensors
    (docs/memory_plan.md, "Optimizer transient"). Torch's fused AdamW allocates nothing."""
    from frugal import projections as proj
    from frugal import state_precision
    from frugal.optimizer import _BATCH_TENSORS
    from frugal.rules import STATE_FREE, STATE_FULL

    groups = optimizer.param_groups
    g0 = groups[0]
    elem = next(iter(model.parameters())).element_size()
    n_moments = len(STATE_FULL[g0["state_full"]].state_names)
    temporaries = STATE_FULL[g0["state_full"]].bucket_temporaries  # target-sized, for a whole bucket
    active = set(optimizer.active_blocks() or [])

    def eager_sign(g, numel: int) -> int:  # what the state-free rule allocates for one tensor (sign(g))
        temporary = STATE_FREE[g["state_free"]].temporary_bytes
        return temporary(g, numel, elem) if temporary is not None else 0

    full_sizes, sign, units, batches = [], 0, {}, []
    for gi, g in enumerate(groups):
        split = g["projectable"] and not g["always_state_free"] and g["projection"] != "block"
        batch: list = []
        for pi, p in enumerate(g["params"]):
            n = p.numel()
            if g["projectable"] and not g["always_state_free"] and g["projection"] == "block":
                key = g["block"] if g["block_granularity"] != "tensor" else (gi, pi)
                units[key] = units.get(key, 0) + n
            state_full = not g["always_state_free"] and (
                not g["projectable"] or (g["projection"] == "block" and g["block"] in active))
            if state_full:
                full_sizes.append(n)
            elif split:
                if len(batch) == _BATCH_TENSORS:
                    batches.append((g, batch))
                    batch = []
                batch.append(p)
            else:
                sign = max(sign, eager_sign(g, n))
        if batch:
            batches.append((g, batch))
    # master_weights on bf16 weights: every state-full tensor's update runs on its float32 copy, with its
    # gradient converted to float32 (4 bytes per element, the whole batch at once) and float32 moments
    master = 4 if g0.get("master_weights") and elem == 2 else 0
    full_elem = 4 if master else elem
    whole = sign + sum(full_sizes) * (full_elem * temporaries + master)
    count = len(active)
    if 0 < count < len(units):  # a switch, at the contract: one block above the resting state
        unit = max(units.values())
        whole += n_moments * state_precision.moment_bytes(g0["state_precision"], unit, full_elem) + master * unit
    def is_low(g, n: int) -> bool:  # a whole tensor whose moments are stored in low precision
        return (not g["always_state_free"] and (not g["projectable"] or g["projection"] == "block")
                and state_precision.storage(g, n) != "param")

    low = max([p.numel() for g in groups for p in g["params"] if is_low(g, p.numel())], default=0)
    if low and not (elem == 2 and g0["stochastic_rounding"]):
        # decoded a chunk at a time: the chunk's weights, gradient and moments in float32, its codes
        whole += min(state_precision.CHUNK, low) * (4 * (n_moments + 2) + 1)

    def batch_bytes(g, params) -> int:
        projection, density, t = g["projection"], g["density"], g["transposed"]
        reduced = [math.prod(proj.reduced_shape(projection, p.shape, t, density)) for p in params]
        total = 2 * sum(reduced) * elem + sum(reduced) * elem * temporaries
        # the largest one-tensor-at-a-time temporary of the batch (phase 4: the sign update of each)
        once = max(eager_sign(g, p.numel()) for p in params)
        free = STATE_FREE[g["state_free"]]
        if projection in proj.COORDINATE:
            if projection == "randk":
                total += 8 * sum(reduced)
                once = max([once] + [_DRAW_BYTES * _draws(p.numel(), k) + (p.numel() if 2 * k > p.numel() else 0)
                                     for p, k in zip(params, reduced)])
            if g["reset_state"] == "reproject":
                once = max(once, n_moments * max(reduced) * elem)
            if not free.elementwise and free.reads_residual:  # its residual, and the update added back
                total += sum(p.numel() for p in params) * elem
                once = max(once, max(p.numel() for p in params) * elem)
        else:
            full = [p.numel() for p in params]
            if free.reads_residual or free.split_step:  # the rule reads the residual
                total += sum(full) * elem  # each tensor's residual gradient, kept until the write back
            once = max(once, max(full) * elem)  # one tensor projected back at a time
            if projection == "svd":  # the decomposition at a projection change (at least fp32)
                m, n = max((p.shape for p in params), key=lambda s: s[0] * s[1])
                once += (2 * m * n + min(m, n) * (m + n)) * max(elem, 4)
        return total + once

    rounded = 0  # bf16 weights rounded stochastically: the single-tensor path, one tensor at a time
    if elem == 2:
        for g in groups:
            if not g["stochastic_rounding"]:
                continue
            whole_tensors = not g["projectable"] or g["always_state_free"] or g["projection"] == "block"
            for p in g["params"]:
                n = p.numel()
                chunked = STATE_FULL[g["state_full"]].elementwise and (
                    not g["projectable"] or STATE_FREE[g["state_free"]].elementwise)  # both roles it may take
                if whole_tensors and chunked:
                    # a chunk at a time (frugal.reference), low-precision moments decoded and coded back too
                    per_element = _ROUNDED_FULL + (4 * n_moments + 1 if is_low(g, n) else 0)
                    rounded = max(rounded, min(state_precision.CHUNK, n) * per_element)
                else:
                    rounded = max(rounded, (_ROUNDED_FULL if not g["projectable"] else _ROUNDED_FREE) * n)
    return max([whole, rounded] + [batch_bytes(g, params) for g, params in batches])


def _muon_step(model: nn.Module, optimizer) -> tuple[tuple[int, int], int]:
    """What a rule orthogonalising whole matrices (Muon) adds to the step: ((peak temporaries unsharded,
    under FSDP), bf16 bytes all-gathered per step under FSDP). One matrix (m x n, s = min(m, n)) at a
    time: the fp32 Nesterov mix, 3 x 2mn bf16 iterates, 2 x 2s^2 for the Gram matrix and its polynomial;
    under FSDP also the gathered bf16 matrix (2mn) on every rank. Only state-full matrices are gathered."""
    from frugal import projections as proj
    from frugal.rules import STATE_FULL

    active = set(optimizer.active_blocks() or [])
    elem = next(iter(model.parameters())).element_size()
    peak, peak_fsdp, gathered = 0, 0, 0
    for g in optimizer.param_groups:
        if not STATE_FULL[g["state_full"]].gathers or g["always_state_free"]:
            continue
        block = g["projectable"] and g["projection"] == "block"
        if block and g["block"] not in active:
            continue
        for p in g["params"]:
            whole = not g["projectable"] or block  # else column/row: the reduced matrix (never sharded)
            m, n = p.shape if whole else proj.reduced_shape(g["projection"], p.shape, g["transposed"], g["density"])
            ns = 3 * 2 * m * n + 2 * 2 * min(m, n) ** 2
            peak, peak_fsdp = max(peak, elem * m * n + ns), max(peak_fsdp, 2 * m * n + ns)
            gathered += 2 * m * n if whole else 0
    return (peak, peak_fsdp), gathered


def optimizer_gather_bytes(model_cfg, optimizer_cfg: Mapping[str, Any], vocab_size: int | None = None) -> int:
    """bf16 bytes every rank all-gathers inside one optimizer step under FSDP2 (0 unless the state-full
    rule orthogonalises whole matrices: Muon gathers the state-full blocks' matrices, docs/muon.md)."""
    return _facts(model_cfg, optimizer_cfg, "bf16-mixed", vocab_size).gathered_per_step


def _estimate(model: nn.Module, name: str, hp: dict) -> int:
    """`frugal.estimate_state_bytes` in the layout the optimizer holds (GaLore's code layout for svd,
    not Appendix D's count): this is device memory."""
    import frugal

    return frugal.estimate_state_bytes(model, name, **hp, **({} if name == "adamw" else
                                                            {"svd_layout": "implementation"}))


@functools.lru_cache(maxsize=4)
def _meta_model(model_json: str, pure_bf16: bool, vocab_size: int | None) -> nn.Module:
    import models

    with torch.device("meta"):  # shapes only: nothing is allocated, whatever the size
        model = models.build_model(json.loads(model_json), vocab_size=vocab_size)
    return model.to(torch.bfloat16) if pure_bf16 else model


@functools.lru_cache(maxsize=256)
def _facts_cached(model_json: str, optimizer_json: str, pure_bf16: bool, vocab_size: int | None) -> _Facts:
    model = _meta_model(model_json, pure_bf16, vocab_size)
    import frugal
    from frugal.in_backward import waiting_numel

    opt = json.loads(optimizer_json)
    name = opt.pop("name")
    c = model.config
    activations = _activations(json.loads(model_json).get("family"))
    intermediate, heads, kv_heads, dropout = activations.sizes(c)
    blocks = transformer_blocks(model)
    layer = blocks[0]
    layer_weights = _weight_numel(layer)
    params = list(model.parameters())
    estimate = _estimate(model, name, opt)
    # The transients are read from the optimizer built on the meta model (FRUGAL's layout; others: none).
    # With the step inside backward and clipping, `waiting`: the elements whose gradients are held until
    # the end of backward (None: no such mode without FRUGAL).
    optimizer = frugal.build_optimizer(model, name, **opt)
    transient, matrix_transient, gathered, waiting = 0, (0, 0), 0, None
    if isinstance(optimizer, frugal.FRUGAL):
        transient = _optimizer_transient(model, optimizer)
        (matrix_transient, gathered), waiting = _muon_step(model, optimizer), waiting_numel(optimizer)
    return _Facts(
        activations=activations, layers=len(blocks), hidden=c.hidden_size, intermediate=intermediate, heads=heads,
        kv_heads=kv_heads, vocab=c.vocab_size, max_positions=c.max_position_embeddings,
        params=sum(p.numel() for p in params), param_bytes=params[0].element_size(),
        matmul_weights=sum(_weight_numel(model)), layer_params=sum(p.numel() for p in layer.parameters()),
        layer_matmul_weights=sum(layer_weights), largest_layer_weight=max(layer_weights),
        head_weight=model.get_output_embeddings().weight.numel(), dropout=dropout, optimizer_state=estimate,
        optimizer_transient=transient, matrix_transient=matrix_transient, gathered_per_step=gathered,
        clip_waiting=waiting)


def _facts(model_cfg, optimizer_cfg, precision: str, vocab_size: int | None) -> _Facts:
    model_cfg, opt = _plain(model_cfg), _plain(optimizer_cfg)
    if "name" not in opt:
        raise ValueError(f"optimizer_cfg needs a 'name' (e.g. 'frugal', 'adamw'); got keys {sorted(opt)}")
    _activations(model_cfg.get("family"))
    return _facts_cached(json.dumps(model_cfg, sort_keys=True, default=str),
                         json.dumps(opt, sort_keys=True, default=list), precision == "bf16", vocab_size)


# ---- activations: what autograd saves, term by term ------------------------------------------------
_NORMS = ("rmsnorm", "layernorm")
_MLPS = ("swiglu", "gelu_new")
_POSITIONS = ("rotary", "learned")


def _activations(family):
    """The activation facts ``family``'s entry in ``models.FAMILY`` declares; a ValueError naming the
    families the planner can count when it declares none (or parts it has no count for)."""
    import models

    entry = models.FAMILY.get(family)
    a = entry.activations if entry is not None else None
    if a is None:
        known = [name for name, e in models.FAMILY.items() if e.activations is not None]
        raise ValueError(f"model family {family!r} is not supported by the memory planner (its entry in "
                         f"models.FAMILY declares no activations); valid choices: {known}")
    for part, value, counted in (("norm", a.norm, _NORMS), ("mlp", a.mlp, _MLPS),
                                 ("positions", a.positions, _POSITIONS)):
        if value not in counted:
            raise ValueError(f"model family {family!r} declares {part}={value!r}, which the memory planner "
                             f"cannot count; valid choices: {list(counted)}")
    return a


@dataclass(frozen=True)
class _Regime:
    """How the forward pass computes: the dtype of the weights it sees (4 = fp32, 2 = bf16), whether
    bf16 autocast is on, and the device type (CUDA and CPU autocast cast different ops)."""
    weight_bytes: int
    autocast: bool
    cuda: bool

    @property
    def compute_bytes(self) -> int:  # matmul outputs and attention tensors
        return 2 if self.autocast or self.weight_bytes == 2 else 4

    @property
    def casts_weights(self) -> bool:  # autocast makes a bf16 copy of every fp32 matmul weight
        return self.autocast and self.weight_bytes == 4


def _layer_terms(f: _Facts, tokens: int, seq_len: int, r: _Regime) -> tuple[dict, dict]:
    """(bytes saved per transformer block, bytes saved outside the blocks), as named terms: transformers'
    blocks with SDPA (flash: q, k, v, output, fp32 logsumexp), part by part as ``models.Activations``
    declares them (docs/memory_plan.md's table); tests check every term against the saved tensors.
    """
    T, h, inter, a = tokens, f.hidden, f.intermediate, f.heads
    kv = f.kv_heads * (h // a)
    wb, cb = r.weight_bytes, r.compute_bytes
    kinds = f.activations
    embd_p, _, resid_p = f.dropout
    mask = 1 if r.cuda else cb  # dropout keeps its mask: bool on CUDA, the input's dtype on CPU
    if kinds.norm == "rmsnorm":
        # RMSNorm computes in fp32: it keeps its fp32 input (or an fp32 copy of a bf16 one), the rsqrt
        # and the normalised tensor before the weight (in the input dtype).
        norm_name, norm = "RMSNorm", 4 * T * h + 4 * T + wb * T * h
    else:  # LayerNorm. CUDA autocast runs layer_norm in fp32 (its fp32 op list), CPU autocast does not.
        ln_in = 4 if (r.autocast and r.cuda and wb == 2) else wb
        norm_name, norm = "LayerNorm", ln_in * T * h + 2 * T * (4 if r.cuda else ln_in)  # input, mean and rstd
    if kinds.mlp == "swiglu":
        mlp_name, mlp = "SwiGLU (gate, silu, up, product)", 4 * cb
    else:
        # gelu_new = 0.5 x (1 + tanh(c (x + 0.044715 x^3))): pow's input, tanh's output, (1 + tanh), 0.5 x
        # and the product (c_proj's input); fp32 from pow onwards under CUDA autocast (pow is on its list).
        mlp_name, mlp = "MLP (gelu_new)", (4 + 4 + 4 + cb + cb) if (r.autocast and r.cuda) else 5 * cb
    layer = {
        f"{norm_name}s": 2 * norm,
        # Autocast casts the fp32 norm output once per matmul that reads it (LLaMA: q, k, v, gate, up);
        # without casts the attention's and the MLP's projections share one saved input each.
        "matmul inputs": cb * T * h * ((kinds.qkv_matmuls + kinds.mlp_matmuls) if r.casts_weights else 2),
        "attention q, k, v": cb * T * (h + 2 * kv),
        "attention output, logsumexp": cb * T * h + 4 * T * a,
        mlp_name: mlp * T * inter,
    }
    if resid_p > 0:
        layer["dropout masks"] = 2 * mask * T * h
    head = {"input ids": 8 * T}
    if kinds.positions == "rotary":
        head["rotary cos, sin"] = 2 * seq_len * (h // a) * wb
    else:
        head["position ids"] = 8 * seq_len
    if embd_p > 0:
        head["embedding dropout mask"] = mask * T * h
    head.update({f"final {norm_name}": norm, "head input": cb * T * h})
    return layer, head


# ---- the plan ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """Peak device memory of one rank, in bytes, broken into parts at the moment of the peak."""

    weights: int
    gradients: int
    comm_buffers: int
    optimizer_state: int
    optimizer_transient: int
    working_weights: int
    activations: int
    logits_loss: int
    phase: str  # the moment of the step at which the peak happens
    phases: dict = field(default_factory=dict)  # total bytes at every moment considered
    allowance: int = 0  # CUDA context + allocator fragmentation: needed on top of `total`
    settings: dict = field(default_factory=dict)

    PARTS = ("weights", "gradients", "comm_buffers", "optimizer_state", "optimizer_transient",
             "working_weights", "activations", "logits_loss")

    @property
    def total(self) -> int:
        """The planned peak of allocated memory (what torch.cuda.max_memory_allocated would report)."""
        return sum(getattr(self, p) for p in self.PARTS)

    @property
    def required(self) -> int:
        """Device memory needed: the peak plus the allowance."""
        return self.total + self.allowance

    def fits(self, device_bytes: int) -> bool:
        return self.required <= device_bytes

    def as_dict(self) -> dict:
        return {**{p: getattr(self, p) for p in self.PARTS}, "total": self.total, "allowance": self.allowance,
                "required": self.required, "phase": self.phase, "phases": dict(self.phases), **self.settings}

    def format(self, device_bytes: int | None = None) -> str:
        s = self.settings
        lines = [f"{s.get('model', '?')} + {s.get('optimizer', '?')}: micro-batch {s['micro_batch_size']} x "
                 f"{s['seq_len']} tokens, {s['parallelism']} x {s['world_size']}, {s['precision']}, "
                 f"activation checkpointing {'on' if s['activation_checkpointing'] else 'off'}"
                 + (f", step inside backward ({'clipping' if s['grad_clip'] else 'no clipping'}, accumulation "
                    f"{s['accumulation']})" if s.get("optimizer_in_backward") else ""),
                 f"  per rank, GiB, at the peak ({self.phase}):"]
        for p in self.PARTS:
            lines.append(f"    {p.replace('_', ' '):<22}{getattr(self, p) / GIB:9.2f}")
        lines.append(f"    {'= peak allocated':<22}{self.total / GIB:9.2f}")
        lines.append(f"    {'+ context, fragment.':<22}{self.allowance / GIB:9.2f}")
        lines.append(f"    {'= required':<22}{self.required / GIB:9.2f}")
        if device_bytes:
            margin = device_bytes - self.required
            lines.append(f"  device {device_bytes / GIB:.2f} GiB: {'fits' if margin >= 0 else 'does NOT fit'}, "
                         f"margin {margin / GIB:+.2f} GiB")
        return "\n".join(lines)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid; valid choices: {', '.join(map(str, choices))}")


def _check_int(name: str, value, minimum: int) -> None:
    check_integer(name, value, minimum, error=ValueError)


def plan_memory(model_cfg, optimizer_cfg: Mapping[str, Any], *, micro_batch_size: int, seq_len: int,
                world_size: int = 1, parallelism: str = "ddp", precision: str = "bf16-mixed",
                activation_checkpointing: bool = False, vocab_size: int | None = None,
                device_type: str = "cuda", gradient_as_bucket_view: bool = True,
                autocast_cache: bool = True, compiled_loss: bool = False, optimizer_in_backward: bool = False,
                grad_clip: bool = False, accumulation: int = 1) -> MemoryPlan:
    """Plan the per-rank peak memory of training `model_cfg` with `optimizer_cfg` (module docstring).

    `model_cfg`: a configs/model node as `models.build_model` takes it (`gradient_checkpointing: true`
    counts as activation checkpointing); `optimizer_cfg`: `{"name": ..., **hyperparameters}` as
    `frugal.build_optimizer` takes it. `vocab_size` overrides the model's. `device_type="cpu"`: CPU
    autocast, no allowance. `gradient_as_bucket_view=False`: DDP buckets beside the gradients;
    `autocast_cache=False`: `torch.autocast(cache_enabled=False)`; `compiled_loss=True`: the loop's
    compiled loss; `optimizer_in_backward=True`: the step inside backward, which with `accumulation` 1
    holds one block's gradients plus those waiting for the clipping norm (`grad_clip`).
    """
    _check_int("micro_batch_size", micro_batch_size, 1)
    _check_int("accumulation", accumulation, 1)
    _check_int("seq_len", seq_len, 2)
    _check_int("world_size", world_size, 1)
    _check_choice("parallelism", parallelism, PARALLELISMS)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("device_type", device_type, DEVICE_TYPES)
    _check_choice("activation_checkpointing", activation_checkpointing, (False, True))
    if vocab_size is not None:
        _check_int("vocab_size", vocab_size, 1)
    f = _facts(model_cfg, optimizer_cfg, precision, vocab_size)
    if seq_len > f.max_positions:
        raise ValueError(f"seq_len={seq_len} is invalid: the model has max_position_embeddings="
                         f"{f.max_positions}; valid: 2..{f.max_positions}")
    ac = bool(activation_checkpointing or _plain(model_cfg).get("gradient_checkpointing"))
    fsdp, n = parallelism == "fsdp", world_size
    master = f.param_bytes  # 4 (fp32 master weights), or 2 in pure bf16
    # FSDP2's MixedPrecisionPolicy gives the blocks bf16 weights; the loop's autocast stays on.
    r = _Regime(weight_bytes=2 if (fsdp and precision == "bf16-mixed") else master,
                autocast=precision == "bf16-mixed", cuda=device_type == "cuda")
    cb = r.compute_bytes
    B, S, V, T, h, L = micro_batch_size, seq_len, f.vocab, micro_batch_size * seq_len, f.hidden, f.layers

    def shard(x: int) -> int:
        return -(-x // n) if fsdp else x

    held = f.params  # gradients held through the step
    if optimizer_in_backward:
        if f.clip_waiting is None:
            raise ValueError(f"optimizer_in_backward=True needs an optimizer built on FRUGAL (got "
                             f"{_plain(optimizer_cfg)['name']!r})")
        if accumulation == 1:  # one block's gradients, applied together, and those waiting for the norm
            held = f.layer_params + (f.clip_waiting if grad_clip else 0)
    # The step inside backward with one micro-batch: no gradient exists before the head's backward ends
    # (the previous step freed them all), and each block's update allocates its share of the step's
    # transient (a block at a time: its temporaries, stochastic rounding's float32 chunks) inside backward.
    stepping = optimizer_in_backward and accumulation == 1
    block_step = -(-shard(f.optimizer_transient) // f.layers) if stepping else 0
    base = {"weights": shard(f.params * master), "gradients": shard(held * master),
            "comm_buffers": f.params * master if (not fsdp and n > 1 and not gradient_as_bucket_view) else 0,
            "optimizer_state": shard(f.optimizer_state)}
    layer, head = _layer_terms(f, T, S, r)
    act_layer, act_head, act_input = sum(layer.values()), sum(head.values()), r.weight_bytes * T * h

    def grad_transient(numel: int) -> int:
        """A weight's gradient before it is accumulated or reduced: bf16 from the matmul plus its fp32
        copy when autocast casts fp32 weights; under FSDP, the gradient plus its reduce-scatter input."""
        if r.casts_weights:
            return (2 + 4) * numel
        if fsdp:
            return (r.weight_bytes + (4 if r.autocast else r.weight_bytes)) * numel
        return r.weight_bytes * numel

    if fsdp:  # unsharded root (embeddings, head: kept from forward to backward) + two gathered blocks
        root = (f.params - L * f.layer_params) * r.weight_bytes
        gathered = root + 2 * f.layer_params * r.weight_bytes
        working = {"all": gathered, "head": gathered, "layer": gathered, "blocks": gathered}
        # A block's gradients in the compute dtype and two fp32 reduce-scatter inputs in flight; the
        # root's (embeddings, head) are reduced the same way when the head's backward ends.
        comm = (r.weight_bytes + 2 * 4) * f.layer_params
        layer_grad = 0  # inside comm
    else:
        cast = 2 if r.casts_weights else 0
        working = {"all": cast * f.matmul_weights, "head": cast * f.head_weight,
                   "layer": cast * f.layer_matmul_weights, "blocks": cast * (f.matmul_weights - f.head_weight)}
        comm = 0
        layer_grad = grad_transient(f.largest_layer_weight)
    logits = cb * B * S * V
    if compiled_loss:  # one fused pass: the logits' gradient in their dtype, a fp32 logsumexp per token
        loss_bwd = 2 * logits + 4 * B * S
    else:  # eager: fp32 log-softmax output, its gradient, the input gradient
        loss_bwd = logits + 3 * 4 * B * (S - 1) * V
    if r.casts_weights:  # the head weight's bf16 gradient beside the logits' gradient, then its fp32 copy
        head_bwd = logits + max(logits + 2 * f.head_weight, 6 * f.head_weight)
    else:  # the caller's logits, their gradient, the head weight's gradient
        head_bwd = 2 * logits + grad_transient(f.head_weight)
    # Inside a block's backward: the residual gradient in and out, three MLP-wide gradients, a weight's.
    block_bwd = 2 * r.weight_bytes * T * h + 3 * cb * T * f.intermediate + layer_grad

    inputs = L * act_input  # with checkpointing, what each block keeps: its input
    saved = (inputs if ac else L * act_layer) + act_head
    phases: dict[str, dict] = {}
    if ac:  # the autocast cache keeps every weight's bf16 copy until the forward exits, checkpointed or not
        cached = working["all"] if (autocast_cache or fsdp) else working["head"] + working["layer"]
        phases["forward end"] = dict(working_weights=cached, activations=saved, logits_loss=logits)
    for name, loss in (("loss backward", loss_bwd), ("head backward", head_bwd)):
        phases[name] = dict(working_weights=working["head" if ac else "all"], activations=saved, logits_loss=loss)
    if ac:
        phases["block recompute"] = dict(working_weights=working["layer"], comm_buffers=comm,
                                         activations=inputs + act_layer - act_input + block_bwd)
    else:
        phases["last block backward"] = dict(working_weights=working["blocks"],
                                             activations=L * act_layer + block_bwd, comm_buffers=comm)
    phases["optimizer step"] = dict(optimizer_transient=shard(f.optimizer_transient)
                                    + f.matrix_transient[1 if fsdp else 0])  # Muon: whole matrices
    for name, extra in phases.items():
        if stepping and name in ("forward end", "loss backward", "head backward"):
            extra["gradients"] = -base["gradients"]
        elif stepping and name != "optimizer step":
            extra["optimizer_transient"] = block_step

    def assemble(extra: dict) -> dict:
        parts = dict.fromkeys(MemoryPlan.PARTS, 0)
        for source in (base, extra):
            for key, value in source.items():
                parts[key] += value
        return parts

    assembled = {name: assemble(extra) for name, extra in phases.items()}
    totals = {name: sum(parts.values()) for name, parts in assembled.items()}
    phase = max(totals, key=totals.get)
    parts = assembled[phase]
    total = totals[phase]
    allowance = int(CONTEXT_BYTES + FRAGMENTATION * total) if device_type == "cuda" else 0
    model_name = _plain(model_cfg).get("name")
    opt = _plain(optimizer_cfg)
    optimizer = opt["name"] + (f" (density {opt['density']:g})" if "density" in opt else "")
    settings = dict(model=model_name, optimizer=optimizer,
                    micro_batch_size=B, seq_len=S, world_size=n, parallelism=parallelism, precision=precision,
                    activation_checkpointing=ac, device_type=device_type,
                    gradient_as_bucket_view=gradient_as_bucket_view, autocast_cache=autocast_cache,
                    compiled_loss=compiled_loss, params=f.params, optimizer_in_backward=optimizer_in_backward,
                    grad_clip=grad_clip, accumulation=accumulation)
    return MemoryPlan(**parts, phase=phase, phases=totals, allowance=allowance, settings=settings)


def device_memory(device: torch.device | str) -> int:
    """Memory of `device` as the planner compares it: a GPU's total capacity as torch reports it,
    or the host's available memory for "cpu" (the planner's CPU total leaves out the interpreter
    and its libraries, ~1 GiB of resident memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        host = None
        try:
            with open("/proc/meminfo") as f:  # Linux
                for line in f:
                    if line.startswith("MemAvailable:"):
                        host = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
        if host is None:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limited = cgroup_available()  # a SLURM job's --mem, a container's limit
        return host if limited is None else min(host, limited)
    raise ValueError(f"device {device} is not supported by the memory planner; valid device types: cuda, cpu")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_available(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process's cgroups may still use (limit - usage + inactive file cache; the tightest of
    its cgroup and ancestors, where SLURM sets --mem), or None without a limit. cgroup v2 and v1;
    MemAvailable alone ignores these limits."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            names, base, inactive = ("memory.max", "memory.current"), root, "inactive_file"
        elif "memory" in controllers.split(","):  # v1
            names, base, inactive = ("memory.limit_in_bytes", "memory.usage_in_bytes"), os.path.join(root, "memory"), \
                "total_inactive_file"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the own cgroup, its ancestors, the mounted root
            directory = os.path.join(base, *parts[:depth])
            limit = _read_int(os.path.join(directory, names[0]))
            if limit is None or limit >= 1 << 60:  # v1 writes "no limit" as a huge number
                continue
            usage = _read_int(os.path.join(directory, names[1])) or 0
            reclaimable = _stat(os.path.join(directory, "memory.stat"), inactive)
            found.append(max(limit - usage + reclaimable, 0))
    return min(found) if found else None


def micro_batch_candidates(global_batch: int | None, world_size: int, limit: int = 1024) -> list[int]:
    """Micro-batches worth trying, largest first: divisors of the per-rank share of the global batch
    (so that micro x accumulation x world size = global batch), or powers of two up to `limit`."""
    if global_batch is None:
        return [2**k for k in range(int(math.log2(limit)), -1, -1)]
    _check_int("global_batch", global_batch, 1)
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} is not a multiple of world_size={world_size}; "
                         f"valid global batches: multiples of {world_size}")
    per_rank = global_batch // world_size
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def largest_micro_batch(model_cfg, optimizer_cfg, *, device_bytes: int, seq_len: int, world_size: int = 1,
                        global_batch: int | None = 512, **kwargs) -> tuple[int | None, MemoryPlan]:
    """The largest micro-batch whose plan (peak + allowance) fits `device_bytes`, and its plan; (None,
    plan of the smallest candidate) when nothing fits. Candidates: `micro_batch_candidates`. Other
    keyword arguments go to `plan_memory` (the step inside backward gets each candidate's accumulation).
    """
    _check_int("device_bytes", device_bytes, 1)
    plan = None
    for micro in micro_batch_candidates(global_batch, world_size):
        if kwargs.get("optimizer_in_backward") and global_batch:
            kwargs["accumulation"] = max(1, global_batch // (micro * world_size))
        plan = plan_memory(model_cfg, optimizer_cfg, micro_batch_size=micro, seq_len=seq_len,
                           world_size=world_size, **kwargs)
        if plan.fits(device_bytes):
            return micro, plan
    return None, plan
