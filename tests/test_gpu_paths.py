"""GPU code paths proven on CPU through their mechanism (issue: the first GPU launch works).

CUDA RNG states across GPU layouts: torch's own torch.cuda.random functions run against real
generators (CPU ones standing in for the per-device CUDA generators), with as many "devices" as the
process sees: a checkpoint written where 4 GPUs were visible resumes where only 1 is."""
import shutil

import pytest
import torch
import torch.cuda.random as cuda_random

from train_utils import checkpoint as ckpt

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch.compile on CPU needs a C++ compiler")


def fake_gpus(monkeypatch, count: int, current: int = 0) -> tuple:
    """`count` visible CUDA devices whose generators are real (CPU) generators, each seeded apart;
    torch.cuda.get_rng_state/set_rng_state(_all) run unchanged on top of them."""
    gens = tuple(torch.Generator().manual_seed(100 + i) for i in range(count))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(cuda_random, "current_device", lambda: current)
    monkeypatch.setattr(cuda_random, "device_count", lambda: count)
    monkeypatch.setattr(cuda_random, "_lazy_init", lambda: None)
    monkeypatch.setattr(cuda_random, "_lazy_call", lambda cb: cb())
    monkeypatch.setattr(cuda_random, "is_initialized", lambda: True)
    return gens


def test_cuda_rng_state_resumes_under_fewer_visible_gpus(monkeypatch):
    gens = fake_gpus(monkeypatch, 4, current=2)  # rank 2 of a torchrun on 4 visible GPUs
    state = ckpt.rng_state()
    assert isinstance(state["cuda"], torch.Tensor)  # this device's state only
    expected = torch.rand(3, generator=gens[2])
    gens = fake_gpus(monkeypatch, 1, current=0)  # resumed with one GPU bound to the task
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3, generator=gens[0]), expected)


def test_older_checkpoints_with_every_gpus_state_load(monkeypatch):
    gens = fake_gpus(monkeypatch, 4, current=1)
    old = {**ckpt.rng_state(), "cuda": torch.cuda.get_rng_state_all()}  # what earlier versions stored
    expected = torch.rand(3, generator=gens[1])
    with pytest.raises(IndexError):  # what the old restore did on a process that sees fewer GPUs
        fake_gpus(monkeypatch, 1)
        torch.cuda.set_rng_state_all(old["cuda"])
    gens = fake_gpus(monkeypatch, 2, current=1)  # the current device's entry is restored
    ckpt.set_rng_state(old)
    assert torch.equal(torch.rand(3, generator=gens[1]), expected)
    gens = fake_gpus(monkeypatch, 8, current=6)  # no entry for this device: loads, the seeded stream stays
    before = gens[6].get_state()
    ckpt.set_rng_state(old)
    assert torch.equal(gens[6].get_state(), before)


# torch.cuda.get_device_name() strings as the devices report them (nvidia-smi's names).
@pytest.mark.parametrize("name,label,flops", [
    ("NVIDIA A100-SXM4-40GB", "A100", 312e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100-PCIE-40GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200", "H200 SXM", 989e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", "GH200", 989e12),
    ("NVIDIA L40S", "L40S", 362e12),
    ("NVIDIA L40", "L40", 181e12),
    ("NVIDIA L4", "L4", 121e12),
    ("NVIDIA A10", "A10", 125e12),
    ("NVIDIA A40", "A40", 150e12),
    ("NVIDIA B200", "B200", 2.25e15),
    ("Tesla V100-SXM2-32GB", None, None),  # no bf16 tensor cores: no entry
    ("NVIDIA GeForce RTX 4090", None, None),
])
def test_peak_flops_by_device_name(monkeypatch, name, label, flops):
    from train_utils.measure import device_peak, peak_flops

    assert device_peak(name) == ((label, flops) if label else None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, None) == flops
    assert peak_flops(cuda, 1.5e15) == 1.5e15  # train.peak_flops overrides the table


