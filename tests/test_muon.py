"""FRUGAL with Muon as the state-full rule (frugal/muon.py) against torch.optim.Muon + torch.optim.AdamW."""
from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

import frugal
from frugal import muon, registry
from frugal.hparams import HyperparameterError
from frugal.memory import estimate_state_bytes, state_bytes
from _forkserver import run_python
from _train_helpers import failure


def tiny_llama(dtype=torch.float32, layers=4):
    import models
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "configs", "model", "llama_tiny.yaml"))
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = 64, 16, 40, 2
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    return models.build_model(cfg).to(dtype)


def grads_for(params, t):
    g = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) for p in params]


def run(model, opts, steps, start=0):
    params = [p for p in model.parameters() if p.requires_grad]
    for t in range(start, start + steps):
        for p, g in zip(params, grads_for(params, t)):
            p.grad = g
        for opt in opts:
            opt.step()


def block_weights(model):
    groups = frugal.param_groups(model)
    return [p for g in groups if g.get("projectable") for p in g["params"]]


HP = dict(lr=3e-3, weight_decay=0.1, momentum=0.9, eps=1e-7)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("foreach", [True, False])
def test_density_one_is_torch_muon_plus_adamw(nesterov, adjust_lr_fn, foreach):
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ours = registry.build_optimizer(model, "frugal_muon", density=1.0, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
                                    ns_steps=4, foreach=foreach, update_gap=2, **HP)
    blocks = block_weights(ref)
    ids = {id(p) for p in blocks}
    rest = [p for p in ref.parameters() if id(p) not in ids]
    assert blocks and rest
    t_muon = torch.optim.Muon(blocks, lr=HP["lr"], weight_decay=HP["weight_decay"], momentum=HP["momentum"],
                              nesterov=nesterov, eps=HP["eps"], ns_steps=4, adjust_lr_fn=adjust_lr_fn)
    t_adamw = torch.optim.AdamW(rest, lr=HP["lr"], weight_decay=HP["weight_decay"], eps=HP["eps"])
    run(model, [ours], 6)  # update_gap 2: three windows, blocks stay state-full and keep their buffer
    run(ref, [t_muon, t_adamw], 6)
    moved = 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), tiny_llama().parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-2  # the steps did something
    for p in blocks:
        assert set(t_muon.state[p]) == {"momentum_buffer"}


