"""Pre-train a language model with FRUGAL or one of its baselines: the main job.

    python train.py                                      # quickstart: llama_tiny + FRUGAL on the synthetic corpus
    python train.py optimizer=adamw train.steps=1000     # any config key can be overridden
    python train.py experiment=table2 model=llama_130m   # a cell of a paper table (configs/experiment/)
    torchrun --standalone --nproc_per_node 2 train.py hydra.run.dir=runs/ddp    # data parallel
    python train.py hydra.run.dir=<run dir>              # continue a stopped run (train.resume=auto)

The script reads top to bottom: processes and config checks, data/model/optimizer, resume, the loop,
the final evaluation and summary. Helpers live with their concern: `train_utils/checkpoint.py`
(atomic checkpoints, RNG), `train_utils/metrics.py` (metrics.jsonl, wandb, plot),
`train_utils/config.py` (start-up validation).

Loss. Every optimizer step minimises the mean next-token loss over the *global* batch: the sum of
the per-token losses of all micro-batches on all ranks divided by the global number of non-pad target
tokens. The token count is all-reduced before the first backward, so each micro-batch's summed loss
is scaled by world_size / global_tokens (DDP then averages over ranks). The result does not depend on
how the batch is split into micro-batches or ranks, and padded sequences weigh by their real tokens.
Validation uses the same token weighting (all ranks' sums all-reduced); perplexity = exp(val loss).

Precision. bf16-mixed: fp32 weights and optimizer state, bf16 autocast for the forward pass (CPU and
GPU). bf16: the model (and hence the optimizer state) cast to bf16, no autocast. fp32: no autocast.
The loss itself is always computed from fp32 logits.

Exit codes: 0 done; 1 error, including a non-finite loss (the message names the step; checkpoints
already written stay); 2 invalid configuration; 75 (EX_TEMPFAIL, "try again") stopped by SIGTERM,
SIGUSR1 or SIGUSR2 after writing a checkpoint: rerun the same command with the same run dir to continue
(in a submitit job, submitit requeues it: train_utils/slurm.py).
"""
from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: on a CPU shared with other processes (a laptop, CI,
# several jobs per node) spinning threads of a 2-thread torch were measured 10x+ slower than one
# thread; sleeping ones cost little when the machine is idle. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import signal
import sys
import time

import hydra
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import data
import frugal
import models
from train_utils.slurm import export_distributed_env, requeue
from train_utils import checkpoint as ckpt
from train_utils.config import ConfigError, validate
from train_utils.loop import end_of_run_summary, evaluate, forward_backward, ranks_in_sync, seed_everything
from train_utils.metrics import MetricsLog, peak_memory_bytes, plot_losses

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a checkpoint was written, run again to continue
# scancel / preemption, and SLURM's warning before the time limit (scripts/sbatch_train.sh asks for
# USR1, submitit for USR2).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def find_resume(resume: str, ckpt_root: str) -> str | None:
    if resume == "never":
        # Starting over in a directory that holds checkpoints would mix two runs' metrics and let a
        # later resume=auto pick up the old run's weights.
        if ckpt.list_checkpoints(ckpt_root):
            raise ConfigError(f"train.resume=never, but {ckpt_root} already holds checkpoints (latest: "
                              f"{ckpt.latest(ckpt_root)}); use a new hydra.run.dir, train.resume=auto to "
                              f"continue that run, or delete its checkpoints")
        return None
    if resume == "auto":
        return ckpt.latest(ckpt_root)
    found = ckpt.resolve(resume)
    if found is None:
        raise ConfigError(f"train.resume={resume!r}: no checkpoint there (expected a checkpoint directory "
                          f"holding trainer.pt, or a run directory with checkpoints/); use auto or never")
    return found


def train(cfg: DictConfig, run_dir: str) -> int:
    """Run (or continue) the training job described by `cfg` in `run_dir`; return the exit code."""
    # ---- processes and devices: one process, or one per torchrun / accelerate-launch worker.
    # accelerate picks cuda or cpu and the backend (NCCL on GPU, gloo on CPU). Precision is ours
    # (train.precision), so accelerate must not add its own autocast. Without a GPU, cpu=True is what
    # makes accelerate form a gloo process group under torchrun (otherwise each worker runs alone).
    export_distributed_env()  # SLURM tasks without torchrun (srun, submitit): rank/world from the job
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
    rank, world, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    device = accelerator.device
    accum = validate(cfg, world)
    tc, precision = cfg.train, cfg.train.precision
    # Every rank must write to the same place even if each resolved ${now:...} on its own.
    run_dir = broadcast_object_list([os.path.abspath(run_dir)])[0]
    ckpt_root = os.path.join(run_dir, ckpt.CHECKPOINT_DIR)
    if is_main:
        ckpt.remove_temporaries(ckpt_root)  # what a writer killed mid-save left behind
    resume_from = find_resume(tc.resume, ckpt_root)
    say = print if is_main else (lambda *a, **k: None)

    # ---- data, model, optimizer, schedule. Same seed on every rank: identical initial weights.
    seed_everything(tc.seed)
    opt_cfg = OmegaConf.to_container(cfg.optimizer, resolve=True)
    sched_cfg = OmegaConf.to_container(cfg.schedule, resolve=True)
    try:
        dm = data.build_data(cfg.data, micro_batch_size=tc.micro_batch_size, rank=rank, world_size=world,
                             seed=tc.seed, model_vocab_size=cfg.model.vocab_size,
                             max_positions=cfg.model.max_position_embeddings)
        raw_model = models.build_model(cfg.model, vocab_size=dm.vocab_size)
        if precision == "bf16":
            raw_model.to(torch.bfloat16)
        model = accelerator.prepare_model(raw_model)  # to the device; DDP wrapper when world > 1
        optimizer = frugal.build_optimizer(raw_model, **opt_cfg)
        scheduler = frugal.build_scheduler(optimizer, total_steps=tc.steps, **sched_cfg)
    # Bad names/values in model/, data/, optimizer/, schedule/ configs; a missing data.path or a
    # tokenizer that cannot be loaded offline (OSError): the messages say what to pass instead.
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from err

    # ---- resume: weights, optimizer state, schedule, each rank's data position, RNG states.
    step, tokens = 0, 0
    if resume_from is not None:
        trainer = ckpt.load(resume_from, "trainer")
        if trainer["world_size"] != world:
            raise ConfigError(f"checkpoint {resume_from} was written by {trainer['world_size']} processes, "
                              f"this run has {world}: per-rank data positions cannot be remapped")
        try:  # loaded to CPU memory; load_state_dict copies into the parameters' device
            raw_model.load_state_dict(ckpt.load(resume_from, "model"))
            optimizer.load_state_dict(ckpt.load(resume_from, "optimizer"))
            scheduler.load_state_dict(trainer["scheduler"])
            dm.load_state_dict(trainer["data"][rank])
        except (ValueError, RuntimeError, KeyError) as err:  # another model/optimizer/data config
            raise ConfigError(f"cannot resume from {resume_from} with this config ({err}); use the "
                              f"checkpoint's own settings (its config.yaml) or train.resume=never") from err
        ckpt.set_rng_state(trainer["rng"][rank])
        step, tokens = trainer["step"], trainer["tokens"]
        say(f"resuming from {resume_from} (step {step})")

    # ---- logging: metrics.jsonl (+ wandb) on the main process only.
    name = f"{cfg.model.name}-{cfg.optimizer.name}-{os.path.basename(run_dir)}"
    metrics = MetricsLog(run_dir, enabled=is_main, wandb_cfg=cfg.wandb, default_name=name,
                         run_config=OmegaConf.to_container(cfg, resolve=True))
    metrics.truncate_after(step if resume_from else -1)  # rows past the checkpoint never happened
    adamw_bytes = frugal.estimate_state_bytes(raw_model, "adamw")
    fraction = optimizer.state_full_fraction() if hasattr(optimizer, "state_full_fraction") else None
    metrics.log({"event": "start", "step": step, "params": sum(p.numel() for p in raw_model.parameters()),
                 "state_full_fraction": fraction,
                 # Appendix D estimate (the paper's layout); "optimizer_state_bytes" in the rows below is measured.
                 "optimizer_state_bytes_estimate": frugal.estimate_state_bytes(raw_model, **opt_cfg),
                 "adamw_state_bytes": adamw_bytes, "optimizer": cfg.optimizer.name, "model": cfg.model.name,
                 "loss_floor": dm.loss_floor, "world_size": world, "accumulation": accum,
                 "resumed_from": resume_from})

    # ---- preemption: SIGTERM/SIGUSR1 only raise a flag; the loop saves and exits at a step boundary.
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signal.Signals(signum).name

    previous_handlers = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}

    # ---- the loop
    train_iter = dm.train_batches()
    # The state-full blocks of the last step (a fresh run logs its first window as a switch).
    active = trainer.get("active_blocks") if resume_from else None
    last_eval, started = None, time.perf_counter()
    window_tokens, window_time = 0, 0.0
    bar = tqdm(total=tc.steps, initial=step, unit="step", dynamic_ncols=True,
               disable=not (is_main and tc.progress_bar))
    model.train()
    try:
        while step < tc.steps:
            t0 = time.perf_counter()
            batches = [next(train_iter) for _ in range(accum)]
            loss_sum, n_global = forward_backward(model, batches, accelerator, precision)
            n_global = n_global.item()
            # One small all-reduce gives every rank the global loss and whether any rank got a signal.
            flag = torch.tensor(float(stop["signal"] is not None), dtype=torch.float64, device=device)
            stats = accelerator.reduce(torch.stack([loss_sum, flag]), reduction="sum")
            loss_value = stats[0].item() / n_global
            if not math.isfinite(loss_value):
                raise FloatingPointError(
                    f"non-finite training loss ({loss_value}) at step {step + 1}; stopped before applying "
                    f"it. Last good checkpoint: {ckpt.latest(ckpt_root) or 'none'}. Try a lower optimizer.lr, "
                    f"train.grad_clip=1.0 or train.precision=fp32.")
            lr = scheduler.get_last_lr()[0]  # the lr this step uses
            blocks = optimizer.active_blocks() if hasattr(optimizer, "active_blocks") else None
            if blocks is not None and blocks != active:  # this step starts a new state-full window
                metrics.log({"event": "switch", "step": step + 1, "active_blocks": blocks})
                active = blocks
            grad_norm = None
            if tc.grad_clip:  # gradients are already identical on every rank here
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), tc.grad_clip).item()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += n_global
            window_tokens += n_global
            window_time += time.perf_counter() - t0

            if step % tc.log_every == 0 or step == tc.steps:
                row = {"step": step, "loss": loss_value, "lr": lr, "tokens": tokens,
                       "tokens_per_s": window_tokens / window_time,
                       "optimizer_state_bytes": frugal.state_bytes(optimizer),
                       "peak_memory_bytes": peak_memory_bytes(device)}
                if grad_norm is not None:
                    row["grad_norm"] = grad_norm
                metrics.log(row)
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}", refresh=False)
                window_tokens, window_time = 0, 0.0
            bar.update(1)

            if tc.eval_every and step % tc.eval_every == 0:
                last_eval = {"step": step, **evaluate(raw_model, dm, tc.eval_tokens, precision, accelerator)}
                metrics.log(last_eval)
            stopping = stats[1].item() > 0
            if step == tc.steps or stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                ckpt.save_checkpoint(ckpt_root, step, model=raw_model, optimizer=optimizer, scheduler=scheduler,
                                     dm=dm, accelerator=accelerator, tokens=tokens, keep=cfg.checkpoint.keep,
                                     config_yaml=OmegaConf.to_yaml(cfg, resolve=True), extra={"active_blocks": active})
            if stopping:
                signame = stop["signal"] or "a signal on another rank"
                metrics.log({"event": "preempted", "step": step, "signal": signame})
                bar.close()
                say(f"stopped by {signame} at step {step}; checkpoint saved in {ckpt_root}. "
                    f"To continue, run the same command with hydra.run.dir={run_dir} (train.resume=auto).")
                accelerator.wait_for_everyone()  # see the end of the loop: no rank tears down early
                requeue(previous_handlers, stop["signal"])  # submitit jobs: submitit requeues (rank 0 exits)
                return EXIT_PREEMPTED

        # ---- the end: final evaluation (unless the last step just had one), summary, plot.
        bar.close()
        if last_eval is None or last_eval["step"] != step:
            last_eval = {"step": step, **evaluate(raw_model, dm, tc.eval_tokens, precision, accelerator)}
            metrics.log(last_eval)
        in_sync, checksum = ranks_in_sync(raw_model)
        end = {"event": "end", "step": step, "val_loss": last_eval["val_loss"], "val_ppl": last_eval["val_ppl"],
               "tokens": tokens, "loss_floor": dm.loss_floor, "optimizer_state_bytes": frugal.state_bytes(optimizer),
               "adamw_state_bytes": adamw_bytes, "seconds": time.perf_counter() - started, "ranks_in_sync": in_sync,
               "weights_checksum": checksum}
        metrics.log(end)
        metrics.close()  # wandb prints its own lines at finish; the summary below comes last
        if is_main and tc.plot:
            plot_losses(metrics.path, os.path.join(run_dir, "loss.png"), dm.loss_floor, title=name)
        say(end_of_run_summary(end, cfg.model.name, cfg.optimizer.name, run_dir, tc.plot))
        # Rank 0 still logs and plots after the last collective; a rank that exits (closing its gloo
        # connections) while a peer is alive can make the peer abort (std::terminate). Leave together.
        accelerator.wait_for_everyone()
        return 0
    finally:
        bar.close()
        metrics.close()
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)
        accelerator.end_training()  # destroy the process group before the interpreter exits


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        status = train(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, FloatingPointError) as err:  # expected failures: a clear message, no traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2 if isinstance(err, ConfigError) else 1)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
