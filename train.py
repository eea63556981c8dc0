"""Pre-train a language model with FRUGAL or one of its baselines: the main job.

    python train.py                                      # quickstart: llama_tiny + FRUGAL on the synthetic corpus
    python train.py optimizer=adamw train.steps=1000     # any config key can be overridden
    python train.py experiment=table2 model=llama_130m   # a cell of a paper table (configs/experiment/)
    torchrun --standalone --nproc_per_node 2 train.py hydra.run.dir=runs/ddp    # data parallel
    torchrun --standalone --nproc_per_node 8 train.py train.parallelism=fsdp     # FSDP2: sharded
    python train.py hydra.run.dir=<run dir>              # continue a stopped run (train.resume=auto)

It reads top to bottom: the start-up (train_utils/startup.py), the loop, the final evaluation and
summary. What start-up builds is the run record (train_utils/run.py), which the helpers take whole;
what changes every step stays in the loop's variables. A step: the micro-batches (timed: data wait),
forward/backward with accumulation, one global gradient norm (clipping when train.grad_clip is set),
one host sync for loss, norm and stop votes. A non-finite loss or norm stops the run before the
update, and no checkpoint with non-finite weights or state is ever written.

Exit codes: 0 done (also when the run had already finished); 1 error, e.g. a non-finite loss (the
message names the step and the last, finite checkpoint), a failed checkpoint write (the previous one is
intact), a rank that stopped answering; 2 invalid configuration, a setting that differs from the
checkpoint's, or a run the memory planner says cannot fit; 75 (EX_TEMPFAIL) stopped by SIGTERM, SIGINT,
SIGUSR1 or SIGUSR2 after writing a checkpoint (or during start-up): rerun the same command with the same
run dir to continue (a submitit job is requeued: train_utils/slurm.py).
"""
from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning (spinning ones were measured 10x+ slower on a shared
# CPU). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if __name__ == "__main__":  # a stop signal while the libraries below import: remembered, not fatal
    from train_utils.signals import STOP as _EARLY_STOP  # train_utils imports no torch: milliseconds

    _EARLY_STOP.install()

import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train_utils import report, resume, startup
from train_utils.loop import evaluate, forward_backward, gather_events, grad_norm_, step_totals, training_batches
from train_utils.run import session
from train_utils.signals import STOP
from train_utils.startup import EXIT_PREEMPTED


def train(cfg: DictConfig, run_dir: str) -> int:
    """Run (or continue) the training job described by `cfg` in `run_dir`; return the exit code."""
    # the processes, the stop signals, and on the way out the clean-up (train_utils/run.py)
    with session(cfg, run_dir, STOP) as s:
        run, plan = startup.start(cfg, run_dir, s)  # the config checked, the run dir locked, the resume plan
        if run is None:  # the run had already finished
            return 0
        begin = startup.build(run, plan)  # data, memory check, model, optimizer, checkpoint, start row
        if begin is None:  # a stop signal during start-up
            return EXIT_PREEMPTED

        # ---- the loop (its names for the run's parts, fixed from here on)
        tc, accelerator, world, say = run.tc, run.accelerator, run.world, run.say
        dm, model, raw_model, loss_fn, precision = run.dm, run.model, run.raw_model, run.loss_fn, run.precision
        optimizer, scheduler, hooks, metrics = run.optimizer, run.scheduler, run.hooks, run.metrics
        in_backward = run.in_backward  # None, or the step inside backward: updates run as gradients complete
        step, tokens, active, last_eval = begin.step, begin.tokens, begin.active, begin.last_eval
        params, vote, watch = begin.params, begin.vote, begin.watch  # watch: spikes, the last good checkpoint
        train_iter = training_batches(dm)
        log = s.log = report.StepLog(run, step)  # rows, progress bar, progress lines; its clock starts here
        eval_dm = report.EvalProgress(dm, log.shown)
        model.train()
        while step < tc.steps:
            t0 = time.perf_counter()
            batches = [next(train_iter) for _ in range(run.accum)]
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
            optimizer.zero_grad(set_to_none=begin.set_to_none)
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
                return startup.stop_for_signal(run, log, step)  # EXIT_PREEMPTED, after the checkpoint

        # ---- the end: the final evaluation (unless resumed past it), end row, plot, summary.
        log.close()
        report.finish(run, eval_dm, step=step, tokens=tokens, last_eval=last_eval, started=log.started,
                      adamw_bytes=begin.adamw_bytes)
        # Rank 0 still logs and plots after the last collective; a rank that exits (closing its gloo
        # connections) while a peer is alive can make the peer abort (std::terminate). Leave together.
        accelerator.wait_for_everyone()
        return 0


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    startup.run_job(train, cfg, HydraConfig.get().runtime.output_dir)  # errors as one line and an exit code


if __name__ == "__main__":
    startup.cli(main)  # a bad group choice before Hydra, undeclared keys to the start-up check, exit codes
