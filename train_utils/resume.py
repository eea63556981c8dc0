"""Continuing a run: which checkpoint, whether this config still describes its run, and restoring it
(docs/reliability.md).

`train.resume=auto` takes the run dir's newest checkpoint that passes its manifest check (damaged ones
are renamed `<name>.damaged` and reported); `train.resume=<dir>` a checkpoint (verified; damaged is an
error, since it was chosen by name) or a run dir's newest intact one; `never` starts over. The saved
config is compared key by key: keys outside FREE_TO_CHANGE may differ only when named in
`train.resume_changes` (a name covers the keys under it), and named changes are applied for real (new
hyperparameters on the checkpoint's moments, the schedule rebuilt at its step). Another process count:
weights, state, schedule and the global data position are exact (sharded state: sharded_checkpoint.py);
per-rank dropout streams and float summation order are not. Same process count: bitwise on CPU.
"""
from __future__ import annotations

import os
import sys

import torch
from omegaconf import OmegaConf

from data import merge_states
from frugal import HyperparameterError
from train_utils import checkpoint as ckpt
from train_utils.validation import ConfigError
from train_utils.loop import NonFiniteError, seed_dropout
from train_utils.metrics import read_metrics

# Settings that change only what is logged, evaluated or checkpointed, or the speed, not the numbers.
# Not train.compile, train.tf32: they change the floating-point results.
FREE_TO_CHANGE = (
    "train.eval_every", "train.eval_tokens", "train.require_eval_tokens", "train.log_every",
    "train.progress_bar", "train.plot", "train.resume", "train.resume_changes", "train.collective_timeout_s",
    "train.peak_flops", "train.activation_checkpointing", "train.memory_check",
    "data.num_workers", "data.pin_memory", "wandb", "eval",  # eval.mode: how evaluations score (rows name it)
    # paper.*: the preset's labels and per-model tables; what they set is compared where it lands
    "checkpoint", "paper",
)
ABSENT = "<absent>"


def _covers(name: str, key: str) -> bool:
    return key == name or key.startswith(name + ".")


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def config_changes(saved_yaml: str, cfg) -> dict[str, tuple]:
    """{dotted key: (checkpoint's value, this run's value)} for every key that differs and is not free."""
    old = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True))
    new = _flat(OmegaConf.to_container(cfg, resolve=True))
    return {k: (old.get(k, ABSENT), new.get(k, ABSENT)) for k in sorted(old.keys() | new.keys())
            if old.get(k, ABSENT) != new.get(k, ABSENT) and not any(_covers(f, k) for f in FREE_TO_CHANGE)}


def check_changes(changes: dict, named, ckpt_dir: str, cfg) -> None:
    """Raise ConfigError unless every changed key is named in train.resume_changes."""
    named = list(named or [])
    keys = set(_flat(OmegaConf.to_container(cfg, resolve=True))) | set(changes)
    for name in named:
        if not isinstance(name, str) or not any(_covers(name, k) for k in keys):
            raise ConfigError(f"train.resume_changes names {name!r}, which is not a key of this config "
                              f"(expected dotted keys such as optimizer.lr, train.steps or schedule)")
    unnamed = {k: v for k, v in changes.items() if not any(_covers(n, k) for n in named)}
    if unnamed:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in unnamed.items())
        keys_text = ",".join(unnamed)
        raise ConfigError(
            f"this config differs from the one the checkpoint {ckpt_dir} was trained with: {listed}. Resume with "
            f"the checkpoint's settings (its config.yaml), or apply the change on purpose with "
            f"train.resume_changes=[{keys_text}] (logging, evaluation and checkpoint cadence may change freely)")


def _has_checkpoints(root: str) -> bool:
    return bool(ckpt.list_checkpoints(root)) or os.path.exists(os.path.join(root, ckpt.LATEST))


