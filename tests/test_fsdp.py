"""FRUGAL on FSDP2 shards (DESIGN invariant 10), 2 processes with gloo on CPU (tests/_fsdp_worker.py).

Block projection on DTensor shards trains exactly as the unsharded model (the subspace is the same
pure function on every rank), holds half the state per rank as DTensors, and round-trips through
torch.distributed.checkpoint. Column selection on row-sharded weights picks the unsharded columns,
so it matches too; row selection draws within each shard. svd is refused with a clear message."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "tests", "_fsdp_worker.py"), str(out), str(out / "ckpt")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.mark.parametrize("projection", ["block", "column"])
def test_sharded_matches_unsharded(ranks, projection):
    for r in ranks:
        assert r[projection]["diff"] < 1e-5, r[projection]


@pytest.mark.parametrize("projection", ["block", "column", "row"])
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


def test_svd_on_shards_is_refused_with_a_remedy(ranks):
    message = ranks[0]["svd_error"]
    assert message and "'svd'" in message and "FSDP2" in message and "block" in message
