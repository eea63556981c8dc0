"""Pre-train a language model with FRUGAL or one of its baselines: the main job.

    python train.py                                      # quickstart: llama_tiny + FRUGAL on the synthetic corpus
    python train.py optimizer=adamw train.steps=1000     # any config key can be overridden
    python train.py experiment=table2 model=llama_130m   # a cell of a paper table (configs/experiment/)
    torchrun --standalone --nproc_per_node 2 train.py hydra.run.dir=runs/ddp    # data parallel
    torchrun --standalone --nproc_per_node 8 train.py train.parallelism=fsdp     # FSDP2: sharded
    python train.py hydra.run.dir=<run dir>              # continue a stopped run (train.resume=auto)

The script reads top to bottom: processes and config checks, which checkpoint to continue, data,
the memory check, model/optimizer, resume, the loop, the final evaluation and summary; the few
steps train() names (build_data, check_memory, build_model, build_optimizer, the two stops for a
signal) follow it, in that order. What train() builds goes into the run record (train_utils/run.py:
config, processes, data, model, optimizer, schedule, metrics), which the helpers that log,
checkpoint and restore the run take whole; what changes every step (step, tokens, the last
evaluation) stays in the loop's variables. Helpers live with their concern in train_utils/: loop.py
(loss, forward/backward, evaluation, compiling), checkpoint.py (atomic, verified checkpoints),
sharded_checkpoint.py (FSDP2's, through torch.distributed.checkpoint), resume.py (continuing a run,
changed settings, writing and restoring its checkpoints), memory_check.py (refusing a run that
cannot fit, from memory_plan.py), measure.py (what a training row measures), metrics.py
(metrics.jsonl, wandb, train.log), report.py (what the start, each step, a stop and the end of a run
log and say), hooks.py (FRUGAL's loop hooks for any torch optimizer), distributed.py (processes, DDP
or FSDP2, timeouts), signals.py (stop signals), slurm.py (SLURM jobs), validation.py (start-up
validation).

A step: fetch the micro-batches (timed: data wait), forward/backward with gradient accumulation,
one global gradient norm (also used for clipping when train.grad_clip is set), then one host sync
for the loss, the norm and the ranks' stop votes. A non-finite loss or norm stops the run before
the update is applied, and no checkpoint with non-finite weights or state is ever written.

Exit codes: 0 done (also when the run had already finished: nothing is written then); 1 error,
e.g. a non-finite loss (the message names the step and the last checkpoint, which is finite), a
checkpoint that cannot be written (the previous one is intact), a rank that stopped answering;
2 invalid configuration, a setting that differs from the checkpoint's, or a run the memory planner
says cannot fit (the message gives the planned and available memory); 75 (EX_TEMPFAIL, "try
again") stopped by SIGTERM, SIGINT, SIGUSR1 or SIGUSR2, after writing a checkpoint (or during
start-up, before any step): rerun the same command with the same run dir to continue (in a
submitit job, submitit requeues it: train_utils/slurm.py).
"""
from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a CPU shared with other processes (a laptop, CI,
# several jobs per node) spinning threads of a 2-thread torch were measured 10x+ slower than one
# thread; sleeping ones cost little when the machine is idle. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if __name__ == "__main__":  # a stop signal while the libraries below import: remembered, not fatal
    from train_utils.signals import STOP as _EARLY_STOP  # train_utils imports no torch: milliseconds

    _EARLY_STOP.install()

import sys
import time

import hydra
import torch
from accelerate.utils import broadcast_object_list
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import data
import frugal
import models
from train_utils import checkpoint as ckpt
from train_utils import distributed, divergence, memory_check, report, resume, run_lock, schema, toy
from train_utils.memory_check import auto_micro_batch
from train_utils.naming import is_multirun, run_group
from train_utils.validation import (AUTO, ConfigError, JobError, check_loop_settings,
                                    stop_with_error, validate_config)
from train_utils.loop import (NonFiniteError, compile_model, enable_activation_checkpointing, evaluate,
                              forward_backward, gather_events, grad_norm_, norm_order, seed_dropout, seed_everything,
                              step_totals, training_batches)
from train_utils.measure import workers_needed
from train_utils.hooks import OptimizerHooks
from train_utils.metrics import METRICS_FILE, Console, MetricsFileError, MetricsLog
from train_utils.run import Run, session
from train_utils.signals import STOP
from train_utils.slurm import requeue
from train_utils import state_free_comm

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: run again to continue
# What a user can fix from the message alone gets one line and no traceback; anything else keeps it.
CONFIG_ERRORS = (ConfigError, frugal.HyperparameterError, data.DataConfigError, models.ModelConfigError)
RUN_ERRORS = (NonFiniteError, frugal.NonFiniteGradientError, ckpt.CheckpointError,
              distributed.CollectiveTimeout, MetricsFileError)


def train(cfg: DictConfig, run_dir: str) -> int:
    """Run (or continue) the training job described by `cfg` in `run_dir`; return the exit code."""
    tc = cfg.train
    check_loop_settings(tc)
    # the processes, the stop signals, and on the way out the clean-up (train_utils/run.py)
    with session(cfg, run_dir, STOP) as s:
        accelerator, world, is_main = s.accelerator, s.world, s.accelerator.is_main_process
        if tc.micro_batch_size == AUTO:  # rank 0 chooses (from its free memory), every rank uses its choice
            tc.micro_batch_size = broadcast_object_list([auto_micro_batch(cfg, world, accelerator.device)
                                                         if is_main else 0])[0]
        accum = validate_config(cfg, world)
        # Every rank must write to the same place even if each resolved ${now:...} on its own.
        run_dir = broadcast_object_list([os.path.abspath(run_dir)])[0]
        s.lock = run_lock.hold(run_dir, accelerator)  # one run per run dir: a second writer is refused here
        run = s.run = Run(cfg, run_dir, accelerator, accum, s.tf32)  # the run record: parts set below as built
        say = run.say
        for note in toy.apply(cfg, write=is_main):  # debug=toy: update gaps that switch in the toy run (its notes)
            say(note)

        # ---- which checkpoint continues this run, and does this config still describe it?
        plan = resume.plan(cfg, run.ckpt_root, os.path.join(run_dir, METRICS_FILE), accelerator)
        for note in plan["notes"]:  # damaged checkpoints skipped, a `latest` older than the newest intact one
            say(note)
        if plan["finished"]:
            say(report.finished_message(plan, tc.steps))
            return 0

        # ---- data, then the memory check, then model, optimizer, schedule. Same seed on every rank:
        # identical initial weights.
        seed_everything(tc.seed)
        run.dm = build_data(run)
        memory = check_memory(run)
        run.raw_model, run.loss_fn, run.model = build_model(run)
        run.optimizer, run.hooks, run.scheduler, run.in_backward = build_optimizer(run)
        vote = state_free_comm.attach(run)  # train.state_free_comm=vote: the state-free part as a one-bit vote
        if vote is not None:
            run.hooks = state_free_comm.VoteHooks(run.hooks, vote)  # the training rows get its bytes per step
        run.dm.check_validation(tc.eval_tokens, tc.require_eval_tokens)  # empty (or, if required, short): stops here

        # ---- resume: weights, optimizer state, schedule, the data position, RNG states.
        step, tokens, active, resumed = 0, 0, None, None
        if plan["ckpt_dir"]:
            resumed = resume.restore(run, plan)  # also rebuilds run.scheduler at the checkpoint's step
            step, tokens, active = resumed["step"], resumed["tokens"], resumed["active_blocks"]
        if stopped_during_startup(run, step):  # a stop signal on any rank: leave before the first step
            return EXIT_PREEMPTED

        # ---- logging: metrics.jsonl (+ wandb) and the console on the main process only.
        run.metrics = MetricsLog(run_dir, enabled=is_main, wandb_cfg=cfg.wandb, name=run.name, group=run_group(cfg),
                                 run_config=OmegaConf.to_container(cfg, resolve=True))
        kept = run.metrics.truncate_after(step if plan["ckpt_dir"] else -1)  # rows past the checkpoint never happened
        last_eval = report.last_eval_at(kept, step)
        start_row = report.log_start(run, plan, step=step, resumed=resumed, memory=memory)  # and the start block

        # ---- the loop (its names for the run's parts, fixed from here on)
        dm, model, raw_model, loss_fn, precision = run.dm, run.model, run.raw_model, run.loss_fn, run.precision
        optimizer, scheduler, hooks, metrics = run.optimizer, run.scheduler, run.hooks, run.metrics
        in_backward = run.in_backward  # None, or the step inside backward: updates run as gradients complete
        watch = divergence.LossWatch(run.ckpt_root, is_main, cfg, plan["ckpt_dir"])  # spikes, last_good checkpoint
        train_iter = training_batches(dm)
        params = norm_order(optimizer, raw_model)  # the global norm's order, as in the step inside backward
        set_to_none = distributed.zero_grad_sets_to_none(model)  # DDP: zeroed in place (its buckets)
        log = s.log = report.StepLog(run, step)  # rows, progress bar, progress lines; its clock starts here
        eval_dm = report.EvalProgress(dm, log.shown)
        model.train()
        while step < tc.steps:
            t0 = time.perf_counter()
            batches = [next(train_iter) for _ in range(accum)]
            data_wait = time.perf_counter() - t0
            loss_sum, n_global = forward_backward(model, batches, accelerator, precision, loss_fn,
                                                  in_backward.accumulating if in_backward else None)
            if in_backward:  # clip-invariant tensors took the step already; the norm covers every gradient
                norm = in_backward.compute_grad_norm()
            elif vote is not None:  # the exact tensors' norm and a bound for the voted ones: never the votes
                norm = vote.clip_grad_norm_(params, tc.grad_clip)
            else:
                norm = grad_norm_(params, tc.grad_clip)  # identical on every rank after DDP's all-reduce
            data_events = dm.pop_events()  # e.g. one of this rank's readers wrapped around an epoch
            # The step's one host sync: global loss, gradient norm, target count, stop votes, data events.
            totals = step_totals(accelerator, loss_sum, norm, n_global, STOP.received, len(data_events))
            # non-finite: NonFiniteError naming the last good checkpoint (and what already moved, in backward)
            watch.check(step + 1, totals.loss, totals.grad_norm, in_backward.applied if in_backward else 0)
            lr = scheduler.get_last_lr()[0]  # the lr this step uses
            blocks = hooks.active_blocks()
            if blocks is not None and blocks != active:  # this step starts a new state-full window
                log.event({"event": "switch", "step": step + 1, "active_blocks": blocks})
                active = blocks
            hooks.observe_loss(totals.loss)  # optimizers that adapt to the loss see the global one
            optimizer.step()  # in backward: the tensors that waited for the clipping norm, and the count
            scheduler.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            step, tokens = step + 1, tokens + totals.targets
            # Every rank's data events (optimizer events are the same on all), then the optimizer's.
            for event in [*gather_events(data_events, totals.events), *hooks.pop_events()]:
                log.event({**event, "step": step})
            log.step(step, totals, lr, tokens, sum(b["input_ids"].numel() for b in batches) * world,
                     time.perf_counter() - t0, data_wait)
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                last_eval = {"step": step, **evaluate(raw_model, eval_dm, tc.eval_tokens, precision, accelerator,
                                                      loss_fn)}
                metrics.log(last_eval)
                if step < tc.steps:  # the last one is in the summary
                    say(report.eval_line(step, tc.steps, last_eval))
            stopping = totals.stop_votes > 0 and step < tc.steps  # a signal in the last step lets the run finish
            if step == tc.steps or stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                saved = resume.save_checkpoint(run, step, tokens, extra={"active_blocks": active})
                watch.saved(saved)  # becomes last_good if the next step's loss is no spike
            if stopping:
                return stop_for_signal(run, log, step)  # EXIT_PREEMPTED, after the checkpoint

        # ---- the end: the final evaluation (unless resumed past it), end row, plot, summary.
        log.close()
        report.finish(run, eval_dm, step=step, tokens=tokens, last_eval=last_eval, started=log.started,
                      adamw_bytes=start_row["adamw_state_bytes"])
        # Rank 0 still logs and plots after the last collective; a rank that exits (closing its gloo
        # connections) while a peer is alive can make the peer abort (std::terminate). Leave together.
        accelerator.wait_for_everyone()
        return 0


# ---- train()'s steps, in the order it takes them.
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
    """(raw_model, loss_fn, model): the model itself (activation checkpointing, pure bf16 as set), the
    compiled blocks' loss (None when eager; blocks compile at their first call), and what forward/
    backward calls: under ddp the DDP wrapper (or raw_model alone), under fsdp raw_model itself,
    sharded in place. Built from the same seed on every rank (identical initial weights); after it,
    every rank seeds its own dropout masks."""
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
    """(optimizer, hooks, scheduler, in_backward) for the built model: `hooks` gives any torch
    optimizer FRUGAL's loop hooks (no-ops where it has none); a bad schedule value is a config error
    naming its group; `in_backward` is the step inside backward (train.optimizer_in_backward), else None."""
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
    """Whether a stop signal came during start-up, on any rank (collective: every rank votes). If
    so: say there is nothing new to save and how to continue, let a submitit job requeue, and leave
    before step `step` + 1."""
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


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir, rank = HydraConfig.get().runtime.output_dir, int(os.environ.get("RANK", "0"))
    try:
        refusal = distributed.torchrun_multirun_error(is_multirun())
        if refusal:
            raise ConfigError(refusal)
        status = train(cfg, run_dir)
    except CONFIG_ERRORS + RUN_ERRORS as err:  # expected failures: a clear message, no traceback
        timeout = isinstance(err, distributed.CollectiveTimeout)
        # Kept in train.log too (not a refused second writer's: that train.log is the holder's); a
        # collective timeout is reported by every rank that saw it (rank 0 may be the one that froze),
        # the rest by rank 0 (stop_with_error).
        logged = (rank == 0 or timeout) and not isinstance(err, run_lock.RunDirInUse)
        Console(run_dir, enabled=logged)(f"error: {err}", error=True, console=timeout and rank != 0)
        stop_with_error(err, 2 if isinstance(err, CONFIG_ERRORS) else 1)
    except KeyboardInterrupt:  # the second Ctrl-C
        Console(run_dir, enabled=rank == 0)("interrupted (a second Ctrl-C): no checkpoint written", error=True)
        sys.exit(130)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    # A plain override of a key no YAML declares (optimizer.densty=0.3) reaches the start-up check,
    # which names the valid keys (exit 2), instead of stopping Hydra with advice to append it with +.
    bad_choice = schema.bad_group_choice(sys.argv[1:])
    if bad_choice:  # before Hydra composes (or a sweep launches) anything
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
