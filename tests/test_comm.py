"""The state-free part as a one-bit majority vote (frugal.comm): packing, the one-process reference
vote (odd sizes, zeros, ties, padding), and at 2 and 3 ranks (torchrun, gloo) the DDP hook against
DDP's own reduction and the reference: exact tensors, votes, the norm, the role check, replicas."""
import json
import sys

import pytest
import torch

from frugal import comm
from _train_helpers import failure, run_cli


def naive_vote(grads: torch.Tensor, ident: int = 0) -> torch.Tensor:
    """The definition element by element: signs +1 (> 0) / -1 (else), majority, a tie takes the sign
    sent by rank (j + ident) mod W (one parameter, here at position `ident`)."""
    world, n = grads.shape
    out = torch.empty(n)
    for j in range(n):
        signs = [1 if float(grads[r, j]) > 0 else -1 for r in range(world)]
        total = sum(signs)
        out[j] = signs[(j + ident) % world] if total == 0 else (1 if total > 0 else -1)
    return out


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1001])
def test_pack_unpack_round_trip(n):
    g = torch.Generator().manual_seed(n)
    bits = torch.rand(-(-n // 8) * 8, generator=g) > 0.5
    packed = comm.pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bits.numel() // 8
    assert torch.equal(comm.unpack_bits(packed), bits)
    assert torch.equal(comm.unpack_bits(packed, n), bits[:n])
    # the first element is the highest bit of the first byte
    one = torch.zeros(8, dtype=torch.bool)
    one[0] = True
    assert comm.pack_bits(one).tolist() == [128]
    with pytest.raises(ValueError, match="multiple of 8"):
        comm.pack_bits(torch.ones(9, dtype=torch.bool))


@pytest.mark.parametrize("world,n", [(2, 1), (2, 13), (3, 17), (3, 1000), (4, 31), (5, 7), (8, 129), (16, 40)])
def test_vote_matches_the_definition(world, n):
    g = torch.Generator().manual_seed(world * 1000 + n)
    grads = torch.randn(world, n, generator=g)
    grads[:, : n // 4] = 0.0  # zeros on every rank: -1 from each, a vote of -1
    grads[0, n // 4: n // 3] = 0.0  # zeros on one rank
    grads[:, -1] = torch.tensor([(-1.0) ** r for r in range(world)])  # alternating signs: a tie at even W
    votes = comm.majority_vote(grads)
    assert votes.shape == (n,) and set(votes.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(votes, naive_vote(grads))
    assert torch.equal(comm.majority_vote(list(grads)), votes)
    tie = comm.tie_ranks([n], [7], world)
    assert torch.equal(comm.majority_vote(grads, tie), naive_vote(grads, ident=7))
    if n >= 4:
        assert (votes[: n // 4] == -1).all()


def test_ties_go_to_a_rank_named_by_the_element_and_padding_is_ignored():
    # 2 ranks that disagree everywhere, 20 elements (chunks of 16, padded to 32): rank (i + ident) mod 2 wins
    a = torch.ones(20)
    b = -torch.ones(20)
    votes = comm.majority_vote(torch.stack([a, b]))
    assert votes.tolist() == [1.0, -1.0] * 10
    # two parameters laid end to end (3 and 2 elements, at positions 5 and 0): ranks per element
    assert comm.tie_ranks([3, 2], [5, 0], 2).tolist() == [1, 0, 1, 0, 1]
    assert comm.tie_ranks([3, 2], [5, 0], 3, 2, 5).tolist() == [1, 0, 1]
    votes = comm.majority_vote(torch.stack([a[:5], b[:5]]), comm.tie_ranks([3, 2], [5, 0], 2))
    assert votes.tolist() == [-1.0, 1.0, -1.0, 1.0, -1.0]
    assert comm.chunk_layout(20, 2) == (16, 2)
    assert comm.chunk_layout(1, 8) == (8, 1)
    assert comm.chunk_layout(65, 4) == (24, 3)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_the_hooks_chunk_vote_equals_the_reference(world):
    """What each rank computes on its chunk (a byte table, strided tie bits) against majority_vote with
    tie_ranks, for parameters of odd sizes laid end to end, with zeros."""
    numels, idents = [37, 5, 130, 1, 64], [3, 0, 11, 2, 7]
    n = sum(numels)
    e, c = comm.chunk_layout(n, world)
    grads = torch.randn(world, n, generator=torch.Generator().manual_seed(world))
    grads[:, :10] = 0.0
    half = world // 2
    grads[:half, 20:40], grads[half:2 * half, 20:40] = 1.0, -1.0  # ties at even W
    bits = torch.zeros(world, e * world, dtype=torch.bool)
    bits[:, :n] = comm.sign_bits(grads)
    packed = torch.stack([comm.pack_bits(bits[r]) for r in range(world)])  # each rank's packed signs
    votes = [comm.vote_own_chunk(packed[:, r * c:(r + 1) * c].reshape(-1), world, numels, idents, r)
             for r in range(world)]  # what rank r receives in the all-to-all, and its vote
    got = comm.unpack_table(torch.cat(votes), torch.float32)[:n]
    assert torch.equal(got, comm.majority_vote(grads, comm.tie_ranks(numels, idents, world)))
    assert torch.equal(comm.unpack_table(torch.cat(votes), torch.bfloat16)[:n], got.bfloat16())


def test_bytes_of_the_two_phases_stay_under_two_bits_per_element():
    for world in (2, 3, 4, 8, 32):
        for n in (1000, 12345, 10**6):
            e, c = comm.chunk_layout(n, world)
            sent = 2 * (world - 1) * c
            assert sent * 8 <= 2 * n + 2 * (world - 1) * 8 * 8  # 2 bits per element, plus padding
            assert e * world >= n
    assert comm.ring_bytes(1000, 1) == 0 and comm.ring_bytes(1000, 2) == 1000 and comm.ring_bytes(900, 3) == 1200
    assert comm.payload_ratio(1, 3) == pytest.approx((1 + 3 / 32) / 4)


@pytest.mark.filterwarnings("ignore:frugal.FRUGAL found no projectable parameters")
def test_one_process_is_a_no_op():
    model = torch.nn.Linear(4, 4)
    from frugal import FRUGAL

    opt = FRUGAL([{"params": list(model.parameters())}], lr=1e-3)
    assert comm.attach_vote(model, opt) is None  # no process group: nothing to communicate


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"comm{request.param}")
    proc = run_cli([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={request.param}", "tests/_comm_worker.py", str(out)])
    assert proc.returncode == 0, failure(proc)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


@pytest.mark.slow
def test_hook_votes_as_the_reference_and_keeps_exact_tensors(ranks):
    world = ranks[0]["world"]
    for result in ranks:
        steps = result["steps"]
        assert len(steps) == 5
        assert len({tuple(s["voted"]) for s in steps}) >= 2  # a window switch changed the voted tensors
        assert any(s["buckets"] > 1 for s in steps)  # several buckets, mixed ones among them
        for s in steps:
            assert s["vote_equal"], s
            assert s["zeros"] > 0
            if world == 2:
                assert s["ties"] > 0  # at 2 ranks every disagreement is a tie
                assert s["exact_equal"], s  # DDP's reduction, bit for bit (a + b = b + a)
            # bytes: voted elements in under 2 bits each (plus padding), exact ones as a ring all-reduce
            padding = 2 * (world - 1) * 64 * s["buckets"]
            assert s["stats"]["vote_bytes"] * 8 <= 2 * s["stats"]["voted_elements"] + padding
            assert s["stats"]["exact_bytes"] == pytest.approx(s["exact_bytes_if_one_buffer"], abs=8 * s["buckets"])
    assert len({json.dumps(r["steps"]) for r in ranks}) == 1  # every rank saw and counted the same


@pytest.mark.slow
def test_norm_never_reads_the_votes(ranks):
    for result in ranks:
        for s in result["steps"]:
            assert s["norm"] == pytest.approx(s["norm_expected"], rel=1e-6)
            assert s["norm"] >= s["norm_exact_mode"] * (1 - 1e-6)  # B bounds the mean's norm
            assert s["norm_with_votes"] > 10 * s["norm"]  # what reading the +-1 entries would give
        # every rank has the same data: the norm is exact mode's
        assert result["identical_norm"] == pytest.approx(result["identical_norm_exact"], rel=1e-6)
        assert result["nan_norm"] != result["nan_norm"]  # NaN on one rank: NaN on every rank


@pytest.mark.slow
def test_roles_checked_and_replicas_in_sync(ranks):
    for result in ranks:
        assert result["in_sync"]
        assert "roles changed between backward and step" in result["mismatch"]
        assert "did not pass the DDP communication hook" in result["unsynced"]


# ---- train.py: train.state_free_comm ---------------------------------------------------------------
VOTE = ["train.micro_batch_size=2", "optimizer.update_gap=2", "train.grad_clip=1.0"]


@pytest.mark.parametrize("overrides,match", [
    (["train.state_free_comm=votes"], "train.state_free_comm='votes' is invalid; choose one of exact, vote$"),
    (["train.parallelism=fsdp"], "FSDP2"),
    (["train.optimizer_in_backward=true"], "step inside backward"),
    (["optimizer=adamw"], "optimizer.name='adamw' is not built on FRUGAL; valid choices: "),
])
def test_train_refuses_what_the_vote_cannot_run_in_one_line(overrides, match):
    from _train_helpers import TINY, compose_cfg
    from train_utils.validation import ConfigError, validate_config

    vote = [] if overrides[0].startswith("train.state_free_comm") else ["train.state_free_comm=vote"]
    cfg = compose_cfg(*[o for o in TINY if not o.startswith("optimizer.")], *vote, *overrides)
    with pytest.raises(ConfigError, match=match) as err:
        validate_config(cfg, world_size=1)  # refused on one process too (where the vote would be a no-op)
    assert "\n" not in str(err.value)


def test_one_process_vote_is_exact_bit_for_bit(tmp_path):
    """Across a window switch (update_gap 2, 4 steps), with clipping: the same weights, bit for bit,
    and the run says that the vote is a no-op."""
    from _train_helpers import assert_same_weights, rows, run_inprocess, weights

    runs = {}
    for mode in ("exact", "vote"):
        run_dir = tmp_path / mode
        assert run_inprocess(run_dir, *VOTE, "train.steps=4", f"train.state_free_comm={mode}") == 0
        runs[mode] = run_dir
    final = "checkpoints/step_00000004"
    assert_same_weights(weights(runs["exact"] / final), weights(runs["vote"] / final))
    start = rows(runs["vote"])[0]
    assert start["state_free_comm"] == "exact (vote requested: a no-op on one process)"
    assert any(r.get("event") == "switch" for r in rows(runs["vote"]))
    assert "the vote is a no-op" in (runs["vote"] / "train.log").read_text()
    assert not any("comm_bytes_per_rank" in r for r in rows(runs["vote"]))


@pytest.fixture(scope="module")
def vote_run(tmp_path_factory):
    from _train_helpers import torchrun_cmd

    run_dir = tmp_path_factory.mktemp("vote2")
    proc = run_cli(torchrun_cmd(run_dir, *VOTE, "train.steps=4", "train.state_free_comm=vote"))
    assert proc.returncode == 0, failure(proc)
    return run_dir, proc


@pytest.mark.slow
def test_two_processes_vote_trains_labelled_with_its_bytes(vote_run):
    from _train_helpers import rows

    tmp_path, proc = vote_run
    log = rows(tmp_path)
    start, end = log[0], log[-1]
    assert start["state_free_comm"] == "vote" and end["state_free_comm"] == "vote" and end["ranks_in_sync"] is True
    assert "one-bit majority vote" in proc.stdout + proc.stderr  # the first lines and the summary say so
    steps = [r for r in log if "loss" in r]
    assert len(steps) == 4 and all(r["state_free_comm"] == "vote" for r in steps)
    assert any(r.get("event") == "switch" for r in log)
    params = start["params"]
    exact_bytes = comm.ring_bytes(4 * params, 2)  # fp32 gradients, every one all-reduced
    for r in steps:
        assert r["comm_voted_elements"] + r["comm_exact_elements"] == params
        full_share, free_share = r["comm_exact_elements"] / params, r["comm_voted_elements"] / params
        assert r["comm_bytes_per_rank"] <= (full_share + free_share / 16) * exact_bytes
        assert r["comm_exact_bytes_per_rank"] == comm.ring_bytes(4 * r["comm_exact_elements"], 2) or \
            abs(r["comm_exact_bytes_per_rank"] - comm.ring_bytes(4 * r["comm_exact_elements"], 2)) < 64
        assert 0 < r["grad_norm"] < 100  # the votes (+-1 on ~600k entries) would read ~776


@pytest.mark.slow
def test_bench_script_simulator_and_compute_tables():
    """bench/comm.py's one-process parts (its byte and time tables need root and a network
    namespace: docs/communication.md has their commands and figures)."""
    proc = run_cli([sys.executable, "-m", "bench.comm", "agreement", "--elements", "4000", "--noise", "0.5",
                    "--sim_worlds", "3", "8"])
    assert proc.returncode == 0, failure(proc)
    table = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| 3 ", "| 8 "))]
    assert len(table) == 2 and all(0.8 < float(row[3]) <= 1.0 for row in table)
    proc = run_cli([sys.executable, "-m", "bench.comm", "compute", "--compute_elements", "1001", "--worlds", "3"])
    assert proc.returncode == 0, failure(proc)
    assert "| 1,001 | 3 |" in proc.stdout


@pytest.mark.slow
def test_two_processes_vote_resume_is_exact(vote_run, tmp_path):
    """2 steps, then continued to 4 (a window switch in each half): the losses and weights of the
    uninterrupted 4-step run, bit for bit (the hook keeps no state)."""
    from _train_helpers import assert_same_weights, losses, torchrun_cmd, weights
    from train_utils import checkpoint as ckpt

    full = vote_run[0]
    for steps, extra in ((2, []), (4, ["train.resume_changes=[train.steps]"])):
        proc = run_cli(torchrun_cmd(tmp_path, *VOTE, f"train.steps={steps}", "train.state_free_comm=vote", *extra))
        assert proc.returncode == 0, failure(proc)
    assert losses(tmp_path) == losses(full)
    assert_same_weights(weights(ckpt.latest(str(tmp_path / "checkpoints"))),
                        weights(ckpt.latest(str(full / "checkpoints"))))


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """The last rank's voted tensor gets a NaN gradient in step 3's second micro-batch (its sign would vote -1 like any
    negative number): the norm's all-reduced bound carries it to every rank, and each one stops at step
    3 before applying it, with steps 1 and 2 checkpointed and finite."""
    import re

    from _forkserver import run_python
    from _train_helpers import REPO, TINY, rows, subprocess_env
    from train_utils import checkpoint as ckpt

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/_nan_one_rank.py", *TINY, *VOTE, "train.steps=5", "train.state_free_comm=vote",
           "checkpoint.every=1", f"hydra.run.dir={tmp_path}"]
    proc = run_python(cmd, cwd=REPO, env=dict(subprocess_env(), NAN_BACKWARD="6"), timeout=240)
    assert proc.returncode == 1, failure(proc)
    stopped = re.findall(r"rank\s+: (\d) .*?\n.*?\n.*?\n.*?traceback : error: non-finite training loss or "
                         r"gradient norm \(loss [0-9.]+, gradient norm nan\) at step (\d+)", proc.stderr)
    assert sorted(stopped) == [("0", "3"), ("1", "3")], failure(proc)
    assert max(r["step"] for r in rows(tmp_path) if "loss" in r) == 2
    written = ckpt.list_checkpoints(str(tmp_path / ckpt.CHECKPOINT_DIR))
    assert [c.rsplit("/", 1)[-1] for c in written] == [ckpt.step_dir_name(1), ckpt.step_dir_name(2)]
    assert all(t.isfinite().all() for c in written for t in ckpt.load(c, "model").values())


def test_the_link_model_recovers_a_known_link_and_counts_node_bytes():
    """bench.comm's projection: the fit returns the k and intercepts that generated the cases; the byte
    model gives the ring's 2 (W-1)/W for exact, and for the vote the exact part plus its two phases."""
    from bench.comm import fit_link, node_bytes

    cases = [dict(rate=rate, world=w, mode=m, steps=2, loopback_bytes=2 * b,
                  step_time_median_s=c + 1.25 * b / (mbit * 1e6 / 8))
             for (w, m, c, b) in ((2, "exact", 0.3, 4e7), (2, "vote", 0.2, 1e7), (3, "exact", 0.4, 6e7))
             for rate, mbit in (("100mbit", 100), ("1gbit", 1000))]
    k, c, worst = fit_link(cases + [dict(cases[0], rate="unshaped", step_time_median_s=9.0)])
    assert k == pytest.approx(1.25) and worst < 1e-9
    assert c == pytest.approx({(2, "exact"): 0.3, (2, "vote"): 0.2, (3, "exact"): 0.4})
    assert node_bytes(1000, 600, 2, 8, "exact") == pytest.approx(2 * 15 / 16 * 4000)
    assert node_bytes(1000, 600, 2, 8, "vote") == pytest.approx(2 * 15 / 16 * 1600 + 8 / 16 * 600 + 15 / 16 * 75)
    with pytest.raises(ValueError, match="two shaped rates"):
        fit_link([cases[0], dict(cases[0], step_time_median_s=0.5)])  # one rate twice: no slope to fit


@pytest.mark.slow
def test_tables_mark_a_vote_run_and_compute_no_difference_for_it(vote_run):
    from scripts import make_tables

    run = make_tables.load_run(vote_run[0])
    records = make_tables.build([run])
    assert records and all(r["state_free_comm"] == "vote" and r["diff"] is None for r in records)
    text = make_tables._ours_text(records[0], records[0]["column"], show_paper=True)
    assert text.endswith(" [vote]")
    assert "one-bit majority vote" in make_tables._table_notes(records, show_paper=True)
