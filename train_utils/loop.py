"""The parts of a training step and of an evaluation that train.py and eval.py share.

Loss: every step minimises the mean next-token loss over the *global* batch's non-pad targets; the
target count is all-reduced before the first backward and each micro-batch's summed loss is scaled by
world_size / global_tokens (DDP and FSDP2 then average over ranks), so the result does not depend on
how the batch is split. Validation weighs tokens the same way; perplexity = exp(val loss).
Precision: bf16-mixed = fp32 weights and state, bf16 autocast; bf16 = model (and state) in bf16; fp32.
The loss is always computed from fp32 logits. `compile_model` compiles each block's forward (one graph
for all; FSDP2's and checkpointing's hooks stay outside) and the loss, whose fused pass never
materialises eager cross-entropy's three fp32 logits-sized tensors (docs/memory_plan.md).
"""
from __future__ import annotations

import contextlib
import math
import random
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

import frugal


def autocast(precision: str, device: torch.device):
    """bf16 autocast for bf16-mixed; nothing for pure bf16 (the weights are bf16) and fp32."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over non-pad targets (labels == -100 are ignored), in fp32.
    Position t predicts token t+1, as in the HF models' own loss."""
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def to_device(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # non_blocking: from pinned memory the copy overlaps with the GPU's work; elsewhere it is a plain copy.
    return batch["input_ids"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True)


def _padded_to_max(batches: list[dict], device: torch.device) -> list[dict]:
    """Under FSDP2 every forward pass is collective (it gathers the weights), but the validation rows
    split unevenly over ranks: ranks with fewer batches run extra ones whose targets are all ignored
    (they add nothing to the sums)."""
    import torch.distributed as dist

    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    extra = int(count.item()) - len(batches)
    if not extra:
        return batches
    # A copy of a batch of this rank, or with no rows at all here a 1-row batch of pads.
    template = batches[0] if batches else {"input_ids": torch.zeros(1, 2, dtype=torch.long),
                                           "labels": torch.zeros(1, 2, dtype=torch.long)}
    filler = {"input_ids": template["input_ids"], "labels": torch.full_like(template["labels"], -100)}
    return batches + [filler] * extra


@torch.no_grad()
def evaluate(model, dm, eval_tokens: int, precision: str, accelerator, loss_fn=None) -> dict:
    """The validation loss, as `dm.eval_mode` (eval.mode) says; each rank scores its share of the
    fixed validation set and the sums are all-reduced. tokens (default): token-weighted; authors: the
    paper's mean of per-batch mean losses (data/stream.py, EVAL_MODES). Pads are at the end and attention
    is causal, so no padding mask. `loss_fn`: token_loss_sum, or its compiled twin (compile_model)."""
    from train_utils.distributed import is_sharded

    loss_fn = loss_fn or token_loss_sum
    mode = getattr(dm, "eval_mode", "tokens")
    was_training = model.training
    model.eval()
    device = accelerator.device
    # [sum of token losses, tokens, sum of per-batch mean losses, batches]
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    batches = dm.val_batches(eval_tokens)
    if is_sharded(model):
        batches = _padded_to_max(batches, device)
    for batch in batches:
        ids, labels = to_device(batch, device)
        with autocast(precision, device):
            logits = model(input_ids=ids, use_cache=False).logits
        loss, count = loss_fn(logits, labels).double(), count_targets(labels)
        sums[0] += loss
        sums[1] += count
        sums[2] += loss / count.clamp(min=1)  # a filler batch of FSDP2 (no targets) adds nothing
        sums[3] += (count > 0).double()
    sums = accelerator.reduce(sums, reduction="sum")
    model.train(was_training)
    loss_sum, tokens, mean_sum, n_batches = sums.tolist()
    loss = mean_sum / n_batches if mode == "authors" else loss_sum / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(tokens), "val_mode": mode}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def forward_backward(model, batches: list[dict], accelerator, precision: str,
                     loss_fn=None, accumulating=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the gradient of the global batch's mean token loss over this rank's `batches`.
    Returns this rank's summed token loss (float64) and the global target count, as tensors (no host
    sync). `accumulating`: the step in backward's context (frugal.StepInBackward.accumulating) for
    every micro-batch but the last, whose backward then updates on the summed gradients."""
    from train_utils.distributed import is_ddp

    loss_fn = loss_fn or token_loss_sum
    device = accelerator.device
    # Targets counted on the device: a host count copied over would be a second host sync per step.
    moved = [to_device(batch, device) for batch in batches]
    n_global = accelerator.reduce(sum(count_targets(labels) for _, labels in moved), reduction="sum")
    scale = accelerator.num_processes / n_global.float()  # ranks' gradients are averaged; x world makes it a sum
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, (ids, labels) in enumerate(moved):
        # DDP: skip the gradient all-reduce on all but the last micro-batch, accumulate locally. (FSDP2
        # reduce-scatters every micro-batch: see train_utils/distributed.py.)
        last = i == len(batches) - 1
        skip_sync = is_ddp(model) and not last
        accumulate = accumulating() if accumulating is not None and not last else contextlib.nullcontext()
        with model.no_sync() if skip_sync else contextlib.nullcontext(), accumulate:
            with autocast(precision, device):
                logits = model(input_ids=ids, use_cache=False).logits
            loss = loss_fn(logits, labels)
            (loss * scale).backward()
        loss_sum += loss.detach().double()
        del logits, loss  # free the activations' last references before the next forward
    return loss_sum, n_global


def ranks_in_sync(model) -> tuple[bool | None, float]:
    """Data parallelism must keep every rank's weights identical: a cheap check (one float per rank).
    Returns (in sync, the sum of every weight). Sharded (FSDP2) weights have no replicas to compare:
    (None, the sum over all shards), comparable with a DDP run's checksum up to float rounding."""
    from accelerate.utils import gather_object

    from train_utils.distributed import is_sharded
    from frugal.sharding import local

    checksum = sum(float(local(p.detach()).double().sum()) for p in model.parameters())
    sums = gather_object([checksum])
    if is_sharded(model):
        return None, math.fsum(sums)
    return len(set(sums)) == 1, checksum


