"""What a training row measures besides the loss: time, data wait, throughput, MFU, peak memory.

Throughput: `scored_tokens_per_s` counts the targets the loss scores (what token budgets count),
`positions_per_s` every position computed, pads included. MFU (GPUs) = model FLOPs (6N + 12 x layers
x hidden x seq_len per position, PaLM appendix B; N without the input embeddings, a tied head counted)
/ the dense bf16 peak of PEAK_FLOPS or `train.peak_flops`; without either no MFU. Optimizer-state
bytes are the whole run's (FSDP2 ranks summed). Peak memory since the previous row: CUDA's allocator
peak, or on CPU the peak RSS (reset through /proc/self/clear_refs on Linux).
"""
from __future__ import annotations

import math
import re
import resource
import sys

import torch
import torch.distributed as dist

import frugal

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's data sheets, by a case-insensitive pattern of the
# CUDA device name; the first match wins (variants before their family; SXM H100 is "H100 80GB HBM3").
PEAK_FLOPS = (
    (r"GH200", "GH200", 989e12),
    (r"H100.*NVL", "H100 NVL", 835e12),
    (r"H100.*PCIe", "H100 PCIe", 756e12),
    (r"H100|H800", "H100 SXM", 989e12),
    (r"H200.*NVL", "H200 NVL", 835e12),
    (r"H200", "H200 SXM", 989e12),
    (r"GB200", "GB200", 2.5e15),
    (r"B200", "B200", 2.25e15),
    (r"B100", "B100", 1.75e15),
    (r"A100|A800", "A100", 312e12),  # 40 and 80 GB, SXM and PCIe: the same tensor-core peak
    (r"L40S", "L40S", 362e12),
    (r"L40\b", "L40", 181e12),
    (r"A40\b", "A40", 150e12),
    (r"A10\b", "A10", 125e12),
    (r"L4\b", "L4", 121e12),
)


def device_peak(name: str) -> tuple[str, float] | None:
    """(the table's name, dense bf16 FLOP/s) for a CUDA device name, or None if it is not in the table."""
    for pattern, label, flops in PEAK_FLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label, flops
    return None


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """The peak FLOP/s of one device for MFU: `train.peak_flops` when set, else the table's entry
    for this CUDA device, else None (no MFU logged)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    found = device_peak(torch.cuda.get_device_name(device))
    return found[1] if found else None


# What one DataLoader worker delivers, positions per second on a core of its own (measured:
# docs/data_pipeline.md, "Throughput and DataLoader workers"); the training process itself reads
# when data.num_workers=0.
WORKER_POSITIONS_PER_S = {"c4": 500e3, "local": 500e3, "tokens": 20e6, "synthetic": 2e6}
INPUT_MFU = 0.5  # the demand is sized at this MFU (the upper end for these models: errs on the safe side)
INPUT_SAFETY = 2.0  # cluster cores, real text and a compiled model differ from the measurement


def input_demand(source: str, num_workers: int, flops: float, peak: float | None) -> dict:
    """Can the input pipeline keep one device fed? Demand = peak x INPUT_MFU / FLOPs per position;
    workers = INPUT_SAFETY x demand / one worker's rate, rounded up to a power of two. Returns the start
    row's entries (`input_warning` when data.num_workers is short); {} without a peak."""
    rate = WORKER_POSITIONS_PER_S.get(source)
    if not peak or not rate or not flops:
        return {}
    demand = peak * INPUT_MFU / flops
    need = INPUT_SAFETY * demand / rate
    workers = 1 << max(0, math.ceil(math.log2(need))) if need > 1 else 1
    out = {"input_positions_needed_per_s": demand, "input_workers_needed": workers}
    if max(num_workers, 1) < workers:  # 0 workers: the training process reads, about one worker's rate
        out["input_warning"] = (
            f"the input pipeline may not keep up: at MFU {INPUT_MFU:.0%} this device consumes "
            f"{demand:,.0f} positions/s, "
            f"one {source} worker delivers about {rate:,.0f}; data.num_workers={num_workers} < {workers} needed "
            f"(x{INPUT_SAFETY:g} safety). Set data.num_workers={workers} (the data order does not change) or "
            f"pretokenize (data=tokens); data_wait_s in the rows shows the wait")
    return out


def workers_needed(cfg, device: torch.device) -> int:
    """DataLoader workers per rank this device's demand needs (input_demand, the model on the meta
    device), 1 without a peak; for data.num_workers=auto (data.auto_workers)."""
    peak = peak_flops(device, cfg.train.peak_flops)
    if not peak or cfg.data.name not in WORKER_POSITIONS_PER_S:
        return 1
    import models

    with torch.device("meta"):
        model = models.build_model(cfg.model, vocab_size=cfg.model.get("vocab_size"))
    flops = flops_per_position(model, cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.data.seq_len)
    return input_demand(cfg.data.name, 0, flops, peak).get("input_workers_needed", 1)


def flops_per_position(model: torch.nn.Module, num_layers: int, hidden_size: int, seq_len: int) -> float:
    embeddings = model.get_input_embeddings()
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    n = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    head = model.get_output_embeddings()
    if head is not None and head.weight is embeddings.weight:  # tied: the head's matmul still runs
        n += head.weight.numel()
    return 6.0 * n + 12.0 * num_layers * hidden_size * seq_len


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _peak_rss()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        return torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set size
    except OSError:
        pass


class Interval:
    """Sums over the steps since the last training row; `row()` turns them into rates."""

    def __init__(self, device: torch.device, flops_per_position: float, peak: float | None, world: int):
        self.device, self.flops, self.peak, self.world = device, flops_per_position, peak, world
        self.reset()

    def reset(self) -> None:
        self.steps, self.scored, self.positions, self.seconds, self.data_wait = 0, 0, 0, 0.0, 0.0
        reset_peak_memory(self.device)

    def add(self, scored: int, positions: int, seconds: float, data_wait: float) -> None:
        """One step: global scored targets and positions, its wall time and the part spent waiting for data."""
        self.steps += 1
        self.scored += scored
        self.positions += positions
        self.seconds += seconds
        self.data_wait += data_wait

    def row(self) -> dict:
        """Per-step means of the interval (evaluations and checkpoints excluded) and its rates;
        starts the next interval."""
        seconds = max(self.seconds, 1e-9)
        out = {"step_time_s": seconds / self.steps, "data_wait_s": self.data_wait / self.steps,
               "scored_tokens_per_s": self.scored / seconds, "positions_per_s": self.positions / seconds,
               "peak_memory_bytes": peak_memory_bytes(self.device)}
        if self.peak:
            out["mfu"] = self.flops * self.positions / seconds / (self.peak * self.world)
        self.reset()
        return out


class StateBytes:
    """The rows' `optimizer_state_bytes`, re-counted only at the first read and after `stale()` (a switch
    or optimizer event, the same steps on every rank): sharded, a count is an all-reduce."""

    def __init__(self, optimizer, sharded: bool, device: torch.device):
        self.optimizer, self.sharded, self.device, self.value = optimizer, sharded, device, None

    def stale(self) -> None:
        self.value = None

    def __call__(self) -> int:
        if self.value is None:
            self.value = optimizer_state_bytes(self.optimizer, self.sharded, self.device)
        return self.value


def optimizer_state_bytes(optimizer, sharded: bool, device: torch.device) -> int:
    """`frugal.state_bytes` of the whole run: summed over the ranks when the state is sharded (a
    collective: every rank calls it at the same rows)."""
    held = frugal.state_bytes(optimizer)
    if not sharded or not dist.is_initialized() or dist.get_world_size() == 1:
        return held
    total = torch.tensor([held], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())
