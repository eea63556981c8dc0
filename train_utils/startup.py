"""Everything train.py does before its first step, and its errors as messages and exit codes.

`start`: the config checked once, the run record with its run dir and lock, the resume plan. `build`:
data, memory check, model, optimizer and schedule, the vote, the checkpoint restored, the logs opened;
returns where the loop starts. `cli`: exit codes 0 done, 1 run error, 2 config error, 75 stopped.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, NamedTuple

import torch
from accelerate.utils import broadcast_object_list
from omegaconf import DictConfig, OmegaConf

import data
import frugal
import models
from train_utils import checkpoint as ckpt
from train_utils import distributed, divergence, memory_check, report, resume, run_lock, schema, state_free_comm, toy
from train_utils.hooks import OptimizerHooks
from train_utils.loop import (NonFiniteError, compile_model, enable_activation_checkpointing, norm_order,
                              seed_dropout, seed_everything)
from train_utils.measure import workers_needed
from train_utils.metrics import METRICS_FILE, Console, MetricsFileError, MetricsLog
from train_utils.naming import is_multirun, run_group
from train_utils.run import Run
from train_utils.signals import STOP
from train_utils.slurm import requeue
from train_utils.sweep_check import config_errors
from train_utils.validation import AUTO, ConfigError, JobError, stop_with_error, validate_config

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: run again to continue
# What a user can fix from the message alone gets one line and no traceback; anything else keeps it.
CONFIG_ERRORS = config_errors()
RUN_ERRORS = (NonFiniteError, frugal.NonFiniteGradientError, ckpt.CheckpointError,
              distributed.CollectiveTimeout, MetricsFileError)


def start(cfg: DictConfig, run_dir: str, s) -> tuple[Run | None, dict]:
    """(run record, resume plan) inside `session()` `s`: the config checked once, the run dir (the same
    on every rank) and its lock, the toy rewrite; (None, plan) when the run had already finished (said)."""
    tc = cfg.train
    accelerator, world, is_main = s.accelerator, s.world, s.accelerator.is_main_process
    if tc.micro_batch_size == AUTO:  # rank 0 chooses (from its free memory), every rank uses its choice
        tc.micro_batch_size = broadcast_object_list([memory_check.auto_micro_batch(cfg, world, accelerator.device)
                                                     if is_main else 0])[0]
    accum = validate_config(cfg, world)
    # Every rank must write to the same place even if each resolved ${now:...} on its own.
    run_dir = broadcast_object_list([os.path.abspath(run_dir)])[0]
    s.lock = run_lock.hold(run_dir, accelerator)  # one run per run dir: a second writer is refused here
    run = s.run = Run(cfg, run_dir, accelerator, accum, s.tf32)  # the run record: parts set as built
    for note in toy.apply(cfg, write=is_main):  # debug=toy: update gaps that switch in the toy run (its notes)
        run.say(note)
    plan = resume.plan(cfg, run.ckpt_root, os.path.join(run_dir, METRICS_FILE), accelerator)
    for note in plan["notes"]:  # damaged checkpoints skipped, a `latest` older than the newest intact one
        run.say(note)
    if plan["finished"]:
        run.say(report.finished_message(plan, tc.steps))
        return None, plan
    return run, plan


class Begin(NamedTuple):
    """Where the loop starts: what changes every step, and the loop's fixed helpers."""
    step: int
    tokens: int
    active: list | None  # the state-full blocks of the last step (None: none yet)
    last_eval: dict | None
    adamw_bytes: int  # AdamW's state bytes, for the summary's comparison
    params: list  # the trainable parameters in the global norm's order
    set_to_none: bool  # zero_grad's mode (DDP: zeroed in place, its buckets)
    watch: Any  # divergence.LossWatch: spikes, the last good checkpoint
    vote: Any  # train.state_free_comm=vote's hook, else None


