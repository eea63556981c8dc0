"""What a run tells metrics.jsonl and the console when it starts, stops for a signal and ends.

train.py calls these at the three points; everything they need comes in as arguments (no loop
variables read from outside), so each can be read, tested and forked on its own.
"""
from __future__ import annotations

import math
import os
import time

import frugal
from train_utils.loop import evaluate, ranks_in_sync
from train_utils.measure import optimizer_state_bytes
from train_utils.metrics import plot_losses


def state_full_fraction(optimizer) -> float | None:
    return optimizer.state_full_fraction() if hasattr(optimizer, "state_full_fraction") else None


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
    density = optimizer.density_report() if hasattr(optimizer, "density_report") else None
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


def stopped_message(signame: str, step: int, ckpt_root: str, run_dir: str) -> str:
    return (f"stopped by {signame} at step {step}; checkpoint saved in {ckpt_root}. "
            f"To continue, run the same command with hydra.run.dir={run_dir} (train.resume=auto).")


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
        lines.append(f"  corpus loss floor {floor:.4f} (perplexity {math.exp(floor):.3f}): the best any model can reach")
    lines.append(f"  optimizer state {state / mib:.2f} MiB vs {adamw / mib:.2f} MiB for AdamW ({state / max(adamw, 1):.0%})")
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
