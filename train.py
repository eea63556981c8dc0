"""Pre-train a language model with FRUGAL or one of its baselines: the main job.

    python train.py                                      # quickstart: llama_tiny + FRUGAL on the synthetic corpus
    python train.py optimizer=adamw train.steps=1000     # any config key can be overridden
    python train.py experiment=table2 model=llama_130m   # a cell of a paper table (configs/experiment/)
    torchrun --standalone --nproc_per_node 2 train.py hydra.run.dir=runs/ddp    # data parallel
    torchrun --standalone --nproc_per_node 8 train.py train.parallelism=fsdp     # FSDP2: sharded
    python train.py hydra.run.dir=<run dir>              # continue a stopped run (train.resume=auto)

The script reads top to bottom: processes and config checks, which checkpoint to continue, data,
the memory check, model/optimizer, resume, the loop, the final evaluation and summary. Helpers live
with their concern in train_utils/: loop.py (loss, forward/backward, evaluation, compiling),
checkpoint.py (atomic, verified checkpoints), sharded_checkpoint.py (FSDP2's, through
torch.distributed.checkpoint), resume.py (continuing a run, changed settings), memory_check.py
(refusing a run that cannot fit, from memory_plan.py), measure.py (what a training row measures),
metrics.py (metrics.jsonl, wandb, train.log), report.py (what the start, a stop and the end
of a run log and say), distributed.py (processes, DDP or FSDP2, timeouts),
signals.py (stop signals), slurm.py (SLURM jobs), validation.py (start-up validation).

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
    import importlib.util
    import sys

    # By path: importing the train_utils package first would import torch (seconds without a handler).
    _spec = importlib.util.spec_from_file_location(
        "train_utils.signals", os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_utils", "signals.py"))
    sys.modules[_spec.name] = _early_signals = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_early_signals)
    _early_signals.STOP.install()

import sys
import time

import hydra
import torch
from accelerate.utils import broadcast_object_list
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import data
import frugal
import models
from train_utils import checkpoint as ckpt
from train_utils import distributed, divergence, memory_check, report, resume, run_lock, schema
from train_utils.naming import debug_option, is_multirun, optimizer_option, run_group, run_name
from train_utils.memory_check import auto_micro_batch
from train_utils.validation import (AUTO, ConfigError, JobError, check_loop_settings,
                                    resolve_precision, stop_with_error, validate_config)
from train_utils.loop import (NonFiniteError, activation_checkpointing_on, allow_tf32,
                              compile_model, compile_wanted, enable_activation_checkpointing, evaluate,
                              forward_backward, gather_events, grad_norm_, seed_dropout, seed_everything, step_totals,
                              training_batches)
from train_utils.measure import (Interval, StateBytes, flops_per_position, input_demand, peak_flops,
                                 workers_needed)
from train_utils.hooks import OptimizerHooks
from train_utils.metrics import METRICS_FILE, Console, MetricsFileError, MetricsLog
from train_utils.signals import STOP
from train_utils.slurm import export_distributed_env, requeue

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: run again to continue
# What a user can fix from the message alone gets one line and no traceback; anything else keeps it.
CONFIG_ERRORS = (ConfigError, frugal.HyperparameterError, data.DataConfigError, models.ModelConfigError)
RUN_ERRORS = (NonFiniteError, ckpt.CheckpointError, distributed.CollectiveTimeout, MetricsFileError)


def train(cfg: DictConfig, run_dir: str) -> int:
    """Run (or continue) the training job described by `cfg` in `run_dir`; return the exit code."""
    tc = cfg.train
    check_loop_settings(tc)
    installed = STOP.install()  # from here on a stop signal ends the run cleanly (train_utils/signals.py)
    export_distributed_env()  # SLURM tasks without torchrun (srun, submitit): rank/world from the job
    accelerator = distributed.make_accelerator(tc.collective_timeout_s)
    rank, world, is_main, device = (accelerator.process_index, accelerator.num_processes,
                                    accelerator.is_main_process, accelerator.device)
    tf32 = allow_tf32(tc.tf32, device)
    tc.precision = resolve_precision(tc.precision, device, debug_option())  # auto: bf16-mixed where native, else fp32
    monitor = distributed.monitor_group(accelerator, tc.collective_timeout_s)
    metrics = bar = lock = model = None
    try:
        if tc.micro_batch_size == AUTO:  # rank 0 chooses (from its free memory), every rank uses its choice
            tc.micro_batch_size = broadcast_object_list([auto_micro_batch(cfg, world, device) if is_main else 0])[0]
        accum = validate_config(cfg, world)
        precision = tc.precision
        # Every rank must write to the same place even if each resolved ${now:...} on its own.
        run_dir = broadcast_object_list([os.path.abspath(run_dir)])[0]
        lock = run_lock.hold(run_dir, accelerator)  # one run per run dir: a second writer is refused here
        ckpt_root = os.path.join(run_dir, ckpt.CHECKPOINT_DIR)
        say = Console(run_dir, enabled=is_main)

        # ---- which checkpoint continues this run, and does this config still describe it?
        plan = resume.plan(cfg, ckpt_root, os.path.join(run_dir, METRICS_FILE), accelerator)
        for note in plan["notes"]:  # damaged checkpoints skipped, a `latest` older than the newest intact one
            say(note)
        if plan["finished"]:
            say(f"this run has already finished: {plan['ckpt_dir']} is its final checkpoint (step {plan['step']} of "
                f"{tc.steps}) and metrics.jsonl its end row. Nothing to do; to train longer, raise train.steps with "
                f"train.resume_changes=[train.steps].")
            return 0

        # ---- data, then the memory check, then model, optimizer, schedule. Same seed on every rank:
        # identical initial weights.
        seed_everything(tc.seed)
        if cfg.data.num_workers == data.AUTO_WORKERS:  # this device's demand, at most the spare CPU cores
            cfg.data.num_workers = data.auto_workers(workers_needed(cfg, device), cfg.data.readers, world)
        dm = data.build_data(cfg.data, micro_batch_size=tc.micro_batch_size, rank=rank, world_size=world,
                             seed=tc.seed, model_vocab_size=cfg.model.vocab_size,
                             max_positions=cfg.model.max_position_embeddings,
                             eval_mode=OmegaConf.select(cfg, "eval.mode", default="tokens"))
        opt_cfg = OmegaConf.to_container(cfg.optimizer, resolve=True)
        compiled = compile_wanted(tc.compile, device)
        memory = (memory_check.agreed_check(cfg, opt_cfg, dm.vocab_size, world, device, compiled, accelerator)
                  if tc.memory_check else {"memory_check": "off (train.memory_check=false)"})
        if "memory_check" in memory and tc.memory_check:
            say(f"warning: memory check {memory['memory_check']}")
        raw_model = models.build_model(cfg.model, vocab_size=dm.vocab_size)
        if tc.activation_checkpointing:
            enable_activation_checkpointing(raw_model)
        if precision == "bf16":
            raw_model.to(torch.bfloat16)
        seed_dropout(tc.seed, rank)  # ...but every rank its own dropout masks
        loss_fn = compile_model(raw_model) if compiled else None  # blocks compile at their first call
        # ddp: `model` is the DDP wrapper (or raw_model alone); fsdp: raw_model itself, sharded in place.
        model = distributed.wrap_model(accelerator, raw_model, tc.parallelism, precision)
        sharded = tc.parallelism == "fsdp"  # optimizer state per rank is a shard: rows sum the ranks
        set_to_none = distributed.zero_grad_sets_to_none(model)  # DDP: zeroed in place (its buckets)
        optimizer = frugal.build_optimizer(raw_model, **opt_cfg)
        hooks = OptimizerHooks(optimizer)  # FRUGAL's loop hooks; no-ops for a plain torch optimizer
        try:
            scheduler = frugal.build_scheduler(optimizer, total_steps=tc.steps,
                                               **OmegaConf.to_container(cfg.schedule, resolve=True))
        except frugal.HyperparameterError as err:  # say which config group the bad value is in
            raise ConfigError(f"schedule: {err}") from err
        dm.check_validation(tc.eval_tokens, tc.require_eval_tokens)  # an empty (or, if required, short) set stops here

        # ---- resume: weights, optimizer state, schedule, the data position, RNG states.
        step, tokens, active, fresh_state = 0, 0, None, 0
        if plan["ckpt_dir"]:
            trainer = ckpt.load(plan["ckpt_dir"], "trainer")
            scheduler, fresh_state = resume.restore(
                plan["ckpt_dir"], trainer, model=raw_model, optimizer=optimizer, scheduler=scheduler, dm=dm,
                rank=rank, world=world, seed=tc.seed,
                new_hyperparameters=any(k.startswith("optimizer.") for k in plan["changes"]),
                shapes_may_differ=any(not k.startswith("train.") for k in plan["changes"]))  # model, optimizer, data
            step, tokens, active = trainer["step"], trainer["tokens"], trainer.get("active_blocks")
        # A stop signal during start-up (on any rank): leave before the first step, nothing to save.
        if accelerator.reduce(torch.tensor([float(STOP.received is not None)], device=device), "sum").item():
            say(f"stopped by {STOP.received or 'a signal on another rank'} during start-up, before step {step + 1}; "
                f"nothing new to save. {report.continue_hint(run_dir)}")
            requeue(STOP.previous or {}, STOP.received)
            return EXIT_PREEMPTED

        # ---- logging: metrics.jsonl (+ wandb) and the console on the main process only.
        name = run_name(cfg, run_dir)  # wandb: <model>-<optimizer option>-<swept values or run dir>
        metrics = MetricsLog(run_dir, enabled=is_main, wandb_cfg=cfg.wandb, name=name, group=run_group(cfg),
                             run_config=OmegaConf.to_container(cfg, resolve=True))
        kept = metrics.truncate_after(step if plan["ckpt_dir"] else -1)  # rows past the checkpoint never happened
        last_eval = report.last_eval_at(kept, step)
        flops = flops_per_position(raw_model, cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.data.seq_len)
        peak = peak_flops(device, tc.peak_flops)
        inputs = input_demand(cfg.data.name, cfg.data.num_workers, flops, peak)  # workers for this device's demand
        if "input_warning" in inputs:
            say(f"warning: {inputs['input_warning']}")
        start_row = report.log_start(
            metrics, say, step=step, model=raw_model, optimizer=optimizer, opt_cfg=opt_cfg,
            changes=plan["changes"], fresh_state=fresh_state, world=world,
            saved_world=trainer["world_size"] if plan["ckpt_dir"] else None,
            settings={"optimizer": cfg.optimizer.name, "optimizer_option": optimizer_option(cfg),
                      "model": cfg.model.name, "debug": debug_option(), "loss_floor": dm.loss_floor,
                      "world_size": world, "batch_size": tc.batch_size, "micro_batch_size": tc.micro_batch_size,
                      "accumulation": accum, "resumed_from": plan["ckpt_dir"], "device": str(device),
                      "precision": precision,
                      "flops_per_position": flops, "peak_flops": peak,
                      "activation_checkpointing": activation_checkpointing_on(raw_model),
                      "ddp_gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
                      "zero_grad_set_to_none": set_to_none, "parallelism": tc.parallelism,
                      "compiled": compiled, "tf32": tf32, **memory, **inputs})
        say(report.start_block(start_row, run_dir, tc.steps, tc.batch_size * cfg.data.seq_len))
        if metrics.note:  # where wandb's run is, and how to upload it
            say(metrics.note)

        # ---- the loop
        watch = divergence.LossWatch(ckpt_root, is_main, cfg, plan["ckpt_dir"])  # spikes, last_good checkpoint
        train_iter = training_batches(dm)
        params = [p for p in raw_model.parameters() if p.requires_grad]
        interval, started = Interval(device, flops, peak, world), time.perf_counter()
        state_size = StateBytes(optimizer, sharded, device)  # sharded: one all-reduce per change, not per row
        shown = is_main and tc.progress_bar  # the bar on the console; train.log gets progress lines instead
        bar = tqdm(total=tc.steps, initial=step, unit="step", dynamic_ncols=True, disable=not shown)
        eval_dm, first_step, every = report.EvalProgress(dm, shown), step, max(1, tc.steps // 20)
        model.train()
        while step < tc.steps:
            t0 = time.perf_counter()
            batches = [next(train_iter) for _ in range(accum)]
            data_wait = time.perf_counter() - t0
            loss_sum, n_global = forward_backward(model, batches, accelerator, precision, loss_fn)
            norm = grad_norm_(params, tc.grad_clip)  # identical on every rank after DDP's all-reduce
            data_events = dm.pop_events()  # e.g. one of this rank's readers wrapped around an epoch
            # The step's one host sync: global loss, gradient norm, target count, stop votes, data events.
            loss, grad_norm, targets, stop_votes, n_events = step_totals(accelerator, loss_sum, norm, n_global,
                                                                         STOP.received, len(data_events))
            watch.check(step + 1, loss, grad_norm)  # non-finite: NonFiniteError naming the last good checkpoint
            lr = scheduler.get_last_lr()[0]  # the lr this step uses
            blocks = hooks.active_blocks()
            if blocks is not None and blocks != active:  # this step starts a new state-full window
                metrics.log({"event": "switch", "step": step + 1, "active_blocks": blocks})
                active = blocks
                state_size.stale()
            hooks.observe_loss(loss)  # optimizers that adapt to the loss see the global one
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            step, tokens = step + 1, tokens + targets
            events = gather_events(data_events, n_events)  # every rank's (optimizer events are the same on all)
            for event in [*events, *hooks.pop_events()]:
                metrics.log({**event, "step": step})
                state_size.stale()  # e.g. a density change: the state's size may follow
            interval.add(targets, sum(b["input_ids"].numel() for b in batches) * world,
                         time.perf_counter() - t0, data_wait)
            if step % tc.log_every == 0 or step == tc.steps:
                row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                       **interval.row(), "optimizer_state_bytes": state_size(),
                       "state_full_fraction": report.state_full_fraction(optimizer)}
                metrics.log(row)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['scored_tokens_per_s']:,.0f}", refresh=False)
            bar.update(1)
            if step == first_step + 3:  # a measured pace: warn once if the plan is absurd for this device
                pace = report.eta_warning(tc.steps - step, (time.perf_counter() - started) / 3, device)
                if pace:
                    say(pace)
            if step % every == 0 and step < tc.steps:
                say(f"step {step:,}/{tc.steps:,}: loss {loss:.4f}, {time.perf_counter() - started:.0f} s",
                    console=not shown)
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                last_eval = {"step": step, **evaluate(raw_model, eval_dm, tc.eval_tokens, precision, accelerator,
                                                      loss_fn)}
                metrics.log(last_eval)
                if step < tc.steps:  # the last one is in the summary
                    say(report.eval_line(step, tc.steps, last_eval))
            stopping = stop_votes > 0 and step < tc.steps  # a signal in the last step lets the run finish
            if step == tc.steps or stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                saved = resume.save_checkpoint(
                    ckpt_root, step, model=raw_model, optimizer=optimizer, scheduler=scheduler,
                    data_state=dm.state_dict(), merge_data_states=data.merge_states, accelerator=accelerator,
                    tokens=tokens, keep=cfg.checkpoint.keep, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                    extra={"active_blocks": active})
                watch.saved(saved)  # becomes last_good if the next step's loss is no spike
            if stopping:
                signame = STOP.received or "a signal on another rank"
                metrics.log({"event": "preempted", "step": step, "signal": signame})
                bar.close()
                say(report.stopped_message(signame, step, ckpt_root, run_dir))
                accelerator.wait_for_everyone()  # see the end of the loop: no rank tears down early
                requeue(STOP.previous or {}, STOP.received)  # submitit jobs: submitit requeues (rank 0 exits)
                return EXIT_PREEMPTED

        # ---- the end: the final evaluation (unless resumed past it), end row, plot, summary.
        bar.close()
        report.finish(metrics, say, step=step, tokens=tokens, last_eval=last_eval, raw_model=raw_model,
                      optimizer=optimizer, dm=eval_dm, tc=tc, accelerator=accelerator, loss_fn=loss_fn, sharded=sharded,
                      started=started, model_name=cfg.model.name, option=optimizer_option(cfg), run_dir=run_dir,
                      name=name, adamw_bytes=start_row["adamw_state_bytes"])
        # Rank 0 still logs and plots after the last collective; a rank that exits (closing its gloo
        # connections) while a peer is alive can make the peer abort (std::terminate). Leave together.
        accelerator.wait_for_everyone()
        return 0
    except RuntimeError as err:
        if world > 1 and distributed.is_collective_timeout(err):
            raise distributed.CollectiveTimeout(distributed.collective_timeout_message(
                monitor, rank, tc.collective_timeout_s, err)) from err
        raise
    except OSError as err:  # a full disk outside a checkpoint write (metrics.jsonl, a restart): one line
        raise ckpt.out_of_space(err, run_dir) or err
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if lock is not None:
            lock.release()
        if installed:
            STOP.restore()
        if world > 1:  # see distributed.park: the DDP reducer's gloo group is not torn down in this frame
            distributed.park(accelerator, model)
        accelerator.end_training()  # destroy the process group before the interpreter exits


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