def choose_checkpoint(resume: str, ckpt_root: str | None, key: str = "train.resume") -> tuple[str | None, list[str]]:
    """The verified checkpoint to resume from (None: start fresh) and notes on what was passed over.
    `resume`: auto, never or a checkpoint/run dir (setting `key`'s value). Main process only."""
    if resume == "never":
        # Starting over there would mix two runs' metrics and let resume=auto pick up the old weights.
        if _has_checkpoints(ckpt_root):
            raise ConfigError(f"train.resume=never, but {ckpt_root} already holds checkpoints (latest: "
                              f"{ckpt.latest(ckpt_root)}); use a new hydra.run.dir, train.resume=auto to "
                              f"continue that run, or delete its checkpoints")
        return None, []
    if resume != "auto":
        if os.path.isfile(os.path.join(resume, "trainer.pt")) or os.path.isfile(os.path.join(resume, ckpt.MANIFEST)):
            reason = ckpt.verify(resume)
            if reason:
                raise ckpt.CheckpointError(f"{key}={resume}: {reason}. Pass its run directory instead to use "
                                           f"the newest intact checkpoint there")
            return resume, []
        roots = [r for r in (resume, os.path.join(resume, ckpt.CHECKPOINT_DIR)) if _has_checkpoints(r)]
        if not roots:
            raise ConfigError(f"{key}={resume!r}: no checkpoint there (expected a checkpoint directory "
                              f"holding trainer.pt, or a run directory with checkpoints/)"
                              + ("; use auto or never" if key == "train.resume" else ""))
        ckpt_root = roots[0]
    elif not _has_checkpoints(ckpt_root):
        return None, []
    found, skipped = ckpt.find_intact(ckpt_root)
    if found is None:
        raise ckpt.CheckpointError(f"no intact checkpoint in {ckpt_root}: "
                                   + "; ".join(f"{p}: {why}" for p, why in skipped)
                                   + ". Start over in a new run dir (train.resume=never), or resume from a copy you "
                                   "trust with train.resume=<checkpoint dir>")
    notes = []
    for path, why in skipped:
        if resume == "auto" and path in ckpt.list_checkpoints(ckpt_root):  # our own run: out of the way, kept
            why += f" (moved to {ckpt.set_aside(path)})"
        notes.append(f"skipped a damaged checkpoint: {path}: {why}")
    if notes and resume == "auto":
        ckpt.point_latest(ckpt_root, found)
    newer = _newer_intact(ckpt_root, found)
    if newer:
        notes.append(f"note: `latest` names {found}, but a newer intact checkpoint exists, {newer} (another "
                     f"branch of this run, e.g. after a resume from an older checkpoint, or a pointer set by hand); "
                     f"continuing from {found} as `latest` says. To continue from {newer} instead, pass "
                     f"{key}={newer}")
    return found, notes


def _newer_intact(ckpt_root: str, found: str) -> str | None:
    """The newest intact checkpoint of `ckpt_root` if it is newer than `found` (the one `latest` names)."""
    listed = ckpt.list_checkpoints(ckpt_root)
    newer = listed[listed.index(found) + 1:] if found in listed else []
    return next((c for c in reversed(newer) if ckpt.verify(c) is None), None)


def plan(cfg, ckpt_root: str, metrics_path: str, accelerator) -> dict:
    """Decide how this run starts (collective; the main process decides, every rank gets the same plan
    or error): {"ckpt_dir" (None: fresh), "notes", "step", "changes" {key: (old, new)}, "finished"}."""
    from train_utils.distributed import on_main

    return on_main(accelerator, lambda: _plan(cfg, ckpt_root, metrics_path), (ConfigError, ckpt.CheckpointError))


def _plan(cfg, ckpt_root: str, metrics_path: str) -> dict:
    ckpt.remove_temporaries(ckpt_root)  # what a writer killed mid-save left behind
    found, notes = choose_checkpoint(cfg.train.resume, ckpt_root)
    if found is None:
        return {"ckpt_dir": None, "notes": notes, "step": 0, "changes": {}, "finished": False}
    trainer = ckpt.load(found, "trainer")
    sharded = ckpt.is_sharded(found)
    if sharded != (cfg.train.parallelism == "fsdp"):  # first: resume_changes cannot change the format
        written = "fsdp" if sharded else "ddp"
        raise ConfigError(f"checkpoint {found} was written with train.parallelism={written} ("
                          f"{'sharded, torch.distributed.checkpoint' if sharded else 'whole-model files'}); it "
                          f"continues only with train.parallelism={written} (either continues on any number of "
                          f"processes)")
    changes = config_changes(trainer["config"], cfg)
    check_changes(changes, cfg.train.resume_changes, found, cfg)
    step = int(trainer["step"])
    return {"ckpt_dir": found, "notes": notes, "step": step, "changes": changes,
            "finished": step >= cfg.train.steps and _has_end_row(metrics_path, step)}


def _has_end_row(metrics_path: str, step: int) -> bool:
    """The run's end row (written after its final checkpoint) is there: else the run writes its final
    evaluation and end row when started again."""
    try:
        rows = read_metrics(metrics_path)
    except (OSError, ValueError):
        return False
    return any(r.get("event") == "end" and r.get("step") == step for r in rows)


