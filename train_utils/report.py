"""What a run tells metrics.jsonl and the console at its start, after each step, on a signal and at
its end. train.py passes the run record (train_utils/run.py) and what only it knows (step, tokens, last
evaluation): no loop variables are read from outside.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
from tqdm import tqdm

import frugal
from train_utils.distributed import zero_grad_sets_to_none
from train_utils.hooks import OptimizerHooks
from train_utils.loop import activation_checkpointing_on, evaluate, ranks_in_sync
from train_utils.measure import Interval, StateBytes, input_demand, optimizer_state_bytes
from train_utils.metrics import plot_losses
from train_utils.naming import debug_option, optimizer_option
from train_utils.state_free_comm import label as state_free_comm_label


def density_message(report: dict) -> str | None:
    """The console's note when `optimizer.density_report()`'s realised (whole blocks) share differs from
    the request; a warning beyond half a selection unit. None when they agree."""
    gap = abs(report["realised"] - report["requested"])
    if gap <= 1e-3 or not report["unit"]:  # nothing selectable (signSGD alone: every tensor state-free)
        return None
    far = gap > report["unit"] / 2
    return (f"{'warning: ' if far else ''}optimizer.density={report['requested']:g} is realised as a state-full "
            f"share of {report['realised']:.4g} of the projectable parameters (one selection unit is "
            f"{report['unit']:.4g})" + ("; more than half a unit off: check the projection's granularity" if far
                                        else ""))


def start_settings(run, resumed_from: str | None) -> dict:
    """The start row's account of how the run trains (what, where, batches, precision, resume, the loop's
    switches). `cpu_capability`: ATen's CPU kernel set, by which sign-based runs differ (docs/mini_repro.md)."""
    cfg, tc = run.cfg, run.tc
    return {"optimizer": cfg.optimizer.name, "optimizer_option": optimizer_option(cfg),
            "model": cfg.model.name, "debug": debug_option(), "loss_floor": run.dm.loss_floor,
            "world_size": run.world, "batch_size": tc.batch_size, "micro_batch_size": tc.micro_batch_size,
            "accumulation": run.accum, "resumed_from": resumed_from, "device": str(run.device),
            "precision": run.precision, "flops_per_position": run.flops_per_position, "peak_flops": run.peak_flops,
            "activation_checkpointing": activation_checkpointing_on(run.raw_model),
            "ddp_gradient_as_bucket_view": getattr(run.model, "gradient_as_bucket_view", None),
            "zero_grad_set_to_none": zero_grad_sets_to_none(run.model), "parallelism": tc.parallelism,
            "optimizer_in_backward": bool(tc.optimizer_in_backward),
            "state_free_comm": state_free_comm_label(cfg, run.world),
            "compiled": run.compiled, "tf32": run.tf32, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def no_switch_message(run, density: dict | None) -> str | None:
    """A note when update_gap >= train.steps while part of the subspace is state-full: no switch happens."""
    gap, steps = run.opt_cfg.get("update_gap"), run.tc.steps
    if not density or not isinstance(gap, int) or gap < steps or not 0 < density.get("realised", 0) < 1:
        return None
    return (f"note: optimizer.update_gap={gap} >= train.steps={steps}: the state-full subspace never changes in "
            f"this run (no switch)")


def log_start(run, plan: dict, *, step: int, resumed: dict | None, memory: dict) -> dict:
    """Log and return the start row (sizes, realised density, memory estimates, settings, the memory
    check's `memory`, input demand); say the notes on a resume (`plan`: resume.plan's; `resumed`:
    resume.restore's, None when fresh), then `start_block` and wandb's note."""
    metrics, say, model, optimizer = run.metrics, run.say, run.raw_model, run.optimizer
    changes, world = plan["changes"], run.world
    data_cfg = run.cfg.data
    inputs = input_demand(data_cfg.name, data_cfg.num_workers, run.flops_per_position, run.peak_flops)  # workers
    if "input_warning" in inputs:  # ...this device's demand needs
        say(f"warning: {inputs['input_warning']}")
    settings = {**start_settings(run, plan["ckpt_dir"]), **memory, **inputs}
    fresh_state = resumed["fresh_state"] if resumed else 0
    saved_world = resumed["world_size"] if resumed else None
    hooks = OptimizerHooks(optimizer)
    density = hooks.density_report()
    row = {"event": "start", "step": step, "params": sum(p.numel() for p in model.parameters()),
           "state_full_fraction": hooks.state_full_fraction(),
           **({f"density_{k}": v for k, v in density.items()} if density else {}),
           # Appendix D estimate (the paper's layout); "optimizer_state_bytes" in the rows is measured.
           "optimizer_state_bytes_estimate": frugal.estimate_state_bytes(model, **run.opt_cfg),
           "adamw_state_bytes": frugal.estimate_state_bytes(model, "adamw"), **settings}
    metrics.log(row)
    if density and density_message(density):
        say(density_message(density))
    if no_switch_message(run, density):
        say(no_switch_message(run, density))
    if changes:
        metrics.log({"event": "resume_changes", "step": step,
                     "changes": {k: [old, new] for k, (old, new) in changes.items()}})
        say("applying the changed settings named in train.resume_changes: " +
            "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()))
    if fresh_state:
        metrics.log({"event": "optimizer_state_reset", "step": step, "tensors": fresh_state,
                     "reason": "per-rank column/row/randk state of a sharded run on another process count"})
        say(f"{fresh_state} tensors' column/row/randk optimizer state starts fresh: under FSDP2 it belongs to "
            f"each rank's shard, and the shards changed with the process count (train_utils/sharded_checkpoint.py)")
    if saved_world is not None and saved_world != world:
        metrics.log({"event": "world_size_changed", "step": step, "from": saved_world, "to": world})
        say(f"continuing on {world} processes (the checkpoint was written by {saved_world}): weights, "
            f"optimizer state and schedule are exact, the data stream continues from its global position; "
            f"per-rank dropout streams and float summation order differ (train_utils/resume.py)")
    tc = run.tc
    say(start_block(row, run.run_dir, tc.steps, tc.batch_size * run.cfg.data.seq_len))
    if metrics.note:  # where wandb's run is, and how to upload it
        say(metrics.note)
    return row


def last_eval_at(rows: list[dict], step: int) -> dict | None:
    """The evaluation row of `step` among the rows kept from an earlier attempt, if it got that far."""
    evals = [r for r in rows if "val_loss" in r and "event" not in r and r["step"] == step]
    return evals[-1] if evals else None


def finished_message(plan: dict, steps: int) -> str:
    """A run started again after its end (resume.plan's `finished`): nothing to do."""
    return (f"this run has already finished: {plan['ckpt_dir']} is its final checkpoint (step {plan['step']} of "
            f"{steps}) and metrics.jsonl its end row. Nothing to do; to train longer, raise train.steps with "
            f"train.resume_changes=[train.steps].")


def continue_hint(run_dir: str) -> str:
    """How to continue a stopped run: the same command (for a sweep's job, the same -m command) in the
    same run (sweep) dir."""
    from train_utils.naming import is_multirun

    if is_multirun():
        sweep_dir = os.path.dirname(os.path.abspath(run_dir))
        return (f"This job is part of a sweep whose remaining jobs did not run: to continue, rerun the same -m "
                f"command with hydra.sweep.dir={sweep_dir} (finished jobs end at once, this one resumes from its "
                f"checkpoint, the rest start).")
    return f"To continue, run the same command with hydra.run.dir={run_dir} (train.resume=auto)."


def stopped_message(signame: str, step: int, ckpt_root: str, run_dir: str) -> str:
    return f"stopped by {signame} at step {step}; checkpoint saved in {ckpt_root}. {continue_hint(run_dir)}"


def _size(n: float) -> str:
    return next(f"{n / d:.3g}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, "")) if n >= d or d == 1)


def start_block(row: dict, run_dir: str, steps: int, tokens_per_step: int) -> str:
    """The console's first lines, from the start row: run dir, model and optimizer, batch, device, memory."""
    gib = 2.0 ** 30
    option = row.get("optimizer_option") or row.get("optimizer")
    density = ""
    if row.get("density_requested") is not None:
        density = (f", density {row['density_requested']:g} requested, {row['density_realised']:.4g} realised "
                   f"(state-full share of the projectable weights)")
    processes = row["world_size"]
    lines = [f"run dir {run_dir}",
             f"  model {row['model']}" + (f" shrunk by debug={row['debug']}" if row.get("debug") else "") +
             f" ({_size(row['params'])} parameters), optimizer {option}{density}",
             f"  batch {row['batch_size']} sequences per step = micro-batch {row['micro_batch_size']} x accumulation "
             f"{row['accumulation']} x {processes} process{'es' if processes > 1 else ''}; {steps:,} steps, "
             f"~{_size(steps * tokens_per_step)} tokens"]
    memory = (f"planned memory {row['memory_planned_bytes'] / gib:.1f} GiB of "
              f"{row['memory_available_bytes'] / gib:.1f} "
              f"GiB available" if "memory_planned_bytes" in row else f"memory check {row.get('memory_check', 'off')}")
    in_backward = ", optimizer step inside backward" if row.get("optimizer_in_backward") else ""
    vote = ", state-free part sent as a one-bit majority vote" if row.get("state_free_comm") == "vote" else ""
    lines.append(f"  device {row['device']}, {row['precision']}, {row['parallelism']}{in_backward}{vote}; {memory}")
    if row.get("resumed_from"):
        lines.append(f"  resuming from {row['resumed_from']} (step {row['step']})")
    return "\n".join(lines)


# An ETA beyond this on the device at hand is a plan for another machine (a paper preset on a laptop).
ABSURD_ETA_S = 48 * 3600


def eta_warning(steps_left: int, seconds_per_step: float, device) -> str | None:
    """One warning when the measured pace makes the run absurdly long for this device, else None."""
    eta = steps_left * seconds_per_step
    if eta <= ABSURD_ETA_S:
        return None
    return (f"warning: at {seconds_per_step:.2f} s per step on {device}, the remaining {steps_left:,} steps take "
            f"about {eta / 3600:,.0f} hours. This plan is for other hardware: to try it out here, add debug=toy "
            f"(any preset or sweep at toy scale, about a minute per job).")


def eval_line(step: int, steps: int, ev: dict) -> str:
    return f"step {step:,}/{steps:,}: validation loss {ev['val_loss']:.4f}, perplexity {ev['val_ppl']:.3f}"


class EvalProgress:
    """The data module with a progress bar over the validation batches (`evaluate` takes minutes)."""

    def __init__(self, dm, enabled: bool):
        self._dm, self._enabled = dm, enabled

    def __getattr__(self, name):
        return getattr(self._dm, name)

    def val_batches(self, eval_tokens: int):
        batches = self._dm.val_batches(eval_tokens)
        if not self._enabled:
            return batches
        return tqdm(batches, desc="evaluating", unit="batch", leave=False, dynamic_ncols=True)


def training_row(step: int, totals, lr: float, tokens: int, interval: dict, state_bytes: int, hooks) -> dict:
    """The training row of metrics.jsonl and wandb, assembled only here: the step's totals (StepTotals),
    lr, tokens, the interval's pace and peak memory, the state's size and the optimizer hooks' metrics."""
    return {"step": step, "loss": totals.loss, "lr": lr, "grad_norm": totals.grad_norm, "tokens": tokens,
            **interval, "optimizer_state_bytes": state_bytes, "state_full_fraction": hooks.state_full_fraction(),
            **hooks.metrics()}


class StepLog:
    """What the loop logs and says after each step: the training row every train.log_every steps and at
    the last, the progress bar (main process, on a terminal), one warning three steps in if the pace makes
    the plan absurd here, and a progress line every 5% in train.log (on the console too without a bar).
    Events go through `event` (the state's size may follow). Its clock starts when it is made."""

    def __init__(self, run, step: int):
        self.run, self.first_step, self.every = run, step, max(1, run.tc.steps // 20)
        self.interval = Interval(run.device, run.flops_per_position, run.peak_flops, run.world)
        self.started = time.perf_counter()
        self.state_size = StateBytes(run.optimizer, run.sharded, run.device)  # sharded: an all-reduce per change
        # The bar only on a terminal: redirected (a SLURM log), its redraws would fill the file.
        self.shown = run.is_main and run.tc.progress_bar and sys.stderr.isatty()
        self.bar = tqdm(total=run.tc.steps, initial=step, unit="step", dynamic_ncols=True, disable=not self.shown)

    def event(self, row: dict) -> None:
        self.run.metrics.log(row)
        self.state_size.stale()  # e.g. a density change or a new window: the state's size may follow

    def step(self, step: int, totals, lr: float, tokens: int, positions: int, seconds: float,
             data_wait: float) -> None:
        """After step `step`: `positions` read on all ranks, its wall time and data wait. Sharded, the
        state size may be an all-reduce: every rank calls this every step."""
        run, steps, loss = self.run, self.run.tc.steps, totals.loss
        self.interval.add(totals.targets, positions, seconds, data_wait)
        if step % run.tc.log_every == 0 or step == steps:
            row = training_row(step, totals, lr, tokens, self.interval.row(), self.state_size(), run.hooks)
            run.metrics.log(row)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['scored_tokens_per_s']:,.0f}", refresh=False)
        self.bar.update(1)
        if step == self.first_step + 3:  # a measured pace: warn once if the plan is absurd for this device
            pace = eta_warning(steps - step, (time.perf_counter() - self.started) / 3, run.device)
            if pace:
                run.say(pace)
        if step % self.every == 0 and step < steps:
            run.say(f"step {step:,}/{steps:,}: loss {loss:.4f}, {time.perf_counter() - self.started:.0f} s",
                    console=not self.shown)

    def close(self) -> None:
        self.bar.close()


def finish(run, eval_dm, *, step: int, tokens: int, last_eval: dict | None, started: float,
           adamw_bytes: int) -> dict:
    """The final evaluation (unless `last_eval`, from an earlier attempt, has it), the end row (returned),
    the loss plot and the console's summary. `started`: this attempt's loop start."""
    tc, metrics, optimizer, accelerator, sharded = run.tc, run.metrics, run.optimizer, run.accelerator, run.sharded
    if last_eval is None or last_eval["step"] != step:
        last_eval = {"step": step, **evaluate(run.raw_model, eval_dm, tc.eval_tokens, tc.precision, accelerator,
                                              run.loss_fn)}
        metrics.log(last_eval)
    in_sync, checksum = ranks_in_sync(run.raw_model)
    device = accelerator.device
    end = {"event": "end", "step": step, "val_loss": last_eval["val_loss"], "val_ppl": last_eval["val_ppl"],
           "tokens": tokens, "loss_floor": eval_dm.loss_floor,
           "optimizer_state_bytes": optimizer_state_bytes(optimizer, sharded, device),
           **({"optimizer_state_bytes_rank0": frugal.state_bytes(optimizer)} if sharded else {}),
           "adamw_state_bytes": adamw_bytes, "seconds": time.perf_counter() - started,
           "ranks_in_sync": in_sync, "weights_checksum": checksum,
           "state_free_comm": state_free_comm_label(run.cfg, run.world)}
    metrics.log(end)
    metrics.close()  # wandb prints its own lines at finish; the summary below comes last
    if accelerator.is_main_process and tc.plot:
        plot_losses(metrics.path, os.path.join(run.run_dir, "loss.png"), eval_dm.loss_floor, title=run.name)
    run.say(end_of_run_summary(end, run.cfg.model.name, optimizer_option(run.cfg), run.run_dir, tc.plot))
    return end


def end_of_run_summary(end: dict, model_name: str, optimizer_name: str, run_dir: str, plot: bool) -> str:
    """The console's last lines, from the run's `end` row."""
    mib, state, adamw = 2.0 ** 20, end["optimizer_state_bytes"], end["adamw_state_bytes"]
    lines = [f"\n{model_name} + {optimizer_name}: {end['step']} steps, {end['tokens']:,} tokens, "
             f"{end['seconds']:.0f} s in this run",
             f"  validation loss {end['val_loss']:.4f}, perplexity {end['val_ppl']:.3f}"]
    if end.get("state_free_comm") == "vote":
        lines.insert(1, "  state-free part communicated as a one-bit majority vote (train.state_free_comm=vote)")
    if end.get("loss_floor") is not None:
        floor = end["loss_floor"]
        lines.append(f"  corpus loss floor {floor:.4f} (perplexity {math.exp(floor):.3f}): "
                     "the best any model can reach")
    lines.append(f"  optimizer state {state / mib:.2f} MiB vs {adamw / mib:.2f} MiB for AdamW "
                 f"({state / max(adamw, 1):.0%})")
    if end.get("ranks_in_sync") is False:
        lines.append("  WARNING: the ranks' weights differ at the end of training (nondeterministic all-reduce?)")
    lines.append(f"  run dir {run_dir}: metrics.jsonl, train.log, checkpoints/" + (", loss.png" if plot else ""))
    return "\n".join(lines)