def test_momentum_defaults_to_torchs_for_muon_and_the_papers_for_sgdm():
    # No momentum given: FRUGAL's muon rule takes torch.optim.Muon's own default (0.95), sgdm the paper's 0.9.
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
    ref = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plain tensors, no blocks found: every tensor state-full (muon)
        ours = frugal.FRUGAL(weights, lr=1e-2, weight_decay=0.1, state_full="muon", density=1.0,
                             adjust_lr_fn="original")
    theirs = torch.optim.Muon(ref, lr=1e-2, weight_decay=0.1, adjust_lr_fn="original")
    assert ours.param_groups[0]["momentum"] == theirs.param_groups[0]["momentum"] == 0.95
    for step in range(4):
        for ps, opt in ((weights, ours), (ref, theirs)):
            for i, p in enumerate(ps):
                p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (step + i + 1))
            opt.step()
    for p, q in zip(weights, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one plain tensor: no blocks found (the library's advice)
        sgdm = frugal.FRUGAL([torch.nn.Parameter(torch.zeros(3))], state_full="sgdm")
        given = frugal.FRUGAL([torch.nn.Parameter(torch.zeros(3))], momentum=0.5)
    assert sgdm.param_groups[0]["momentum"] == 0.9 and given.param_groups[0]["momentum"] == 0.5


def test_muon_entry_is_muon_on_every_block_weight():
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ours = registry.build_optimizer(model, "muon", **HP)
    blocks = block_weights(ref)
    ids = {id(p) for p in blocks}
    t_muon = torch.optim.Muon(blocks, lr=HP["lr"], weight_decay=HP["weight_decay"], momentum=HP["momentum"],
                              eps=HP["eps"], adjust_lr_fn="match_rms_adamw")
    t_adamw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in ids], lr=HP["lr"],
                                weight_decay=HP["weight_decay"], eps=HP["eps"])
    run(model, [ours], 3)
    run(ref, [t_muon, t_adamw], 3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert registry.defaults("muon")["momentum"] == 0.95 and registry.defaults("muon")["nesterov"] is True
    assert registry.defaults("frugal_muon")["density"] == 0.25
    assert registry.defaults("frugal_muon")["adjust_lr_fn"] == "match_rms_adamw"
    with pytest.raises(HyperparameterError, match="does not take"):
        registry.build_optimizer(model, "muon", density=0.5)


def test_newton_schulz_is_torchs():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(0)
    for shape in [(7, 12), (12, 7), (5, 5)]:
        u = torch.randn(shape, generator=g)
        assert torch.equal(muon.newton_schulz(u, muon.NS_COEFFICIENTS, 5, 1e-7),
                           _zeropower_via_newtonschulz(u, muon.NS_COEFFICIENTS, 5, 1e-7))
    # an independent check of what it computes: singular values pushed into ~(0.5, 1.5), vectors kept
    u = torch.randn(16, 24, generator=g, dtype=torch.float64)
    o = muon.newton_schulz(u).double()
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.4 and s.max() < 1.4
    U, _, Vh = torch.linalg.svd(u, full_matrices=False)
    assert torch.linalg.matrix_norm(o - U @ Vh) / math.sqrt(16) < 0.35


def test_lr_ratio():
    assert muon.lr_ratio((64, 16), "original") == 2.0 and muon.lr_ratio((16, 64), "original") == 1.0
    assert muon.lr_ratio((16, 64), "original", transposed=True) == 2.0
    assert muon.lr_ratio((16, 64), "match_rms_adamw") == pytest.approx(0.2 * 8)


def test_one_buffer_per_state_full_element_and_the_estimate():
    model = tiny_llama()
    opt = registry.build_optimizer(model, "frugal_muon", density=0.25, update_gap=2)
    run(model, [opt], 1)
    blocks = block_weights(model)
    muon_state = [opt.state[p] for p in blocks if p in opt.state]
    assert muon_state and all(set(s) == {"momentum_buffer"} for s in muon_state)
    muon_elems = sum(s["momentum_buffer"].numel() for s in muon_state)
    assert muon_elems == sum(p.numel() for p in blocks) // 4  # one block of four, equal blocks
    ids = {id(p) for p in blocks}
    rest = [p for p in model.parameters() if id(p) not in ids]
    adamw_bytes = sum(2 * p.numel() * 4 + 4 for p in rest)  # two moments + a step counter
    assert state_bytes(opt) == adamw_bytes + 4 * muon_elems
    assert estimate_state_bytes(model, "frugal_muon", density=0.25) == state_bytes(opt)
    model2 = tiny_llama()
    full = registry.build_optimizer(model2, "muon")
    run(model2, [full], 1)
    assert state_bytes(full) == adamw_bytes + 4 * sum(p.numel() for p in blocks)
    assert estimate_state_bytes(model2, "muon") == state_bytes(full)
    # FRUGAL-Muon at rho 0.25 holds half of FRUGAL-AdamW's block state: one buffer instead of two
    # moments (and no step counters: 4 bytes for each of the block's 7 tensors)
    assert (estimate_state_bytes(model, "frugal", density=0.25) - adamw_bytes
            == 2 * 4 * muon_elems + 4 * len(muon_state))


@pytest.mark.parametrize("projection", ["column", "row"])
def test_column_and_row_orthogonalise_the_reduced_matrix(projection):
    """A split weight: Muon on the selected columns (rows) as a matrix, signSGD on the rest; checked
    against a float64 re-implementation written here (torch's NS for the reduced matrix)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 20))
    w0 = w.detach().clone()
    opt = frugal.FRUGAL([{"params": [w], "projectable": True}], lr=0.01, projection=projection, density=0.25,
                        state_full="muon", momentum=0.9, update_gap=100, weight_decay=0.1)
    idx = None
    buf = None
    expect = w0.clone()
    for t in range(3):
        g = torch.randn(12, 20)
        w.grad = g.clone()
        opt.step()
        idx = opt.state[w]["index"]
        dim = 1 if projection == "column" else 0
        gr = g.index_select(dim, idx)
        buf = torch.zeros_like(gr) if buf is None else buf
        buf = buf.lerp(gr, 0.1)
        o = _zeropower_via_newtonschulz(gr.lerp(buf, 0.9), muon.NS_COEFFICIENTS, 5, 1e-8).float()
        ratio = 0.2 * math.sqrt(max(o.shape))
        new = expect * (1 - 0.01 * 0.1) - 0.01 * torch.sign(g)
        new.index_copy_(dim, idx, expect.index_select(dim, idx) * (1 - 0.01 * 0.1) - 0.01 * ratio * o)
        expect = new
        torch.testing.assert_close(w.detach(), expect, rtol=1e-5, atol=1e-6)
    assert opt.state[w]["momentum_buffer"].shape == (12, 5) if projection == "column" else (3, 20)


@pytest.mark.parametrize("projection", ["randk", "svd", "random", "randperm"])
def test_projections_without_a_reduced_matrix_are_refused(projection):
    model = tiny_llama()
    with pytest.raises(HyperparameterError, match="valid projections with state_full 'muon': block, column, row"):
        registry.build_optimizer(model, "frugal_muon", projection=projection)


def test_bad_muon_settings_are_refused():
    model = tiny_llama()
    for bad, match in [({"adjust_lr_fn": "rms"}, "adjust_lr_fn.*valid choices: original, match_rms_adamw"),
                       ({"nesterov": 1}, "nesterov"), ({"ns_steps": 0}, "ns_steps"), ({"ns_steps": 100}, "ns_steps"),
                       ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients")]:
        with pytest.raises(HyperparameterError, match=match):
            registry.build_optimizer(model, "frugal_muon", **bad)
    # Muon on the non-projectable tensors (1-D norms) is refused with the way out
    with pytest.raises(HyperparameterError, match="state_full='adamw'"):
        frugal.FRUGAL(frugal.param_groups(model), state_full="muon")


def test_state_dict_round_trip_continues_exactly():
    model = tiny_llama()
    opt = registry.build_optimizer(model, "frugal_muon", update_gap=2)
    run(model, [opt], 3)
    twin = copy.deepcopy(model)
    opt2 = registry.build_optimizer(twin, "frugal_muon", update_gap=2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(model, [opt], 3, start=3)
    run(twin, [opt2], 3, start=3)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_trains_from_a_real_loss():
    model = tiny_llama()
    opt = registry.build_optimizer(model, "frugal_muon", lr=1e-2, update_gap=5)
    torch.manual_seed(1)
    x = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(15):
        loss = model(input_ids=x, labels=x).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.5


# ---- FRUGAL(model, state_full="muon"): AdamW on the non-projectable tensors, as the registry entry ----
def rest_names(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in opt.param_groups if not g["projectable"] for p in g["params"]}


def test_model_call_is_the_frugal_muon_entry_step_for_step():
    a, b = tiny_llama(), tiny_llama()
    ours = frugal.FRUGAL(a, lr=3e-3, weight_decay=0.1, update_gap=2, state_full="muon")
    entry = registry.build_optimizer(b, "frugal_muon", lr=3e-3, weight_decay=0.1, update_gap=2)
    # one place decides: the same groups, the rest on AdamW, the blocks on Muon
    assert [(len(g["params"]), g["projectable"], g["state_full"]) for g in ours.param_groups] == \
        [(len(g["params"]), g["projectable"], g["state_full"]) for g in entry.param_groups]
    assert {g["state_full"] for g in ours.param_groups if not g["projectable"]} == {"adamw"}
    assert {g["state_full"] for g in ours.param_groups if g["projectable"]} == {"muon"}
    assert ours.param_groups[1]["momentum"] == entry.param_groups[1]["momentum"] == 0.95  # torch's Muon default
    for start in (0, 3):  # update gap 2: the state-full block moves twice
        run(a, [ours], 3, start=start)
        run(b, [entry], 3, start=start)
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), name
    for p, q in zip(a.parameters(), b.parameters()):
        assert ours.state[p].keys() == entry.state[q].keys()
        for k in ours.state[p]:
            assert torch.equal(ours.state[p][k], entry.state[q][k])


def test_model_call_state_is_adamw_on_the_rest_and_muon_on_the_blocks_and_round_trips():
    model = tiny_llama()
    opt = frugal.FRUGAL(model, lr=3e-3, update_gap=2, state_full="muon")
    run(model, [opt], 3)
    rest = rest_names(model, opt)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.input_layernorm.weight"} <= rest
    active = set(opt.active_blocks())
    for name, p in model.named_parameters():
        if p.dim() != 2 or name in rest:
            assert name in rest and set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, name
        elif int(name.split(".")[2]) in active:
            assert set(opt.state[p]) == {"momentum_buffer"}, name
        else:
            assert p not in opt.state, name  # a state-free block owns no state
    twin = copy.deepcopy(model)
    opt2 = frugal.FRUGAL(twin, lr=3e-3, update_gap=2, state_full="muon")
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(model, [opt], 3, start=3)
    run(twin, [opt2], 3, start=3)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_model_call_trains_from_a_real_loss():
    model = tiny_llama()
    opt = frugal.FRUGAL(model, lr=1e-2, update_gap=5, state_full="muon")
    torch.manual_seed(1)
    x = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(20):
        loss = model(input_ids=x, labels=x).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.5, losses


def test_describe_names_the_adamw_tensors_and_why():
    model = tiny_llama()
    for desc in (frugal.describe(model, state_full="muon"),
                 frugal.describe(frugal.FRUGAL(model, state_full="muon"), model=model),
                 frugal.describe(registry.build_optimizer(model, "frugal_muon"), model=model)):
        roles = {row[0]: row[3] for row in desc.rows}
        rest = {n for n, role in roles.items() if role == "state-full, adamw"}
        assert rest == {n for n, p in model.named_parameters() if not n.startswith("model.layers.") or p.dim() != 2}
        line = next(s for s in desc.summary if s.startswith("adamw instead of muon"))
        assert "11 state-full tensors (9 not matrices, 2 matrices" in line
        for name in ("model.embed_tokens.weight", "model.layers.*.input_layernorm.weight (x4)", "model.norm.weight",
                     "lm_head.weight", "norms and biases are not matrices"):
            assert name in line, line
        assert "(muon and adamw moments" in desc.summary[-1]
    assert not any("instead of" in s for s in frugal.describe(model).summary)  # AdamW: nothing to say


def test_explicit_groups_stay_as_given_and_the_error_names_the_model_call():
    model = tiny_llama()
    for params in (frugal.param_groups(model), model.named_parameters()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # named parameters: the guessed split
            with pytest.raises(HyperparameterError, match=r"FRUGAL\(model, state_full='muon'\).*'frugal_muon'"):
                frugal.FRUGAL(params, state_full="muon")
    groups = frugal.param_groups(model, state_full="muon")  # what FRUGAL(model, state_full="muon") uses
    assert [g.get("state_full") for g in groups] == ["adamw"] + [None] * 4
    assert frugal.FRUGAL(groups, state_full="muon").param_groups[0]["state_full"] == "adamw"


# ---- FSDP2: 2 processes on gloo (tests/_fsdp_muon_worker.py) --------------------------------------
@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory):
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("fsdp_muon")
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(repo, "tests", "_fsdp_muon_worker.py"), str(out), str(out / "ckpt")]
    proc = run_python(cmd, cwd=repo, env=env, timeout=300)  # forked ranks (tests/_forkserver.py)
    assert proc.returncode == 0, failure(proc)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.mark.slow  # torchrun (fsdp_ranks): the full suite's
@pytest.mark.parametrize("case", ["block_0", "block_0.25", "block_0.5", "block_1", "reference_path"])
def test_fsdp2_muon_matches_one_process(fsdp_ranks, case):
    for r in fsdp_ranks:
        assert r[case]["diff"] < 1e-6, r[case]
        assert r[case]["moved"] > 1e-2  # the runs trained
        assert r[case]["dtensor_state"]
        # each rank holds its shard of the buffers and moments (about half; step counters replicated)
        assert r[case]["bytes"] <= 0.55 * r[case]["bytes_unsharded"]


@pytest.mark.slow  # torchrun (fsdp_ranks): the full suite's
@pytest.mark.parametrize("density", [0.0, 0.25, 0.5, 1.0])
def test_fsdp2_gathers_only_the_active_blocks(fsdp_ranks, density):
    """Bytes all-gathered inside step(), seen by a dispatch mode that counts every collective: the
    bf16 matrices of the rho share of blocks, against all of them for Muon on every matrix."""
    for r in fsdp_ranks:
        case = r[f"block_{density:g}"]
        assert case["gathered_per_step"] == density * case["all_matrices_bf16"], case
        assert case["own_count_per_step"] == case["gathered_per_step"]
        if density == 0.0:
            assert case["collectives"] == {}  # inactive blocks: local sign updates only


@pytest.mark.slow  # torchrun (fsdp_ranks): the full suite's
def test_fsdp2_gathers_on_llama_are_what_the_planner_says(fsdp_ranks):
    from omegaconf import OmegaConf

    from train_utils.memory_plan import optimizer_gather_bytes

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "configs", "model", "llama_tiny.yaml"))
    planned = {"muon_1": optimizer_gather_bytes(cfg, {"name": "muon"}, vocab_size=512),
               "frugal_muon_0.25": optimizer_gather_bytes(cfg, {"name": "frugal_muon", "density": 0.25},
                                                          vocab_size=512)}
    for r in fsdp_ranks:
        assert r["llama_tiny"] == planned and planned["frugal_muon_0.25"] * 4 == planned["muon_1"] > 0


@pytest.mark.slow  # torchrun (fsdp_ranks): the full suite's
def test_fsdp2_model_call_is_the_frugal_muon_entry(fsdp_ranks):
    """FRUGAL(model, state_full="muon") on a sharded llama_tiny: the entry's steps, gathers and AdamW rest."""
    for r in fsdp_ranks:
        case = r["llama_model_call"]
        assert case["diff"] == 0.0 and case["gathered"][0] == case["gathered"][1] > 0, case
        assert case["rest_adamw"] == [True, True], case


@pytest.mark.slow  # torchrun (fsdp_ranks): the full suite's
def test_fsdp2_muon_state_checkpoints_with_dcp_and_column_is_refused(fsdp_ranks):
    for r in fsdp_ranks:
        assert r["dcp"]["diff"] == 0.0
        assert "valid projection for sharded parameters with state_full 'muon': block" in r["column_error"]


def test_planner_knows_the_rule():
    """train_utils.memory_plan: the state (one buffer per Muon element), the bf16 bytes gathered per
    step under FSDP2 (the active blocks' matrices: rho of Muon-on-every-matrix's) and the unsharded
    orthogonalisation temporaries in the optimizer step."""
    from omegaconf import OmegaConf

    from train_utils.memory_plan import _facts, optimizer_gather_bytes, plan_memory

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "configs", "model", "llama_tiny.yaml"))
    model = tiny_llama()  # only for the shapes of one block's matrices (hidden 16 here, 128 in cfg)
    del model
    every = optimizer_gather_bytes(cfg, {"name": "muon"}, vocab_size=512)
    quarter = optimizer_gather_bytes(cfg, {"name": "frugal_muon", "density": 0.25}, vocab_size=512)
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_block = 2 * (4 * h * h + 3 * h * i)  # bf16 q, k, v, o, gate, up, down
    assert every == cfg.num_hidden_layers * per_block and quarter == per_block
    assert optimizer_gather_bytes(cfg, {"name": "frugal_muon", "density": 0.0}, vocab_size=512) == 0
    assert optimizer_gather_bytes(cfg, {"name": "frugal", "density": 0.25}, vocab_size=512) == 0
    facts = _facts(cfg, {"name": "frugal_muon", "density": 0.25}, "bf16-mixed", 512)
    unsharded, fsdp = facts.matrix_transient
    m, n = i, h  # the largest matrix (gate/up/down: 352 x 128)
    assert unsharded == 4 * m * n + 6 * m * n + 4 * n * n and fsdp == 2 * m * n + 6 * m * n + 4 * n * n
    steps = [plan_memory(cfg, {"name": "frugal_muon", "density": 0.25}, micro_batch_size=1, seq_len=16,
                         world_size=4, parallelism=par, vocab_size=512).phases["optimizer step"]
             for par in ("ddp", "fsdp")]
    frugal_steps = [plan_memory(cfg, {"name": "frugal", "density": 0.25}, micro_batch_size=1, seq_len=16,
                                world_size=4, parallelism=par, vocab_size=512).phases["optimizer step"]
                    for par in ("ddp", "fsdp")]
    assert steps[0] < frugal_steps[0]  # half the block state (one buffer instead of two moments)
    assert estimate_state_bytes(tiny_llama(), "frugal_muon") < estimate_state_bytes(tiny_llama(), "frugal")


