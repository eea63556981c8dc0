"""FRUGAL on FSDP2 shards (DESIGN invariant 10), 2 processes with gloo on CPU (tests/_fsdp_worker.py).

Block projection on DTensor shards trains exactly as the unsharded model (the subspace is the same
pure function on every rank), holds half the state per rank as DTensors, and round-trips through
torch.distributed.checkpoint. Column selection on row-sharded weights picks the unsharded columns,
so it matches too; row and randk selection draw within each shard (half the state per rank, indices
included). svd is refused with a clear message."""
import json
import os
import sys

import pytest

from _forkserver import run_python
from _train_helpers import failure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torchrun with 2 processes: the full suite's (the fast tier leaves out multi-process runs)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "tests", "_fsdp_worker.py"), str(out), str(out / "ckpt")]
    proc = run_python(cmd, cwd=REPO, env=env, timeout=300)  # forked ranks (tests/_forkserver.py)
    assert proc.returncode == 0, failure(proc)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.mark.parametrize("projection", ["block", "column"])
def test_sharded_matches_unsharded(ranks, projection):
    for r in ranks:
        assert r[projection]["diff"] < 1e-5, r[projection]


def test_the_step_inside_backward_on_shards_equals_one_process_and_ddp_is_refused(ranks):
    for r in ranks:
        got = r["in_backward"]
        assert got["diff"] < 1e-5 and got["clipped"] and got["left"] == 0, got
        assert got["plain"].startswith("the step inside backward over 2 processes needs FSDP2-sharded parameters")
        assert got["ddp"].startswith("the step inside backward cannot drive a DDP-wrapped model")
        for message in (got["plain"], got["ddp"]):
            assert "\n" not in message and "valid choices: FSDP2" in message


@pytest.mark.parametrize("projection", ["block", "column", "row", "randk"])
def test_state_per_rank_is_about_half(ranks, projection):
    total = sum(r[projection]["bytes"] for r in ranks)
    unsharded = ranks[0][projection]["bytes_unsharded"]
    # each rank keeps its shard of the moments; the scalar step counters are replicated
    assert abs(total - unsharded) <= 0.05 * unsharded, (total, unsharded)
    for r in ranks:
        assert r[projection]["bytes"] <= 0.55 * unsharded


def test_block_state_is_dtensor_and_checkpoints_with_dcp(ranks):
    for r in ranks:
        assert r["block"]["dtensor_state"]
        assert r["dcp"]["same_step"] and r["dcp"]["diff"] == 0.0, r["dcp"]


def test_badam_package_options_on_bf16_shards(ranks):
    """optimizer=badam as the authors ran it (reset_everything, window_offset=1, master_weights) on bf16
    shards: fp32 master copies and moments as DTensors, the sharded run equal to the unsharded one, and an
    exact torch.distributed.checkpoint round trip that keeps the copies in fp32."""
    for r in ranks:
        got = r["badam_package"]
        assert got["diff"] == 0.0 and got["masters"] == [["DTensor", "torch.float32", "torch.float32"]], got
        assert got["dcp"]["same_step"] and got["dcp"]["diff"] == 0.0 and got["dcp"]["masters"] == ["torch.float32"]


def test_svd_on_shards_is_refused_with_a_remedy(ranks):
    message = ranks[0]["svd_error"]
    assert message and "'svd'" in message and "FSDP2" in message and "block" in message


SAVE_KEEPS_THE_STEP = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from omegaconf import OmegaConf
import frugal, models
from train_utils import sharded_checkpoint
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = models.build_model(OmegaConf.load("configs/model/llama_tiny.yaml"), vocab_size=512)
mesh = init_device_mesh("cpu", (1,))
for block in model.model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
out = {}
for name in sys.argv[1:]:
    optimizer = frugal.build_optimizer(model, name, lr=1e-3)
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _, optim_sd, _ = sharded_checkpoint._state_dicts(model, optimizer)
    out[name] = [optimizer.param_groups[0]["step"], optim_sd["param_groups"][0]["step"]]
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_sharded_checkpoint_does_not_advance_a_stateless_optimizer(tmp_path):
    """torch's get_optimizer_state_dict steps an optimizer without state or gradients once at lr 0
    (signSGD, SGD): the step counter must stay, or checkpointing more often would change the run."""
    from _train_helpers import subprocess_env

    # A script, not `python -c`: forked from the warm interpreter (tests/_forkserver.py), without a fresh
    # interpreter's imports.
    script = tmp_path / "save_keeps_the_step.py"
    script.write_text(SAVE_KEEPS_THE_STEP)
    proc = run_python([sys.executable, str(script), "signsgd", "sgd", "frugal"], cwd=REPO, env=subprocess_env(),
                      timeout=300)
    assert proc.returncode == 0, failure(proc)
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert steps == {"signsgd": [1, 1], "sgd": [1, 1], "frugal": [1, 1]}, steps