def build(run: Run, plan: dict) -> Begin | None:
    """Data, the memory check, model, optimizer, schedule (same seed on every rank: identical initial
    weights), the checkpoint restored, the logs opened with the start row; None when a stop signal
    came during start-up (said: the loop is not entered)."""
    seed_everything(run.tc.seed)
    run.dm = build_data(run)
    memory = check_memory(run)
    run.raw_model, run.loss_fn, run.model = build_model(run)
    run.optimizer, run.hooks, run.scheduler, run.in_backward = build_optimizer(run)
    vote = state_free_comm.attach(run)  # train.state_free_comm=vote: the state-free part as a one-bit vote
    if vote is not None:
        run.hooks = state_free_comm.VoteHooks(run.hooks, vote)  # the training rows get its bytes per step
    run.dm.check_validation(run.tc.eval_tokens, run.tc.require_eval_tokens)  # empty (or short): stops here
    step, tokens, active, resumed = 0, 0, None, None
    if plan["ckpt_dir"]:  # weights, optimizer state, schedule, the data position, RNG states
        resumed = resume.restore(run, plan)  # also rebuilds run.scheduler at the checkpoint's step
        step, tokens, active = resumed["step"], resumed["tokens"], resumed["active_blocks"]
    if stopped_during_startup(run, step):  # a stop signal on any rank: leave before the first step
        return None
    cfg = run.cfg
    run.metrics = MetricsLog(run.run_dir, enabled=run.is_main, wandb_cfg=cfg.wandb, name=run.name,
                             group=run_group(cfg), run_config=OmegaConf.to_container(cfg, resolve=True))
    kept = run.metrics.truncate_after(step if plan["ckpt_dir"] else -1)  # rows past the checkpoint never happened
    start_row = report.log_start(run, plan, step=step, resumed=resumed, memory=memory)  # and the start block
    return Begin(step, tokens, active, report.last_eval_at(kept, step), start_row["adamw_state_bytes"],
                 norm_order(run.optimizer, run.raw_model), distributed.zero_grad_sets_to_none(run.model),
                 divergence.LossWatch(run.ckpt_root, run.is_main, cfg, plan["ckpt_dir"]), vote)


def build_data(run: Run):
    """The data module: this rank's share of the training stream and the validation set."""
    cfg, tc = run.cfg, run.tc
    if cfg.data.num_workers == data.AUTO_WORKERS:  # this device's demand, at most the spare CPU cores
        cfg.data.num_workers = data.auto_workers(workers_needed(cfg, run.device), cfg.data.readers, run.world)
    return data.build_data(cfg.data, micro_batch_size=tc.micro_batch_size, rank=run.rank, world_size=run.world,
                           seed=tc.seed, model_vocab_size=cfg.model.vocab_size,
                           max_positions=cfg.model.max_position_embeddings,
                           eval_mode=OmegaConf.select(cfg, "eval.mode", default="tokens"))


def check_memory(run: Run) -> dict:
    """The memory check's entries of the start row (collective: the ranks agree on the verdict, a run
    that cannot fit stops here with exit 2), with a warning when the check could not be made."""
    if not run.tc.memory_check:
        return {"memory_check": "off (train.memory_check=false)"}
    memory = memory_check.agreed_check(run.cfg, run.opt_cfg, run.dm.vocab_size, run.world, run.device, run.compiled,
                                       run.accelerator)
    if "memory_check" in memory:
        run.say(f"warning: memory check {memory['memory_check']}")
    return memory


def build_model(run: Run) -> tuple:
    """(raw_model, loss_fn, model): the model (checkpointing, pure bf16 as set), the compiled loss (None
    when eager), and what forward/backward calls (DDP's wrapper, or raw_model; under fsdp raw_model
    sharded in place). Same seed on every rank (identical weights), then each rank its dropout masks."""
    tc = run.tc
    pure_bf16 = run.precision == "bf16"  # built in bf16: a 7B model never exists in fp32
    raw_model = models.build_model(run.cfg.model, vocab_size=run.dm.vocab_size,
                                   dtype=torch.bfloat16 if pure_bf16 else None)
    if tc.activation_checkpointing:
        enable_activation_checkpointing(raw_model)
    seed_dropout(tc.seed, run.rank)  # ...but every rank its own dropout masks
    loss_fn = compile_model(raw_model) if run.compiled else None
    return raw_model, loss_fn, distributed.wrap_model(run.accelerator, raw_model, tc.parallelism, run.precision)


