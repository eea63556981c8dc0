"""The run record: what train.py builds for one training run, passed whole to the helpers that log,
checkpoint, restore and end it (report.py, resume.py), which take it and only what they alone need
(handed over one by one, the parts made calls of 11 to 18 arguments). The first fields are known
before anything is built; the others (from `dm` on) are None until train() builds them, and are set
once (except `scheduler`, rebuilt by resume.restore), in place, so the clean-up sees whatever exists
when a step fails. What changes every step stays in train()'s loop and is passed explicitly.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf

from train_utils.checkpoint import CHECKPOINT_DIR
from train_utils.hooks import OptimizerHooks
from train_utils.loop import compile_wanted
from train_utils.measure import flops_per_position, peak_flops
from train_utils.metrics import Console, MetricsLog
from train_utils.naming import run_name


@dataclass(eq=False)
class Run:
    """One training run's parts (see the module docstring); the rest are read from these."""

    cfg: DictConfig
    run_dir: str  # absolute, the same on every rank
    accelerator: Any  # accelerate.Accelerator: the processes
    accum: int  # micro-batches per rank and step (gradient accumulation)
    tf32: bool  # TF32 matmuls are on (train.tf32 on an Ampere or newer GPU)
    say: Console = field(init=False)  # the console and train.log (main process only)
    # Built by train(), in this order:
    dm: Any = None  # the data module (data.build_data)
    raw_model: Any = None  # the model itself: what is evaluated, checkpointed and measured
    loss_fn: Callable | None = None  # the compiled blocks' loss, None when eager
    model: Any = None  # what forward/backward calls: the DDP wrapper, or raw_model (alone, or sharded in place)
    optimizer: Any = None
    hooks: OptimizerHooks | None = None  # FRUGAL's loop hooks; no-ops for any other torch optimizer
    in_backward: Any = None  # frugal.StepInBackward with train.optimizer_in_backward: the step runs in backward
    scheduler: Any = None  # the LR schedule (a LambdaLR)
    metrics: MetricsLog | None = None  # metrics.jsonl (+ wandb), main process only

    def __post_init__(self):
        self.say = Console(self.run_dir, enabled=self.is_main)

    @property
    def tc(self):
        return self.cfg.train

    @property
    def ckpt_root(self) -> str:
        return os.path.join(self.run_dir, CHECKPOINT_DIR)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self):
        return self.accelerator.device

    @property
    def precision(self) -> str:
        return self.tc.precision  # resolved (no `auto`) before the record is made

    @property
    def sharded(self) -> bool:
        """FSDP2: weights and optimizer state per rank are shards (rows sum the ranks)."""
        return self.tc.parallelism == "fsdp"

    @property
    def compiled(self) -> bool:
        """train.compile resolved (auto: on GPUs)."""
        return compile_wanted(self.tc.compile, self.device)

    @property
    def opt_cfg(self) -> dict:
        """The optimizer's keys, resolved: what frugal.build_optimizer and the estimates take."""
        return OmegaConf.to_container(self.cfg.optimizer, resolve=True)

    @property
    def name(self) -> str:
        """wandb's run name and the loss plot's title: <model>-<optimizer option>-<swept values or run dir>."""
        return run_name(self.cfg, self.run_dir)

    @property
    def flops_per_position(self) -> float:
        """Training FLOPs per position of the built model (MFU, the input pipeline's demand)."""
        model_cfg = self.cfg.model
        return flops_per_position(self.raw_model, model_cfg.num_hidden_layers, model_cfg.hidden_size,
                                  self.cfg.data.seq_len)

    @property
    def peak_flops(self) -> float | None:
        """One device's peak FLOP/s for MFU (train.peak_flops, else the table's), None if unknown."""
        return peak_flops(self.device, self.tc.peak_flops)


@dataclass(eq=False)
class Session:
    """What surrounds a run's training story (`session`): the processes and their settings, and the
    parts `train()` hands over as it builds them, for the clean-up to close."""

    accelerator: Any
    tf32: bool
    run: Run | None = None
    log: Any = None  # report.StepLog: its progress bar
    lock: Any = None  # run_lock.hold's: one run per run dir

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


@contextlib.contextmanager
def session(cfg: DictConfig, run_dir: str, stop) -> Iterator[Session]:
    """Everything around the training story in `train()`. In: the loop's settings checked, the stop
    handler (`stop`: signals.STOP) installed, the processes (accelerate; SLURM tasks without torchrun),
    TF32, `train.precision=auto` resolved. Out, whatever happened: a collective timeout naming the rank
    that stopped answering, a full disk as one line, the bar, metrics and lock closed, the handler
    restored, the ranks leaving together, the process group destroyed."""
    from train_utils import checkpoint as ckpt
    from train_utils import distributed
    from train_utils.loop import allow_tf32
    from train_utils.naming import debug_option
    from train_utils.slurm import export_distributed_env
    from train_utils.validation import check_loop_settings, resolve_precision

    tc = cfg.train
    check_loop_settings(tc)  # the loop's own keys, the collective timeout among them: before the processes
    installed = stop.install()
    try:
        export_distributed_env()  # SLURM tasks without torchrun (srun, submitit): rank/world from the job
        accelerator = distributed.make_accelerator(tc.collective_timeout_s)
        tf32 = allow_tf32(tc.tf32, accelerator.device)
        tc.precision = resolve_precision(tc.precision, accelerator.device, debug_option())  # auto: bf16-mixed
    except BaseException:  # a refused precision, no process group: the handler goes with the run
        if installed:
            stop.restore()
        raise
    s = Session(accelerator, tf32)
    try:
        yield s
    except RuntimeError as err:
        if s.world > 1 and distributed.is_collective_timeout(err):
            raise distributed.CollectiveTimeout(distributed.collective_timeout_message(
                s.world, accelerator.process_index, tc.collective_timeout_s, err)) from err
        raise
    except OSError as err:  # a full disk outside a checkpoint write (metrics.jsonl, a restart): one line
        raise ckpt.out_of_space(err, run_dir) or err
    finally:
        if s.log is not None:
            s.log.close()
        if s.run is not None and s.run.metrics is not None:
            s.run.metrics.close()
        if s.lock is not None:
            s.lock.release()
        if installed:
            stop.restore()
        if s.world > 1:  # see distributed.park: the DDP reducer's gloo group is not torn down in this frame
            distributed.park(accelerator, s.run.model if s.run is not None else None)
        accelerator.end_training()  # destroy the process group before the interpreter exits
