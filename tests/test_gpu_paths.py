"""GPU code paths proven on CPU through their mechanism (issue: the first GPU launch works).

CUDA RNG states across GPU layouts: torch's own torch.cuda.random functions run against real
generators (CPU ones standing in for the per-device CUDA generators), with as many "devices" as the
process sees: a checkpoint written where 4 GPUs were visible resumes where only 1 is."""
import pytest
import torch
import torch.cuda.random as cuda_random

from train_utils import checkpoint as ckpt


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
