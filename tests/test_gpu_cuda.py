"""What only a GPU can show (skipped without one, with the reason): the step's host syncs counted
by CUDA's own sync debug mode, the device's MFU peak found in the table, the CUDA RNG state of this
device restored, and the preflight passing on the node."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_forward_backward_and_grad_norm_never_sync_the_host():
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call: forward_backward
    and the gradient norm run under it; step_totals is the step's one sync (its `.tolist()`)."""
    from omegaconf import OmegaConf

    import models
    from train_utils import loop

    device = torch.device("cuda", torch.cuda.current_device())
    model = models.build_model(OmegaConf.load(os.path.join(REPO, "configs/model/llama_tiny.yaml")),
                               vocab_size=512).to(device)

    class OneProcess:
        num_processes = 1

        @staticmethod
        def reduce(tensor, reduction="sum"):
            return tensor

    OneProcess.device = device
    ids = torch.randint(0, 512, (2, 64)).pin_memory()
    batches = [{"input_ids": ids, "labels": ids.clone().pin_memory()} for _ in range(2)]
    loop.forward_backward(model, batches, OneProcess, "bf16-mixed")  # warm-up (allocations, cuBLAS)
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_sum, n_global = loop.forward_backward(model, batches, OneProcess, "bf16-mixed")
        norm = loop.grad_norm_(list(model.parameters()), None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss, *_ = loop.step_totals(OneProcess, loss_sum, norm, n_global, None)
    assert loss > 0


def test_this_device_has_a_peak():
    from train_utils.measure import device_peak

    name = torch.cuda.get_device_name()
    if device_peak(name) is None:
        pytest.skip(f"{name} is not in train_utils.measure.PEAK_FLOPS (pass train.peak_flops)")
    assert device_peak(name)[1] > 1e13


def test_cuda_rng_state_of_this_device_round_trips():
    from train_utils import checkpoint as ckpt

    state = ckpt.rng_state()
    expected = torch.rand(3, device="cuda")
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def test_preflight_passes_on_this_node(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "ops.preflight", "--model", "llama_60m", "--workdir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:]