def test_gpt2_conv1d_weights_use_their_logical_shape():
    """A GPT-2 Conv1D weight is stored (in, out): Muon's "original" scale reads it as (out, in), as for
    the nn.Linear it stands for; at density 1 it is torch's Muon on the transposed weight."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    ours = registry.build_optimizer(model, "frugal_muon", density=1.0, adjust_lr_fn="original", lr=1e-2)
    mlp = model.transformer.h[0].mlp.c_fc.weight  # stored (16, 64): logical (64, 16), scale sqrt(64/16) = 2
    w0 = mlp.detach().clone()
    model.zero_grad()
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    g = mlp.grad.detach().clone()
    ours.step()
    ref = torch.nn.Parameter(w0.t().clone())
    ref.grad = g.t().clone()
    torch.optim.Muon([ref], lr=1e-2, weight_decay=0.0, momentum=0.95, eps=1e-8, adjust_lr_fn="original").step()
    torch.testing.assert_close(mlp.detach(), ref.detach().t(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_make_tables_places_muon_runs_with_the_memory_column(tmp_path, capsys):
    """scripts/make_tables.py: a run of the muon_table2like preset lands in its own table, labelled
    Muon / FRUGAL-Muon, and every row's cells show the state estimate (configs/optimizer options)."""
    from tests.test_tables import fake_run

    from scripts import make_tables
    from scripts.paper_tables import GIB

    fake_run(tmp_path, "a", "muon_table2like", "llama_60m",
             {"name": "frugal_muon", "density": 0.25, "state_full": "muon"}, {200000: 23.0}, int(0.268 * GIB))
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Beyond the paper: Muon as FRUGAL's state-full rule" in out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "23.00" in rows["FRUGAL-Muon, rho=0.25"]
    for label, gib in [("Muon", "0.34"), ("FRUGAL-Muon, rho=0.0", "0.24"), ("AdamW", "0.43"),
                       ("FRUGAL, rho=0.25", "0.29")]:
        assert gib in rows[label], (label, rows[label])
