"""What a run tells metrics.jsonl and the console when it starts, stops for a signal and ends.

train.py calls these at the three points; everything they need comes in as arguments (no loop
variables read from outside), so each can be read, tested and forked on its own.
"""
from __future__ import annotations

import math
import os
import time

import frugal
from train_utils.hooks import OptimizerHooks
from train_utils.loop import evaluate, ranks_in_sync
from train_utils.measure import optimizer_state_bytes
from train_utils.metrics import plot_losses


def state_full_fraction(optimizer) -> float | None:
    return OptimizerHooks(optimizer).state_full_fraction()


def density_message(report: dict) -> str | None:
    """What the console says about `optimizer.density_report()`: whole blocks (columns, ...) are
    state-full or not, so the realised share is rounded; a note when it differs from the request, a
    warning beyond half a selection unit. None when they agree."""
    gap = abs(report["realised"] - report["requested"])
    if gap <= 1e-3:
        return None
    far = gap > report["unit"] / 2
    return (f"{'warning: ' if far else ''}optimizer.density={report['requested']:g} is realised as a state-full "
            f"share of {report['realised']:.4g} of the projectable parameters (one selection unit is "
            f"{report['unit']:.4g})" + ("; more than half a unit off: check the projection's granularity" if far
                                        else ""))


def log_start(metrics, say, *, step: int, model, optimizer, opt_cfg: dict, settings: dict, changes: dict,
              fresh_state: int, saved_world: int | None, world: int) -> dict:
    """The start row (what this run is: sizes, the optimizer's realised density, the memory
    estimates, the loop's settings in `settings`) and the console's notes on a resume: settings
    changed on purpose, optimizer state that starts fresh, another process count. Returns the row."""
    density = OptimizerHooks(optimizer).density_report()
    row = {"event": "start", "step": step, "params": sum(p.numel() for p in model.parameters()),
           "state_full_fraction": state_full_fraction(optimizer),
           **({f"density_{k}": v for k, v in density.items()} if density else {}),
           # Appendix D estimate (the paper's layout); "optimizer_state_bytes" in the rows is measured.
           "optimizer_state_bytes_estimate": frugal.estimate_state_bytes(model, **opt_cfg),
           "adamw_state_bytes": frugal.estimate_state_bytes(model, "adamw"), **settings}
    metrics.log(row)
    if density and density_message(density):
        say(density_message(density))
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
    return row


def last_eval_at(rows: list[dict], step: int) -> dict | None:
    """The evaluation row of `step` among the rows kept from an earlier attempt, if it got that far."""
    evals = [r for r in rows if "val_loss" in r and "event" not in r and r["step"] == step]
    return evals[-1] if evals else None


def continue_hint(run_dir: str) -> str:
    """How to continue a stopped run: the same command in the same run dir, or, for a job of a sweep,
    the same -m command in the same sweep dir (its finished jobs end at once, this one resumes, the
    ones after it start)."""
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
    """The console's first lines, from the start row: where the run writes, what it trains with what,
    the batch as micro-batch x accumulation x processes, the device and the planned memory."""
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
    lines.append(f"  device {row['device']}, {row['precision']}, {row['parallelism']}; {memory}")
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
    """The data module as `evaluate` sees it, with a progress bar over the validation batches (a 10M-token
    evaluation takes minutes); everything else is the data module's own."""

    def __init__(self, dm, enabled: bool):
        self._dm, self._enabled = dm, enabled

    def __getattr__(self, name):
        return getattr(self._dm, name)

    def val_batches(self, eval_tokens: int):
        from tqdm import tqdm

        batches = self._dm.val_batches(eval_tokens)
        if not self._enabled:
            return batches
        return tqdm(batches, desc="evaluating", unit="batch", leave=False, dynamic_ncols=True)


def finish(metrics, say, *, step: int, tokens: int, last_eval: dict | None, raw_model, optimizer, dm, tc,
           accelerator, loss_fn, sharded: bool, started: float, model_name: str, option: str, run_dir: str,
           name: str, adamw_bytes: int) -> dict:
    """The end of a run: the final evaluation (unless an earlier attempt logged it), the end row,
    the loss plot and the console's summary. Returns the end row."""
    if last_eval is None or last_eval["step"] != step:
        last_eval = {"step": step, **evaluate(raw_model, dm, tc.eval_tokens, tc.precision, accelerator, loss_fn)}
        metrics.log(last_eval)
    in_sync, checksum = ranks_in_sync(raw_model)
    device = accelerator.device
    end = {"event": "end", "step": step, "val_loss": last_eval["val_loss"], "val_ppl": last_eval["val_ppl"],
           "tokens": tokens, "loss_floor": dm.loss_floor,
           "optimizer_state_bytes": optimizer_state_bytes(optimizer, sharded, device),
           **({"optimizer_state_bytes_rank0": frugal.state_bytes(optimizer)} if sharded else {}),
           "adamw_state_bytes": adamw_bytes, "seconds": time.perf_counter() - started,
           "ranks_in_sync": in_sync, "weights_checksum": checksum}
    metrics.log(end)
    metrics.close()  # wandb prints its own lines at finish; the summary below comes last
    if accelerator.is_main_process and tc.plot:
        plot_losses(metrics.path, os.path.join(run_dir, "loss.png"), dm.loss_floor, title=name)
    say(end_of_run_summary(end, model_name, option, run_dir, tc.plot))
    return end


def end_of_run_summary(end: dict, model_name: str, optimizer_name: str, run_dir: str, plot: bool) -> str:
    """The console's last lines, from the run's `end` row."""
    mib, state, adamw = 2.0 ** 20, end["optimizer_state_bytes"], end["adamw_state_bytes"]
    lines = [f"\n{model_name} + {optimizer_name}: {end['step']} steps, {end['tokens']:,} tokens, "
             f"{end['seconds']:.0f} s in this run",
             f"  validation loss {end['val_loss']:.4f}, perplexity {end['val_ppl']:.3f}"]
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


def nonfinite_message(loss: float, grad_norm: float, step: int, last_checkpoint: str | None) -> str:
    return (f"non-finite training loss or gradient norm (loss {loss}, gradient norm {grad_norm}) at step "
            f"{step}; stopped before applying it. Last checkpoint (finite): {last_checkpoint or 'none'}. "
            f"Try a lower optimizer.lr, train.grad_clip=1.0 or train.precision=fp32.")


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