def save_checkpoint(run, step: int, tokens: int, extra: dict | None = None) -> str | None:
    """Write `run`'s training state after `step` (collective): weights, optimizer state, schedule, merged
    data position, every rank's RNG state, `tokens`, the resolved config and `extra` (loop entries of
    trainer.pt), keeping checkpoint.keep. Non-finite state is never written (NonFiniteError). DDP: the
    main process writes; FSDP2: every rank (sharded_checkpoint.py). A failed write stops every rank with
    the writer's message. Returns the checkpoint's path on the main process."""
    from accelerate.utils import gather_object

    from train_utils.distributed import is_sharded, on_main

    root, model, optimizer, accelerator = run.ckpt_root, run.raw_model, run.optimizer, run.accelerator
    data_state, keep = run.dm.state_dict(), run.cfg.checkpoint.keep
    config_yaml = OmegaConf.to_yaml(run.cfg, resolve=True)
    sharded = is_sharded(model)
    bad = ckpt.nonfinite_state(model, optimizer)
    if sharded:  # each rank checked its own shards
        bad = next((b for b in gather_object([bad]) if b is not None), None)
    if bad is not None:  # replicas: every rank found the same
        good = ckpt.last_good(root)  # the newest checkpoint whose next loss was no spike (train_utils/divergence.py)
        raise NonFiniteError(f"non-finite values in {bad} after step {step}; no checkpoint written. Last checkpoint "
                             f"from before the divergence: {good or 'none'} (latest: {ckpt.latest(root) or 'none'})")
    per_rank = gather_object([{"data": data_state, "rng": ckpt.rng_state()}])
    trainer = None
    if accelerator.is_main_process:
        trainer = {"step": step, "tokens": tokens, "world_size": accelerator.num_processes,
                   "scheduler": run.scheduler.state_dict(), "data": merge_states([r["data"] for r in per_rank]),
                   "rng": [r["rng"] for r in per_rank], "config": config_yaml, **(extra or {})}
    texts = {"config.yaml": config_yaml}
    if sharded:  # imported here: torch.distributed.checkpoint costs ~1 s of start-up to every other run
        from train_utils import sharded_checkpoint

        return sharded_checkpoint.save(root, step, model=model, optimizer=optimizer, trainer=trainer, texts=texts,
                                       keep=keep, accelerator=accelerator)

    def write():  # main process only; also the barrier: nobody moves on (or exits) before it exists or has failed
        return ckpt.save(root, step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                      "trainer": trainer}, texts=texts, keep=keep)

    return on_main(accelerator, write, ckpt.CheckpointError, share=False)


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a checkpoint that does not fit the model or optimizer raises: DCP's CheckpointException (a
    BaseException) too once torch.distributed.checkpoint is loaded (only a sharded load raises it)."""
    dcp_api = sys.modules.get("torch.distributed.checkpoint.api")
    return (RuntimeError, ValueError, KeyError) + ((dcp_api.CheckpointException,) if dcp_api else ())


def restore(run, plan: dict) -> dict:
    """Load `plan`'s checkpoint into the freshly built `run` (weights, optimizer state, data position,
    this rank's RNG; the schedule rebuilt at its step). Returns {"step", "tokens", "active_blocks",
    "world_size" (of the writer), "fresh_state" (tensors whose per-rank state starts fresh)}. Optimizer
    keys in train.resume_changes: the current hyperparameters replace the checkpoint's. Model or
    optimizer keys there: a checkpoint that does not load is a ConfigError; otherwise it keeps its traceback.
    """
    ckpt_dir, model, optimizer, rank, world = plan["ckpt_dir"], run.raw_model, run.optimizer, run.rank, run.world
    trainer = ckpt.load(ckpt_dir, "trainer")
    new_hyperparameters = any(k.startswith("optimizer.") for k in plan["changes"])
    shapes_may_differ = any(not k.startswith("train.") for k in plan["changes"])  # model, optimizer, data
    step, reset = trainer["step"], 0
    current = [dict(g) for g in optimizer.param_groups] if new_hyperparameters else None
    try:
        if ckpt.is_sharded(ckpt_dir):
            from train_utils import sharded_checkpoint

            reset = sharded_checkpoint.load(ckpt_dir, model=model, optimizer=optimizer, step=step, rank=rank,
                                            same_world_size=trainer["world_size"] == world, hyperparameters=current)
        else:
            model.load_state_dict(ckpt.load(ckpt_dir, "model"))
            saved = ckpt.load(ckpt_dir, "optimizer")
            for saved_group, group in zip(saved["param_groups"], current or []):
                saved_group.update({k: v for k, v in group.items() if k not in ("params", "step")})
            optimizer.load_state_dict(saved)
    except HyperparameterError:  # the optimizer's own message (a ValueError) says what is wrong
        raise
    except _load_errors() as err:
        if not shapes_may_differ:
            raise
        raise ConfigError(f"cannot apply train.resume_changes to {ckpt_dir}: the checkpoint's weights or optimizer "
                          f"state do not fit this config ({str(err).splitlines()[0]})") from err
    # LambdaLR recomputes base_lr x multiplier(step): identical to the stored schedule when nothing changed.
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, run.scheduler.lr_lambdas, last_epoch=step - 1)
    if isinstance(trainer["data"], list):  # one position per rank: written before data.merge_states
        raise ConfigError(f"checkpoint {ckpt_dir} stores its data position in an older format (one per rank) that "
                          f"this version cannot continue exactly; start a new run "
                          f"(train.resume=never in a new run dir)")
    run.dm.load_state_dict(trainer["data"])  # data.DataConfigError if the stream cannot continue exactly
    rng = trainer["rng"]
    if rank < len(rng):
        ckpt.set_rng_state(rng[rank])
    else:  # a rank that did not exist in the checkpoint's run: a fresh dropout stream of its own
        seed_dropout(run.tc.seed, rank, offset=step)
    return {"step": step, "tokens": trainer["tokens"], "active_blocks": trainer.get("active_blocks"),
            "world_size": trainer["world_size"], "fresh_state": reset}