class NonFiniteError(FloatingPointError):
    """A non-finite loss, gradient or state: the run stops before using it (the message names the
    step and the last checkpoint, which never holds non-finite values)."""


def grad_norm_(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The global gradient norm (`frugal.grad_norm`: fp32 per-tensor norms in the order of `params`, as
    the step inside backward sums them; FSDP2's shards all-reduced); clips in place to `max_norm` when
    set. No host sync."""
    norm = frugal.grad_norm(params)
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def norm_order(optimizer, model) -> list[torch.Tensor]:
    """The trainable parameters in the order the global norm sums them: the optimizer's (its
    param_groups, the order of the step inside backward), then any it does not hold."""
    held = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    ids = {id(p) for p in held}
    return held + [p for p in model.parameters() if p.requires_grad and id(p) not in ids]


class StepTotals(NamedTuple):
    """What the step's one host sync brings back (every rank has the same)."""
    loss: float  # the global mean loss over scored targets
    grad_norm: float  # before clipping
    targets: int  # scored targets, all ranks
    stop_votes: int  # ranks that received a stop signal
    events: int  # data events, all ranks


def step_totals(accelerator, loss_sum: torch.Tensor, norm: torch.Tensor, n_global: torch.Tensor,
                stop_received, events: int = 0) -> StepTotals:
    """The step's one host sync (StepTotals). One all-reduce of [this rank's loss sum, its stop vote,
    its count of data events]."""
    # Filled on the device: torch.tensor([...], device=cuda) would be a blocking copy from host memory,
    # a second sync per step. Scalar fills are kernels; loss_sum is copied device to device.
    mine = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    mine[0] = loss_sum
    mine[1] = float(stop_received is not None)
    mine[2] = float(events)
    summed = accelerator.reduce(mine, reduction="sum")
    loss_total, votes, all_events, grad_norm, targets = torch.cat(
        [summed, norm.double().view(1), n_global.double().view(1)]).tolist()
    return StepTotals(loss_total / targets, grad_norm, int(targets), int(votes), int(all_events))


def gather_events(events: list[dict], total: int) -> list[dict]:
    """Every rank's data events (e.g. a reader of another rank that wrapped around an epoch) for rank
    0's log; `total`, the all-ranks count from `step_totals`, is 0 on almost every step, and then no
    collective runs."""
    if not total or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return events
    from accelerate.utils import gather_object

    return list(gather_object(events))


def seed_dropout(seed: int, rank: int, offset: int = 0) -> None:
    """Give this rank its own random stream (dropout masks), once the weights were initialised from
    the shared seed: identical initial weights, different masks on every rank. The stream is part of
    the checkpoint's per-rank RNG state, so a resume on the same process count continues it exactly."""
    torch.manual_seed(int(np.random.SeedSequence([seed, rank, offset]).generate_state(1, np.uint64)[0]))


def compile_model(model):
    """Compile each transformer block's forward in place (module docstring); return the compiled loss.
    Parameter names and hooks are unchanged, so checkpoints and FSDP2 see the same model. Call it
    before `wrap_model`, before or after `enable_activation_checkpointing`."""
    from frugal.grouping import transformer_blocks

    for block in transformer_blocks(model):
        block._compiled_forward = torch.compile(block.forward)
        _install_forward(block)
    return torch.compile(token_loss_sum)


def _install_forward(block) -> None:
    """A compiled block's forward, checkpointed outside the compiled graph when checkpointing is on:
    transformers' own checkpoint is skipped under FSDP2 (which swaps the block's class) and inside the
    compiled graph keeps more activations, so our non-reentrant checkpoint wraps the compiled forward."""
    compiled = block.__dict__.get("_compiled_forward")
    if compiled is None:  # eager: transformers' per-block checkpointing works, FSDP2 included
        return
    if getattr(block, "gradient_checkpointing", False):
        block.gradient_checkpointing = False
        block._checkpoint_outside = True
    if not block.__dict__.get("_checkpoint_outside"):
        block.forward = compiled
        return
    from torch.utils.checkpoint import checkpoint

    def forward(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return checkpoint(compiled, *args, use_reentrant=False, **kwargs)
        return compiled(*args, **kwargs)

    forward.checkpointed = True
    block.forward = forward


def compile_wanted(setting, device: torch.device) -> bool:
    """train.compile: true, false, or auto (compile on GPUs, where it pays off; eager on CPU, where
    compiling takes longer than a short run)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def allow_tf32(enabled: bool, device: torch.device) -> bool:
    """TF32 for fp32 matmuls and convolutions on Ampere or newer GPUs (train.tf32). Mixed precision
    computes its matmuls in bf16 already; this speeds up what stays fp32 (train.precision=fp32, ops
    outside autocast). Returns whether TF32 is on."""
    on = bool(enabled) and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    return on


def enable_activation_checkpointing(model) -> None:
    """Recompute each transformer block in the backward pass instead of keeping its activations
    (transformers' per-block checkpointing; our own around compiled blocks, see `_install_forward`).
    Non-reentrant: works with autocast, and restores the RNG state for the recomputation, so dropout
    masks are those of the forward pass."""
    from frugal.grouping import transformer_blocks

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (the old name warns there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for block in transformer_blocks(model):
        _install_forward(block)


def block_checkpointed(block) -> bool:
    """Whether the block's activations are really recomputed in backward, read from what its forward
    call runs: our checkpoint around a compiled forward, or transformers' own wrapper (the class's
    forward, with the flag on); not a flag that a compiled forward bypasses."""
    own = block.__dict__.get("forward")
    if own is not None:
        return bool(getattr(own, "checkpointed", False))
    return bool(getattr(block, "gradient_checkpointing", False))


def activation_checkpointing_on(model) -> bool:
    """True when every transformer block is checkpointed (block_checkpointed), whatever the flags say."""
    from frugal.grouping import transformer_blocks

    return all(block_checkpointed(block) for block in transformer_blocks(model))


def saved_tensor_bytes(run) -> int:
    """Bytes of the distinct storages that autograd saves for backward while `run()` executes (a
    forward pass): activation checkpointing measured, not assumed. Every storage counts once."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr(), tensor.device] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    del out
    return sum(storages.values())


def training_batches(dm):
    """`dm.train_batches()`, started without a trace in the global RNG: a DataLoader draws its base
    seed from it when it starts, and in a resumed run that extra draw would shift every later dropout
    mask (the run would no longer equal the uninterrupted one)."""
    batches = dm.train_batches()
    with torch.random.fork_rng(devices=[]):
        first = next(batches)
    yield first
    yield from batches
