"""Per-rank peak device memory of a training run: does it fit, and with what micro-batch?

    python -m bench.memory_plan model=llama_7b optimizer=frugal_rho0 train.micro_batch_size=8
    python -m bench.memory_plan model=llama_7b optimizer=frugal_rho0 --search      # largest micro-batch
    python -m bench.memory_plan experiment=table5_3b optimizer=adamw --world-size 8 --parallelism fsdp
    python -m bench.memory_plan experiment=table2 model=llama_1b --gpu-hours --device h100-80gb   # and its cost
    python -m bench.memory_plan --table                                  # the paper's models, 8 x 80 GB A100
    python -m bench.memory_plan --validate             # real CPU steps measured beside their plans (~30 s)

Positional arguments are Hydra overrides, composed as train.py composes its config (options below
override it). A run that does not fit is followed by the single changes that would make it fit,
cheapest first (exit code 1). The vocabulary is the model's unless `--vocab-size` (data=synthetic: 512).
Planned on the meta device by `train_utils.memory_plan`; what is counted and how it was validated:
docs/memory_plan.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf

from frugal.grouping import transformer_blocks
from train_utils.memory_check import in_backward_settings
from train_utils.schema import bad_group_choice
from train_utils.memory_plan import (
    DEVICES, GIB, PARALLELISMS, PRECISIONS, largest_micro_batch, plan_memory,
)

ROOT = Path(__file__).resolve().parent.parent

TABLE_MODELS = ["llama_60m", "llama_130m", "llama_350m", "llama_1b", "llama_3b", "llama_7b"]
TABLE_OPTIMIZERS = {"AdamW": "adamw", "FRUGAL 0.25": "frugal", "FRUGAL 0": "frugal_rho0", "GaLore": "galore",
                    "BAdam": "badam"}
TABLE_SETTINGS = [("DDP", "ddp", False), ("DDP + AC", "ddp", True), ("FSDP2", "fsdp", False),
                  ("FSDP2 + AC", "fsdp", True)]


def compose(overrides: list[str]):
    """The config train.py would run with these overrides."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_settings(cfg, args) -> dict:
    """Planner keywords from the composed config, with the command-line options on top."""
    def pick(option, key: str, default=None):
        return option if option is not None else OmegaConf.select(cfg, key, default=default)

    micro = pick(args.micro_batch, "train.micro_batch_size")
    if micro == "auto":  # train.py's default: the whole per-process share when it fits (--search: what fits)
        micro = max(1, int(cfg.train.batch_size) // args.world_size)
    return dict(
        micro_batch_size=micro,
        seq_len=pick(args.seq_len, "data.seq_len"),
        # auto (the quickstart's default) is bf16-mixed on the GPUs this script plans for
        precision=(lambda p: "bf16-mixed" if p == "auto" else p)(pick(args.precision, "train.precision")),
        parallelism=pick(args.parallelism, "train.parallelism", "ddp"),
        activation_checkpointing=pick(args.activation_checkpointing, "train.activation_checkpointing", False),
        world_size=args.world_size,
        vocab_size=args.vocab_size,
        gradient_as_bucket_view=not args.no_bucket_view,
        autocast_cache=not args.no_autocast_cache,
        compiled_loss=args.compiled_loss if args.compiled_loss is not None else
        OmegaConf.select(cfg, "train.compile", default=False) is True,
        **in_backward_settings(OmegaConf.merge(cfg, {"train": {"micro_batch_size": micro}}), args.world_size),
    )


def device_bytes(args) -> int:
    return int(args.device_gib * GIB) if args.device_gib else DEVICES[args.device]


def search(cfg, settings: dict, args) -> list[tuple]:
    """(activation checkpointing, micro-batch or None, plan) per checkpointing setting asked: the largest
    power of two that fits, whatever the batch; in backward, one micro-batch per step (no accumulation)."""
    settings = dict(settings)
    settings.pop("micro_batch_size")
    if settings.get("optimizer_in_backward"):
        settings["accumulation"] = 1
    ac_given = args.activation_checkpointing is not None
    rows = []
    for ac in ([settings["activation_checkpointing"]] if ac_given else [False, True]):
        settings["activation_checkpointing"] = ac
        micro, plan = largest_micro_batch(cfg.model, OmegaConf.to_container(cfg.optimizer, resolve=True),
                                          device_bytes=device_bytes(args), global_batch=None, **settings)
        rows.append((ac, micro, plan))
    return rows


# ---- a run that does not fit: what would ---------------------------------------------------------
def what_would_fit(cfg, overrides: list[str], args) -> list[tuple[str, float, str]]:
    """(change, GiB required, cost) of the changes that would fit a run that does not: what keeps the
    algorithm and the batch first, then the optimizer's state, then more GPUs (FSDP2); when no single
    change of the first kind fits, they are tried together (then with 8-bit moments)."""
    import frugal

    budget, tc, opt = device_bytes(args), cfg.train, cfg.optimizer
    frugal_based = cfg.optimizer.name in frugal.registry.frugal_based()
    settings = run_settings(cfg, args)
    micro, share = settings["micro_batch_size"], max(1, int(tc.batch_size) // args.world_size)
    smaller = [m for m in (micro // 2 ** k for k in range(1, 12)) if m >= 1 and share % m == 0]
    keep = []  # (changes, cost): the algorithm and the batch stay
    if not settings["activation_checkpointing"]:
        keep.append((["train.activation_checkpointing=true"], "recomputes each block's forward (~1/3 more compute)"))
    keep += [([f"train.micro_batch_size={m}"], f"the same batch in {share // m} micro-batches") for m in smaller]
    if frugal_based and not tc.get("optimizer_in_backward") and (args.world_size == 1 or tc.parallelism == "fsdp"):
        keep.append((["train.optimizer_in_backward=true", f"train.micro_batch_size={share}"],
                     "FRUGAL's step inside backward, the batch in one micro-batch"))
    state = []
    if frugal_based and opt.get("projection") == "block" and opt.get("state_precision", "param") == "param":
        state.append((["optimizer.state_precision=8bit"], "8-bit moments (bitsandbytes' blockwise format)"))
    if frugal_based and opt.get("density", 0) > 0:
        state.append((["optimizer.density=0"], "another algorithm: no state-full blocks"))

    def fitting(changes: list[str], world: int | None = None) -> float | None:
        """GiB required by the plan with these changes (and world size) where it fits, else None."""
        local = argparse.Namespace(**{**vars(args), "world_size": world or args.world_size})
        try:
            changed = compose(overrides + changes)
            plan = plan_memory(changed.model, OmegaConf.to_container(changed.optimizer, resolve=True),
                               **run_settings(changed, local))
        except (ValueError, HydraException):
            return None
        return plan.required / GIB if plan.fits(budget) else None

    found: list[tuple[str, float, str]] = []
    for changes, cost in keep:
        if changes[0].startswith("train.micro_batch_size") and any("micro_batch" in f[0] for f in found):
            continue  # the largest micro-batch that fits is enough
        gib = fitting(changes)
        if gib is not None:
            found.append((" ".join(changes), gib, cost))
    if not found and keep:  # together: first without touching the state, then with 8-bit moments
        for extra in ([], [c for changes, _ in state[:1] for c in changes if "precision" in c]):
            together = sorted({c for changes, _ in keep for c in changes if "micro_batch_size" not in c} | set(extra))
            in_backward = "train.optimizer_in_backward=true" in together
            for m in [share] + [m for m in (share // 2 ** k for k in range(1, 12)) if m >= 1 and share % m == 0]:
                changes = together + [f"train.micro_batch_size={m}"]
                if in_backward and m < share:  # accumulation would hold every gradient: a smaller batch
                    changes.append(f"train.batch_size={m * args.world_size}")
                gib = fitting(changes)
                if gib is not None:
                    found.append((" ".join(changes), gib, "together" + (" (a smaller batch)" if m < share else "")))
                    break
            if found:
                break
    found += [(" ".join(c), gib, cost) for c, cost in state if (gib := fitting(c)) is not None]
    if tc.parallelism != "fsdp" or args.world_size == 1:
        for n in (2, 4, 8):
            gib = fitting(["train.parallelism=fsdp"], n)
            if gib is not None:
                found.append((f"train.parallelism=fsdp --world-size {n}", gib, f"FSDP2 over {n} GPUs"))
                break
    return found


def format_what_would_fit(found: list[tuple[str, float, str]]) -> str:
    if not found:
        return ("  nothing tried fits (checkpointing, micro-batch, the step in backward, 8-bit moments, density 0, "
                "FSDP2 up to 8 GPUs)")
    width = max(len(change) for change, _, _ in found)
    return "\n".join(["  what would fit (cheapest first):"] +
                     [f"    {change.ljust(width)}  {gib:6.2f} GiB  {cost}" for change, gib, cost in found])


# ---- what a run costs in GPU-hours -----------------------------------------------------------------
# Dense bf16 tensor-core peaks of the --device classes (data sheets); a 24 GB card counts as an RTX 4090.
DEVICE_PEAK_FLOPS = {"rtx-24gb": 165e12, "l4": 121e12, "a10": 125e12, "a100-40gb": 312e12, "a100-80gb": 312e12,
                     "h100-80gb": 989e12, "h200": 989e12}
DEFAULT_MFU = 0.4


def gpu_hours(cfg, device: str, mfu: float) -> dict:
    """A run's training FLOPs (train_utils.measure.flops_per_position; evaluations not counted) over
    ``device``'s dense bf16 peak at ``mfu``."""
    import torch

    import models
    from train_utils.measure import flops_per_position

    with torch.device("meta"):
        model = models.build_model(cfg.model)
    per_position = flops_per_position(model, cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.data.seq_len)
    positions = int(cfg.train.steps) * int(cfg.train.batch_size) * int(cfg.data.seq_len)
    flops = per_position * positions
    return {"flops": flops, "positions": positions, "device": device, "peak_flops": DEVICE_PEAK_FLOPS[device],
            "mfu": mfu, "gpu_hours": flops / (DEVICE_PEAK_FLOPS[device] * mfu) / 3600}


def format_gpu_hours(est: dict, measured: bool) -> str:
    source = "measured" if measured else "assumed (pass --mfu with a measured one, e.g. ops/preflight.py's)"
    return (f"compute estimate: {est['flops']:.3g} FLOPs ({est['positions']:,} trained positions), on "
            f"{est['device']} ({est['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16) at MFU {est['mfu']:.0%} "
            f"{source}: ~{est['gpu_hours']:,.0f} GPU-hours (an estimate; evaluations not counted)")


def usable_micro_batch(micro: int, batch: int, world_size: int) -> str | None:
    """What train.py can take when the largest micro-batch that fits does not divide the batch's share."""
    share, rest = divmod(int(batch), world_size)
    if rest or share % micro == 0:
        return None
    usable = max(m for m in range(1, min(micro, share) + 1) if share % m == 0)
    return (f"  train.batch_size={batch} over {world_size} process(es) needs a micro-batch that divides {share}: "
            f"train.micro_batch_size={usable}" + (f", or train.batch_size={micro * world_size} (or a multiple of it) "
                                                  f"to use {micro}" if micro > usable else ""))


def table(args) -> str:
    """Markdown: per model and optimizer, the largest micro-batch that fits and its per-rank peak."""
    dev = device_bytes(args)
    head = "| model | optimizer | " + " | ".join(name for name, _, _ in TABLE_SETTINGS) + " |"
    lines = [f"Per-rank peak allocated memory (GiB) at the largest micro-batch that fits {dev / GIB:.2f} GiB "
             f"with the allowance, {args.world_size} GPUs, global batch 512 x 256 tokens, bf16-mixed. "
             "Cell: micro-batch / peak (required incl. allowance); '-' = nothing fits; 'refused' = the optimizer "
             "refuses FSDP2 shards (svd needs whole matrices).", "", head,
             "|---|---|" + "---|" * len(TABLE_SETTINGS)]
    for model in args.models:
        for label, opt_name in TABLE_OPTIMIZERS.items():
            if opt_name not in args.optimizers:
                continue
            cfg = compose([f"model={model}", f"optimizer={opt_name}", "experiment=table2"])
            opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
            cells = []
            for _, parallelism, ac in TABLE_SETTINGS:
                if parallelism == "fsdp" and opt.get("projection") in ("svd", "random"):
                    cells.append("refused")  # GaLore's bases need whole matrices, not FSDP2 shards
                    continue
                micro, plan = largest_micro_batch(cfg.model, opt, device_bytes=dev, seq_len=256,
                                                  world_size=args.world_size, global_batch=512,
                                                  parallelism=parallelism, activation_checkpointing=ac)
                cells.append("-" if micro is None else
                             f"{micro} / {plan.total / GIB:.1f} ({plan.required / GIB:.1f})")
            lines.append(f"| {model} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- validation: the plan against the allocator's peak of real steps on CPU ---------------------------
@dataclass(frozen=True)
class Case:
    """A CPU training run to measure. wrapper: "none", "ddp" (bucket view, zeroed in place: the loop's),
    "ddp-no-view", "ddp-set-to-none", "fsdp" (per block and root, bf16 weights, fp32 reduce). compiled:
    train.compile. in_backward: frugal.step_in_backward with max_norm 1.0, one micro-batch per step."""
    model: str
    vocab: int | None
    optimizer: dict
    micro: int
    seq: int
    checkpointing: bool = False
    precision: str = "bf16-mixed"
    wrapper: str = "none"
    compiled: bool = False
    in_backward: bool = False


_SWITCHING = {"name": "frugal", "density": 0.25, "update_gap": 1}  # a block switch at the second step
# bf16 autocast (the loop's default) where precision is the point: the logits, the autocast cache, FSDP2's
# policy, the compiled loss. A case about an optimizer's or a DDP wrapper's own tensors runs in fp32: its
# step holds the same tensors, and bf16 matmuls cost ~10x fp32 on a CPU without native bf16 (AVX2 only); for
# that reason too, bf16 cases take as few tokens as keep the plan as close (docs/memory_plan.md, Validation).
VALIDATION_CASES = [
    Case("llama_20m", None, {"name": "adamw"}, 1, 128, precision="fp32"),  # 32000 in bf16-mixed: the next, llama_tiny
    Case("llama_20m", None, _SWITCHING, 1, 128, checkpointing=True),
    Case("llama_20m", 1000, {"name": "adamw"}, 2, 256),
    Case("llama_20m", 1000, _SWITCHING, 2, 256, checkpointing=True),
    Case("llama_tiny", None, {"name": "frugal", "density": 0.0}, 4, 64),
    # The autocast cache: every bf16 weight copy alive at the end of a checkpointed forward (~20% here).
    Case("llama_60m", 1000, {"name": "frugal", "density": 0.0}, 1, 32, checkpointing=True),
    Case("llama_20m", 256, {"name": "frugal", "density": 0.25, "projection": "column"}, 2, 256, checkpointing=True,
         precision="fp32"),
    Case("llama_20m", 1000, {"name": "galore", "density": 0.25, "update_gap": 1}, 2, 256, precision="fp32"),
    Case("llama_20m", 1000, {"name": "frugal", "density": 0.25, "projection": "randk", "update_gap": 1}, 4, 128,
         precision="fp32"),
    Case("llama_20m", 1000, {"name": "frugal", "density": 0.25, "state_full": "lion", "betas": [0.9, 0.99],
                             "update_gap": 1}, 4, 128, precision="fp32"),
    Case("llama_20m", 1000, {"name": "adamw"}, 2, 128, precision="bf16"),
    Case("llama_20m", 1000, _SWITCHING, 4, 128, precision="fp32"),
    Case("llama_20m", 1000, {"name": "adamw"}, 2, 128, precision="fp32", wrapper="ddp"),
    Case("llama_20m", 1000, {"name": "adamw"}, 2, 128, precision="fp32", wrapper="ddp-no-view"),
    Case("llama_20m", 1000, {"name": "adamw"}, 2, 128, precision="fp32", wrapper="ddp-set-to-none"),
    Case("llama_20m", 1000, {"name": "adamw"}, 4, 128, wrapper="fsdp"),
    Case("llama_20m", 1000, {"name": "adamw"}, 4, 128, checkpointing=True, wrapper="fsdp"),
    Case("llama_20m", 1000, _SWITCHING, 4, 128, wrapper="fsdp"),
    # The compiled loss: the logits' gradient instead of three fp32 log-softmax tensors (the eager
    # twin is the llama_tiny case above).
    Case("llama_tiny", None, {"name": "frugal", "density": 0.0}, 4, 64, compiled=True),
    # 8-bit moments (frugal.state_precision): fp32 weights, and pure bf16 with stochastic rounding
    Case("llama_20m", 1000, {**_SWITCHING, "state_precision": "8bit"}, 4, 128, precision="fp32"),
    Case("llama_20m", 1000, {**_SWITCHING, "state_precision": "8bit", "stochastic_rounding": True}, 2, 128,
         precision="bf16"),
    # The step inside backward with clipping: the 7B recipe (rho 0, pure bf16, checkpointing) and rho 0.25
    # with a block switch (the state-full blocks' gradients wait for the norm)
    Case("llama_20m", 1000, {"name": "frugal", "density": 0.0, "stochastic_rounding": True}, 4, 128,
         checkpointing=True, precision="bf16", in_backward=True),
    Case("llama_20m", 1000, _SWITCHING, 4, 128, precision="fp32", in_backward=True),
]


def plan_case(case: Case, phase: str | None = None) -> int:
    """Planned peak of a case (or of one phase of its step), in bytes."""
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{case.model}.yaml"))
    # set_to_none=True: no_sync micro-batches allocate gradients beside DDP's buckets (two copies but in the step)
    copy = case.wrapper == "ddp-no-view" or (case.wrapper == "ddp-set-to-none" and phase is None)
    # per-rank DDP memory does not depend on the world size, but a plan of one process has no DDP
    plan = plan_memory(model, case.optimizer, micro_batch_size=case.micro, seq_len=case.seq,
                       activation_checkpointing=case.checkpointing, precision=case.precision,
                       vocab_size=case.vocab, device_type="cpu", gradient_as_bucket_view=not copy,
                       world_size=2 if case.wrapper.startswith("ddp") else 1,
                       parallelism="fsdp" if case.wrapper == "fsdp" else "ddp", compiled_loss=case.compiled,
                       optimizer_in_backward=case.in_backward, grad_clip=case.in_backward, accumulation=1)
    return plan.phases[phase] if phase else plan.total


def measure_case(case: Case) -> tuple[int, int]:
    """(peak, peak inside optimizer.step) of allocated memory (the profiler's allocation events: the CPU
    twin of torch.cuda.max_memory_allocated) over two steps of two micro-batches, built as the loop
    builds them; needs a one-process torch.distributed group. Why so: docs/memory_plan.md, Validation."""
    import gc

    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    import frugal
    import models

    from train_utils.loop import compile_model, token_loss_sum

    # earlier cases' reference cycles (FSDP2, DDP's reducer), collected later, would lower this case's totals
    gc.collect()
    cfg = OmegaConf.load(ROOT / "configs" / "model" / f"{case.model}.yaml")
    vocab, ddp, accumulation = case.vocab or cfg.vocab_size, case.wrapper.startswith("ddp"), 2
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = models.build_model(cfg, vocab_size=vocab)
        if case.precision == "bf16":
            model.to(torch.bfloat16)
        if case.checkpointing:  # per transformer block, non-reentrant, through the transformers API
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        wrapped = model
        loss_fn = compile_model(model) if case.compiled else token_loss_sum
        if ddp:
            from torch.nn.parallel import DistributedDataParallel

            # init_sync=False: the construction-time broadcast's flat buffer sometimes outlived the
            # measured steps (docs/memory_plan.md, "Two full-suite failures")
            wrapped = DistributedDataParallel(model, gradient_as_bucket_view=case.wrapper != "ddp-no-view",
                                              init_sync=False)
        elif case.wrapper == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in transformer_blocks(model):  # as train_utils/distributed.py shards them
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        hp = dict(case.optimizer)
        optimizer = frugal.build_optimizer(model, hp.pop("name"), **hp)
        if case.in_backward:
            frugal.step_in_backward(optimizer, max_norm=1.0, model=model)
        two_steps(case, wrapped, optimizer, loss_fn, vocab, 1 if case.in_backward else accumulation)
        del wrapped, model, optimizer
    events = []

    def walk(node, in_step: bool) -> None:
        in_step = in_step or node.name == "optimizer_step"
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated, in_step))
        for child in node.children:
            walk(child, in_step)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    events.sort(key=lambda e: e[0])
    start = events[0][2] - events[0][1]  # what was allocated before: not this run's
    return max(e[2] for e in events) - start, max(e[2] for e in events if e[3]) - start


def two_steps(case: Case, wrapped, optimizer, loss_fn, vocab: int, accumulation: int) -> None:
    """Two optimizer steps of `accumulation` micro-batches each, the step marked "optimizer_step"."""
    import contextlib

    import torch
    from torch.profiler import record_function

    ddp = case.wrapper.startswith("ddp")
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for i in range(accumulation):
            ids = torch.randint(1, vocab, (case.micro, case.seq), generator=generator)
            sync = not ddp or i == accumulation - 1
            with contextlib.nullcontext() if sync else wrapped.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed"):
                    logits = wrapped(input_ids=ids, use_cache=False).logits
                loss = loss_fn(logits, ids)
                (loss / ids.numel()).backward()
            del logits, loss
        with record_function("optimizer_step"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=case.wrapper != "ddp")


def validate(cases: list[Case]) -> list[tuple[int, int]]:
    """Measure every case in this process, inside a one-process gloo group."""
    import gc
    import tempfile

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            measured = []
            for case in cases:
                # Earlier cases' garbage collected, what survives frozen (gc.freeze): each case's own
                # gc.collect then walks only the objects made since, not the interpreter's whole heap
                # (~0.2 s a case after torch and transformers are imported).
                gc.collect()
                gc.freeze()
                measured.append(measure_case(case))
            return measured
        finally:
            dist.destroy_process_group()


def every_nth(items: list, spec: str | None, ap: argparse.ArgumentParser) -> list:
    """`--cases K/N`: every N-th item from the K-th (0-based), to spread cases over processes; all without it."""
    if not spec:
        return items
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        ap.error(f"--cases {spec!r}: expected K/N with 0 <= K < N, e.g. 0/2")
    return items[k::n]


def validation_table(cases: list[Case], measured: list[tuple[int, int]]) -> str:
    mib = 2.0**20
    lines = ["| model (vocab) | optimizer | micro x seq | AC | precision | wrapper | measured MiB | planned MiB "
             "| planned / measured | step: measured | step: planned |", "|---" * 11 + "|"]
    for case, (peak, step) in zip(cases, measured):
        planned, step_planned = plan_case(case), plan_case(case, "optimizer step")
        opt = ", ".join(f"{k}={v}" for k, v in case.optimizer.items() if k != "name")
        lines.append(f"| {case.model} ({case.vocab or 32000}) | {case.optimizer['name']} {opt} | "
                     f"{case.micro} x {case.seq} | {'on' if case.checkpointing else 'off'} | {case.precision} | "
                     f"{case.wrapper} | {peak / mib:.1f} | {planned / mib:.1f} | {planned / peak:.3f} | "
                     f"{step / mib:.1f} | {step_planned / mib:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (model=..., optimizer=...)")
    ap.add_argument("--micro-batch", type=int, help="sequences per device and forward pass")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--world-size", type=int, default=1, help="processes (GPUs); default 1")
    ap.add_argument("--parallelism", choices=PARALLELISMS)
    ap.add_argument("--precision", choices=PRECISIONS)
    ap.add_argument("--activation-checkpointing", choices=["on", "off"], help="per block (--search: both if not given)")
    ap.add_argument("--vocab-size", type=int, help="the data's vocabulary (default: the model's)")
    ap.add_argument("--device", choices=sorted(DEVICES), default="a100-80gb")
    ap.add_argument("--device-gib", type=float, help="device memory in GiB (instead of --device)")
    ap.add_argument("--no-bucket-view", action="store_true", help="DDP without gradient_as_bucket_view")
    ap.add_argument("--no-autocast-cache", action="store_true", help="autocast without cached bf16 weight copies")
    ap.add_argument("--compiled-loss", action="store_true", default=None,
                    help="the compiled loss: 4 instead of 14 bytes per token and vocabulary entry (default: "
                         "train.compile=true; auto counts as eager)")
    ap.add_argument("--search", action="store_true", help="find the largest micro-batch that fits")
    ap.add_argument("--gpu-hours", action="store_true", help="also estimate the run's GPU-hours on --device at --mfu")
    ap.add_argument("--mfu", type=float, default=None,
                    help=f"for --gpu-hours (default {DEFAULT_MFU * 100:.0f}%%, assumed; e.g. ops/preflight.py's)")
    ap.add_argument("--table", action="store_true", help="the planner's table for the paper's models")
    ap.add_argument("--models", nargs="+", default=TABLE_MODELS, help="with --table")
    ap.add_argument("--optimizers", nargs="+", default=list(TABLE_OPTIMIZERS.values()), help="with --table")
    ap.add_argument("--validate", action="store_true", help="measure real CPU steps (minutes) beside the plans")
    ap.add_argument("--json", action="store_true", help="print the plan (with --validate: the measurements) as JSON")
    ap.add_argument("--cases", default=None, metavar="K/N", help="with --validate: every N-th case from the K-th")
    args = ap.parse_args(argv)
    if args.activation_checkpointing is not None:
        args.activation_checkpointing = args.activation_checkpointing == "on"

    if args.mfu is not None and not 0 < args.mfu <= 1:
        ap.error(f"--mfu {args.mfu}: expected a fraction in (0, 1], e.g. 0.4")
    if (args.gpu_hours or args.mfu is not None) and args.device_gib:
        ap.error("--gpu-hours needs a GPU class (--device), not --device-gib: its peak FLOP/s")
    if args.validate:
        cases = every_nth(VALIDATION_CASES, args.cases, ap)
        measured = validate(cases)
        print(json.dumps(measured) if args.json else validation_table(cases, measured))
        return 0
    if args.table:
        if args.world_size == 1:
            args.world_size = 8
        print(table(args))
        return 0
    bad_choice = bad_group_choice(args.overrides)
    if bad_choice:
        print(f"error: {bad_choice}", file=sys.stderr)
        return 2
    try:
        cfg = compose(args.overrides)
        settings = run_settings(cfg, args)
        if args.search:
            for ac, micro, plan in search(cfg, settings, args):
                checkpointing = "on" if ac else "off"
                if micro is None:
                    print(f"activation checkpointing {checkpointing}: no micro-batch fits; the smallest:")
                else:
                    print(f"activation checkpointing {checkpointing}: largest micro-batch that fits: {micro}")
                    usable = usable_micro_batch(micro, cfg.train.batch_size, args.world_size)
                    if usable:
                        print(usable)
                print(json.dumps(plan.as_dict()) if args.json else plan.format(device_bytes(args)))
            return 0
        plan = plan_memory(cfg.model, OmegaConf.to_container(cfg.optimizer, resolve=True), **settings)
        fits = plan.fits(device_bytes(args))
        found = [] if fits else what_would_fit(cfg, args.overrides, args)
        cost = gpu_hours(cfg, args.device, args.mfu or DEFAULT_MFU) if args.gpu_hours else None
    except (ValueError, HydraException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**plan.as_dict(), **({} if fits else {"what_would_fit": found}),
                          **({"compute": cost} if cost else {})}))
    else:
        print(plan.format(device_bytes(args)))
        if not fits:
            print(format_what_would_fit(found))
        if cost:
            print(format_gpu_hours(cost, args.mfu is not None))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