# ---- activation checkpointing, measured by the bytes autograd saves for backward
@pytest.fixture(scope="module")
def process_group():
    """A 1-process gloo group (what DDP and FSDP2 need), private to this module's tests."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_llama(checkpointing: bool, compiled: bool, parallelism: str):
    """The order of train.py: checkpointing, compile, then DDP or FSDP2."""
    from omegaconf import OmegaConf

    import models
    from frugal.grouping import transformer_blocks
    from train_utils.loop import compile_model, enable_activation_checkpointing

    torch.manual_seed(0)
    cfg = OmegaConf.load("configs/model/llama_tiny.yaml")
    model = models.build_model(cfg, vocab_size=512)
    if checkpointing:
        enable_activation_checkpointing(model)
    if compiled:
        compile_model(model)
    raw = model
    if parallelism == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in transformer_blocks(model):
            fully_shard(block)
        fully_shard(model)
    return raw, model


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)])
@pytest.mark.parametrize("parallelism", ["none", "ddp", "fsdp"])
def test_activation_checkpointing_saves_activations_in_every_combination(process_group, compiled, parallelism):
    """Checkpointed blocks keep only their inputs for backward: the saved bytes drop to a fraction
    (measured in fp32: 3.0 MiB vs 26.1 eager / 21.4 compiled). Before the fix, compiled blocks under FSDP2
    saved as much with checkpointing as without, and `activation_checkpointing_on` said True."""
    from train_utils.loop import activation_checkpointing_on, saved_tensor_bytes, token_loss_sum

    ids = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(0))
    saved = {}
    for checkpointing in (False, True):
        raw, model = tiny_llama(checkpointing, compiled, parallelism)

        def run():  # fp32: what a block saves is the point, not its dtype (compiled bf16 is slow on AVX2)
            return token_loss_sum(model(input_ids=ids, use_cache=False).logits, ids)

        saved[checkpointing] = saved_tensor_bytes(run)
        run().backward()  # the recomputation runs (and works) in backward
        assert all(p.grad is not None for p in raw.parameters())
        assert activation_checkpointing_on(raw) == checkpointing
    assert saved[True] < 0.4 * saved[False], saved


# ---- one host sync per step
def test_a_step_has_one_host_sync_and_only_non_blocking_copies(monkeypatch):
    """forward_backward, the gradient norm and step_totals: every host-to-device copy is
    non-blocking (no torch.tensor(host data, device=...) either: step_totals fills its vector on the
    device), the target count is computed from the labels already on the device (not counted on
    the host and copied over), and the only value read back to the host is step_totals' one
    `.tolist()`. Reads back from the loop's code (train_utils/) are counted by their call site."""
    import os
    import sys

    from train_utils import loop

    raw, model = tiny_llama(False, False, "none")

    class OneProcess:  # accelerate's Accelerator for one process: reduce is the identity
        device, num_processes = torch.device("cpu"), 1

        @staticmethod
        def reduce(tensor, reduction="sum"):
            return tensor

    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):  # three micro-batches, with pads (ignored targets)
        ids = torch.randint(0, 512, (2, 16), generator=gen)
        labels = ids.clone()
        labels[:, 12:] = -100
        batches.append({"input_ids": ids.pin_memory() if torch.cuda.is_available() else ids, "labels": labels})
    copies, reads = [], []
    real_to = torch.Tensor.to
    ours = os.path.dirname(loop.__file__)

    def to(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if os.path.dirname(caller.co_filename) == ours:
            copies.append((caller.co_name, kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    def reader(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if os.path.dirname(caller.co_filename) == ours:
                reads.append(f"{caller.co_name}:{name}")
            return real(self, *args, **kwargs)
        return read

    real_tensor = torch.tensor

    def tensor(*args, **kwargs):  # host data made into a device tensor: a blocking copy on CUDA
        caller = sys._getframe(1).f_code
        if os.path.dirname(caller.co_filename) == ours:
            copies.append((caller.co_name, "torch.tensor"))
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "tensor", tensor)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, reader(name))
    loss_sum, n_global = loop.forward_backward(model, batches, OneProcess, "bf16-mixed")
    norm = loop.grad_norm_([p for p in raw.parameters()], None)
    loss, grad_norm, targets, votes, events = loop.step_totals(OneProcess, loss_sum, norm, n_global, None)
    monkeypatch.undo()
    assert copies == [("to_device", True)] * 6, copies  # ids and labels of 3 micro-batches; nothing else
    assert reads == ["step_totals:tolist"], reads
    assert targets == 3 * 2 * 11 and n_global.device == OneProcess.device
    # the loss is the token-weighted mean, recomputed here without the loop
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        total = sum(loop.token_loss_sum(raw(input_ids=b["input_ids"]).logits, b["labels"]).double() for b in batches)
    assert loss == pytest.approx(float(total) / targets, rel=1e-6)


# ---- naming a frozen rank needs no extra process group
_NAMING = r"""
import sys, torch.distributed as dist
from train_utils import distributed
rank, port, frozen = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "frozen"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
store = dist.distributed_c10d._get_default_store()
if rank == 1 and frozen:
    store.wait(["rank0_done"])  # alive, but never answers the check
else:
    print(f"[{rank}] " + distributed.name_unresponsive_ranks(2, rank, 3.0), flush=True)
    store.set(f"rank{rank}_done", "1")
    if rank == 0:
        store.wait(["rank1_done"] if not frozen else [])
"""


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.slow
def test_an_unresponsive_rank_is_named_without_a_side_group(tmp_path, frozen):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, "PYTHONPATH": ".", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _NAMING, str(r), str(port), "frozen" if frozen else "ok"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    if frozen:
        assert outs[0][0].strip() == "[0] rank 1 did not answer a check within 3 s"
    else:
        for r in (0, 1):
            assert outs[r][0].strip().startswith(f"[{r}] every rank answered the check afterwards")


# ---- input workers sized from the device's demand
def test_input_workers_follow_the_device_demand():
    """llama_130m's one worker per rank was sized for an A100 at MFU 0.5; an H100 SXM consumes 3.2x
    as many positions, so the start row asks for more (recomputed here from the formula)."""
    from omegaconf import OmegaConf

    import models
    from train_utils.measure import WORKER_POSITIONS_PER_S, device_peak, flops_per_position, input_demand

    cfg = OmegaConf.load("configs/model/llama_130m.yaml")
    with torch.device("meta"):
        model = models.build_model(cfg)
    flops = flops_per_position(model, cfg.num_hidden_layers, cfg.hidden_size, 256)
    assert flops == pytest.approx(0.685e9, rel=0.01)  # docs/data_pipeline.md's table
    a100, h100 = device_peak("NVIDIA A100-SXM4-80GB")[1], device_peak("NVIDIA H100 80GB HBM3")[1]
    assert input_demand("c4", 1, flops, a100)["input_workers_needed"] == 1
    assert "input_warning" not in input_demand("c4", 1, flops, a100)
    on_h100 = input_demand("c4", 1, flops, h100)
    need = 2 * h100 * 0.5 / flops / WORKER_POSITIONS_PER_S["c4"]  # 2.9 workers
    assert on_h100["input_workers_needed"] == 4 and 2 < need <= 4
    assert on_h100["input_positions_needed_per_s"] == pytest.approx(h100 * 0.5 / flops)
    assert "data.num_workers=1 < 4 needed" in on_h100["input_warning"]
    assert "input_warning" not in input_demand("c4", 4, flops, h100)
    assert "input_warning" not in input_demand("tokens", 1, flops, h100)  # pretokenized: one worker suffices
    assert input_demand("c4", 1, flops, None) == {}  # no peak (CPU): nothing to size from


@pytest.mark.parametrize("need,cores,local,world,readers,expected", [
    (4, 32, 8, 8, 64, 3 - 1),  # 4 cores per rank: 3 spare, and 8 x 3 does not divide 64 readers: 2
    (4, 64, 8, 8, 64, 4),      # enough cores: the demand
    (8, 64, 8, 8, 64, 7 - 3),  # 7 spare, capped to 4 (8 x 4 = 32 divides 64; 8 x 5..7 do not)
    (1, 2, 2, 2, 64, 0),       # two processes on two cores: nothing to spare, the processes read
    (1, 2, 1, 1, 64, 1),       # one process on two cores: one worker tokenizes off the loop
])
def test_auto_workers_take_the_demand_within_the_spare_cores(monkeypatch, need, cores, local, world, readers,
                                                              expected):
    import os

    import data

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    assert data.auto_workers(need, readers, world) == expected
    dm = data.build_data({"name": "synthetic", "seq_len": 16, "readers": readers, "num_workers": "auto"},
                         micro_batch_size=1, rank=0, world_size=world)
    assert dm.num_workers == data.auto_workers(1, readers, world)  # library use: one worker when a core is free