def build_optimizer(run: Run) -> tuple:
    """(optimizer, hooks (FRUGAL's loop hooks, no-ops elsewhere), scheduler, in_backward (the step inside
    backward, else None)); a bad schedule value is a config error naming its group."""
    optimizer = frugal.build_optimizer(run.raw_model, **run.opt_cfg)
    in_backward = None
    if run.tc.optimizer_in_backward:
        in_backward = frugal.step_in_backward(optimizer, max_norm=run.tc.grad_clip or None, model=run.raw_model)
    try:
        scheduler = frugal.build_scheduler(optimizer, total_steps=run.tc.steps,
                                           **OmegaConf.to_container(run.cfg.schedule, resolve=True))
    except frugal.HyperparameterError as err:  # say which config group the bad value is in
        raise ConfigError(f"schedule: {err}") from err
    return optimizer, OptimizerHooks(optimizer), scheduler, in_backward


def stopped_during_startup(run: Run, step: int) -> bool:
    """Whether a stop signal came during start-up on any rank (collective); if so say how to continue,
    let a submitit job requeue, and leave before step `step` + 1."""
    votes = torch.tensor([float(STOP.received is not None)], device=run.device)
    if not run.accelerator.reduce(votes, "sum").item():
        return False
    run.say(f"stopped by {STOP.received or 'a signal on another rank'} during start-up, before step {step + 1}; "
            f"nothing new to save. {report.continue_hint(run.run_dir)}")
    requeue(STOP.previous or {}, STOP.received)
    return True


def stop_for_signal(run: Run, log: report.StepLog, step: int) -> int:
    """The end of a run stopped by a signal, after its checkpoint of `step`: the `preempted` row, how
    to continue, every rank leaving together, a submitit job requeued. Returns EXIT_PREEMPTED."""
    signame = STOP.received or "a signal on another rank"
    run.metrics.log({"event": "preempted", "step": step, "signal": signame})
    log.close()
    run.say(report.stopped_message(signame, step, run.ckpt_root, run.run_dir))
    run.accelerator.wait_for_everyone()  # see the end of train(): no rank tears down early
    requeue(STOP.previous or {}, STOP.received)  # submitit jobs: submitit requeues (rank 0 exits)
    return EXIT_PREEMPTED


def run_job(train: Callable[[DictConfig, str], int], cfg: DictConfig, run_dir: str) -> None:
    """Hydra's main: `train(cfg, run_dir)` with its expected errors as one line (exit 2 for a config
    error, 1 for a run error), a second Ctrl-C as exit 130, a non-zero status as the exit code."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        refusal = distributed.torchrun_multirun_error(is_multirun())
        if refusal:
            raise ConfigError(refusal)
        status = train(cfg, run_dir)
    except CONFIG_ERRORS + RUN_ERRORS as err:  # expected failures: a clear message, no traceback
        timeout = isinstance(err, distributed.CollectiveTimeout)
        # Also in train.log (not a refused second writer's: it is the holder's); a timeout by every rank
        # that saw it (rank 0 may be the one that froze), the rest by rank 0.
        logged = (rank == 0 or timeout) and not isinstance(err, run_lock.RunDirInUse)
        Console(run_dir, enabled=logged)(f"error: {err}", error=True, console=timeout and rank != 0)
        stop_with_error(err, 2 if isinstance(err, CONFIG_ERRORS) else 1)
    except KeyboardInterrupt:  # the second Ctrl-C
        Console(run_dir, enabled=rank == 0)("interrupted (a second Ctrl-C): no checkpoint written", error=True)
        sys.exit(130)
    if status:
        sys.exit(status)


def cli(main: Callable[[], None]) -> None:
    """train.py's command line: a wrong group choice refused before Hydra composes anything; an override
    of an undeclared key reaching the start-up check (exit 2) instead of Hydra's advice to append it with
    +; a sweep stopped by a job's error exiting with its code; the process group left last."""
    bad_choice = schema.bad_group_choice(sys.argv[1:])
    if bad_choice:
        print(f"error: {bad_choice}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = schema.force_add_key_overrides(sys.argv[1:])
    code = None
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
        if code == 1 and JobError.exit_code != 1:  # a sweep stopped by a job's error: that job's code
            code = JobError.exit_code
            raise SystemExit(code) from None
        raise
    finally:
        STOP.ignore()  # the run is over: a stop signal during the interpreter's shutdown changes nothing
        if code is not None:
            distributed.leave(code)  # returns unless a multi-process run parked its process group
