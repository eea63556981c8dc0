"""Fira, LDAdam and AdaMeM end to end: `build_optimizer(model, "fira" | "ldadam" | "adamem")` against
independent references, over several projection changes.

References: the float64 implementations written from each paper (tests/reference/: fira64, ldadam64,
adamem64; numpy only, nothing shared with frugal/) and, for Fira, the authors' `fira` package.

The registry's Fira is the package's step (eps on the uncorrected root, weight decay after the
update, the limiter on the uncorrected ratio, alpha also on the residual: tests/test_fira.py
follows the package on a LLaMA at the preset's settings). One difference remains: LAPACK's
singular-vector signs vs our fixed signs, which matters when moments kept across a projection change
are read in the new basis. It vanishes when betas = (0, 0) (the moments hold only the current
gradient): there the whole optimizer must reproduce the package to float32 rounding, through every
projection change. With the paper's betas, the float64 reference (the package's step) is the check.
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from torch import nn

import frugal
from frugal import FRUGAL, HyperparameterError
from frugal import projections as P
from reference import adamem64, fira64, ldadam64
from reference.problems import NoisyLeastSquares

SHAPES = [(12, 20), (20, 12)]  # both sides of GaLore's rule; min dimension 12: density 0.25 is rank 3
RANK = 3
STEPS = 15


class Block(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.proj = nn.Linear(shape[1], shape[0], bias=False)


class Toy(nn.Module):
    """Two 'transformer blocks' of one matrix each (param_groups splits them) and a norm that
    stays AdamW (it gets no gradient here, so only the split matrices move)."""

    def __init__(self, problems, dtype=torch.float64):
        super().__init__()
        self.layers = nn.ModuleList(Block(pb.w0.shape) for pb in problems)
        self.norm = nn.Parameter(torch.ones(4))
        self.to(dtype)
        with torch.no_grad():
            for layer, pb in zip(self.layers, problems):
                layer.proj.weight.copy_(torch.tensor(pb.w0, dtype=dtype))

    def matrices(self):
        return [layer.proj.weight for layer in self.layers]


def train(name, steps=STEPS, dtype=torch.float64, seed=1, **hp):
    """(trajectories per matrix, optimizer, model) for `build_optimizer(Toy, name, **hp)` on the
    seeded least-squares problems, gradients from the problems (numpy)."""
    problems = [NoisyLeastSquares(shape, seed=seed + i) for i, shape in enumerate(SHAPES)]
    model = Toy(problems, dtype)
    opt = frugal.build_optimizer(model, name, **hp)
    out = [[] for _ in problems]
    for t in range(steps):
        for w, pb, traj in zip(model.matrices(), problems, out):
            w.grad = torch.tensor(pb.grad(w.detach().double().numpy(), t), dtype=dtype)
        opt.step()
        for w, traj in zip(model.matrices(), out):
            traj.append(w.detach().double().numpy().copy())
    return out, opt, model, problems


def max_gap(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def moved(traj, w0) -> float:
    return float(np.abs(traj[-1] - w0).max())


# ---- Fira -------------------------------------------------------------------------------------
@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("reset_state", ["keep", "reset"])
def test_fira_matches_float64_reference(reset_state, foreach):
    """Fira's registry entry (SVD + the package's AdamW, norm-based scaling, limiter, scale 0.25)
    over three projection changes, in its own 'keep' mode and FRUGAL's 'reset'; fast and reference
    paths; against the package's step written in float64. Both sides fix the singular vectors'
    signs (``svd_signs="canonical"``; the entry's ``raw`` takes whatever float32 LAPACK chooses, which
    float64 need not match: the package comparison in test_fira.py covers that)."""
    hp = dict(lr=1e-2, update_gap=5, weight_decay=0.1)
    got, opt, model, problems = train("fira", reset_state=reset_state, foreach=foreach, svd_signs="canonical", **hp)
    for traj, pb in zip(got, problems):
        ref = fira64.run(pb.w0, pb.grad, STEPS, rank=RANK, scale=0.25, gamma=1.01, eps=1e-6, package=True,
                         keep_state=reset_state == "keep", **{**hp, "update_gap": 5})
        assert moved(ref, pb.w0) > 0.05
        assert max_gap(ref, traj) < 1e-12
    state = opt.state[model.matrices()[0]]
    assert state["fira_norm"].dim() == 0 and float(state["fira_norm"]) > 0


def test_fira_with_column_projection_matches_float64_reference():
    """The issue's 'also with column projection': FRUGAL's seeded columns as the state-full part,
    Fira's scaling per row over them, new columns (and fresh state) every window."""
    hp = dict(lr=1e-2, update_gap=5, weight_decay=0.1)
    got, opt, model, problems = train("fira", projection="column", reset_state="reset",
                                      projectable_lr_scale=1.0, seed=4, **hp)
    groups = [g for g in opt.param_groups if g["projectable"]]
    idents = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for traj, pb, w in zip(got, problems, model.matrices()):
        n = pb.w0.shape[1]
        k = P.coordinate_count("column", pb.w0.shape, False, 0.25)

        def columns(window, w=w, n=n):
            return P.coordinate_indices("column", (pb.w0.shape[0], n), False, 0.25, groups[0]["seed"], window,
                                        idents[id(w)]).tolist()

        ref = fira64.run(pb.w0, pb.grad, STEPS, rank=k, keep_state=False, columns_fn=columns, gamma=1.01,
                         eps=1e-6, package=True, **hp)
        assert max_gap(ref, traj) < 1e-12
        assert len({tuple(columns(i)) for i in range(3)}) > 1


def fira_package():
    if os.environ.get("CI"):
        import fira

        return fira
    return pytest.importorskip("fira", reason="test dependency: pip install fira==1.0.2")


@pytest.mark.parametrize("gap", [4, 7])
def test_fira_matches_the_fira_package_where_the_conventions_coincide(gap):
    """betas (0, 0), no weight decay, alpha 1 (module docstring): the registry's Fira and the
    authors' FiraAdamW take the same steps, limiter included, through every projection change."""
    package = fira_package()
    problems = [NoisyLeastSquares(shape, seed=3 + i) for i, shape in enumerate(SHAPES)]
    ours = Toy(problems, torch.float32)
    theirs = Toy(problems, torch.float32)
    opt = frugal.build_optimizer(ours, "fira", lr=1e-2, betas=(0.0, 0.0), eps=1e-8, update_gap=gap,
                                 projectable_lr_scale=1.0)
    ref = package.FiraAdamW([{"params": theirs.matrices(), "rank": RANK, "update_proj_gap": gap, "alpha": 1.0,
                              "proj_type": "std"}], lr=1e-2, betas=(0.0, 0.0), eps=1e-8, weight_decay=0.0,
                            no_deprecation_warning=True)
    for t in range(17):
        for a, b, pb in zip(ours.matrices(), theirs.matrices(), problems):
            g = torch.tensor(pb.grad(a.detach().double().numpy(), t), dtype=torch.float32)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours.matrices(), theirs.matrices()):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    start = torch.tensor(problems[0].w0, dtype=torch.float32)
    assert (ours.matrices()[0].detach() - start).abs().max() > 0.05


def test_fira_limiter_fires_in_the_package_comparison():
    """The comparison above is not vacuous: on that problem the norm-growth limiter changes the
    step (without it the trajectory leaves the package's)."""
    package = fira_package()
    problems = [NoisyLeastSquares(shape, seed=3 + i) for i, shape in enumerate(SHAPES)]
    ours, theirs = Toy(problems, torch.float32), Toy(problems, torch.float32)
    opt = frugal.build_optimizer(ours, "fira", lr=1e-2, betas=(0.0, 0.0), update_gap=4,
                                 projectable_lr_scale=1.0, fira_gamma=None)
    ref = package.FiraAdamW([{"params": theirs.matrices(), "rank": RANK, "update_proj_gap": 4, "alpha": 1.0,
                              "proj_type": "std"}], lr=1e-2, betas=(0.0, 0.0), eps=1e-8,
                            no_deprecation_warning=True)
    worst = 0.0
    for t in range(17):
        for a, b, pb in zip(ours.matrices(), theirs.matrices(), problems):
            g = torch.tensor(pb.grad(a.detach().double().numpy(), t), dtype=torch.float32)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        worst = max(worst, max(float((a - b).detach().abs().max())
                               for a, b in zip(ours.matrices(), theirs.matrices())))
    assert worst > 1e-3


# ---- LDAdam and AdaMeM ---------------------------------------------------------------------------
@pytest.mark.parametrize("foreach", [True, False])
def test_ldadam_matches_float64_reference(foreach):
    """LDAdam's registry entry: a new basis every step (one block power iteration from the last),
    moments transported, error feedback carried in the optimizer state."""
    hp = dict(lr=1e-2, weight_decay=0.1)
    got, opt, model, problems = train("ldadam", foreach=foreach, **hp)
    for traj, pb in zip(got, problems):
        ref = ldadam64.run(pb.w0, pb.grad, STEPS, rank=RANK, **hp)
        assert moved(ref, pb.w0) > 0.05
        assert max_gap(ref, traj) < 1e-11
    w = model.matrices()[0]
    assert opt.state[w]["error"].shape == w.shape and float(opt.state[w]["error"].abs().max()) > 0
    assert int(opt.state[w]["step"]) == STEPS  # bias correction counts from the first step


@pytest.mark.parametrize("foreach", [True, False])
def test_adamem_matches_float64_reference(foreach):
    """AdaMeM's registry entry: SVD every 4 steps (three changes), Adafactor with momentum on the
    projected part (state reset on a change), one-sided Adafactor on the residual (never reset)."""
    hp = dict(lr=1e-2, update_gap=4, weight_decay=0.1)
    got, opt, model, problems = train("adamem", foreach=foreach, projectable_lr_scale=0.25,
                                      state_free_lr_scale=0.5, **hp)
    for traj, pb in zip(got, problems):
        ref = adamem64.run(pb.w0, pb.grad, STEPS, rank=RANK, scale=0.25, free_scale=0.5, **hp)
        assert moved(ref, pb.w0) > 0.05
        assert max_gap(ref, traj) < 1e-12
    norm_state = opt.state.get(model.norm, {})
    assert "row" not in norm_state  # the non-projectable group keeps AdamW (the entry's rest)
    assert [g["state_full"] for g in opt.param_groups if not g["projectable"]] == ["adamw"]


# ---- the optimizer contract for the three entries ------------------------------------------------
ENTRIES = {"fira": dict(update_gap=3), "ldadam": dict(), "adamem": dict(update_gap=3)}


def grads_for(params, t):
    g = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) for p in params]


def tiny_llama(dtype=torch.float32):
    import models
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "configs", "model", "llama_tiny.yaml"))
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = 64, 16, 40, 2
    torch.manual_seed(0)
    return models.build_model(cfg).to(dtype)


def run(model, opt, steps, start=0):
    params = [p for p in model.parameters() if p.requires_grad]
    for t in range(start, start + steps):
        for p, g in zip(params, grads_for(params, t)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_state_dict_round_trip_continues_bitwise(name, dtype):
    """Stop mid-window, save with torch.save, load with weights_only into a fresh optimizer, and
    continue across projection changes: the same weights bit for bit (the error buffer, Fira's
    norm, AdaMeM's statistic and counters, the bases are all in the state)."""
    model = tiny_llama(dtype)
    opt = frugal.build_optimizer(model, name, lr=1e-2, weight_decay=0.1, **ENTRIES[name])
    run(model, opt, 4)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin = tiny_llama(dtype)
    twin.load_state_dict(model.state_dict())
    twin_opt = frugal.build_optimizer(twin, name, lr=1e-2, weight_decay=0.1, **ENTRIES[name])
    twin_opt.load_state_dict(torch.load(buf, weights_only=True))
    run(model, opt, 5, start=4)
    run(twin, twin_opt, 5, start=4)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_step_leaves_gradients_untouched(name, foreach):
    model = tiny_llama()
    opt = frugal.build_optimizer(model, name, weight_decay=0.1, foreach=foreach, **ENTRIES[name])
    params = list(model.parameters())
    for t in range(3):
        gs = grads_for(params, t)
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, gs))


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_estimate_equals_measured_state(name):
    """frugal.estimate_state_bytes counts what the optimizer holds: the bases, the reduced moments
    (Adafactor's factors for AdaMeM), the residual rule's state (Fira's norm, AdaMeM's statistic and
    counter) and LDAdam's error buffer, with the implementation's layout of the basis."""
    model = tiny_llama()
    opt = frugal.build_optimizer(model, name, **ENTRIES[name])
    run(model, opt, 2)
    estimate = frugal.estimate_state_bytes(model, name, svd_layout="implementation", **ENTRIES[name])
    assert frugal.state_bytes(opt) == estimate
    with torch.device("meta"):
        meta = tiny_llama()
    assert frugal.estimate_state_bytes(meta, name, svd_layout="implementation", **ENTRIES[name]) == estimate


def test_memory_of_the_methods_in_units_of_the_layer():
    """The per-matrix counts of docs/concurrent_methods.md (implementation layout): Fira = GaLore
    + 1 float, LDAdam = GaLore + the matrix, AdaMeM = basis + one moment + factors + statistic."""
    model = tiny_llama()
    galore = frugal.estimate_state_bytes(model, "galore", svd_layout="implementation")
    matrices = [p for g in frugal.param_groups(model) if g["projectable"] for p in g["params"]]
    n = len(matrices)
    fira = frugal.estimate_state_bytes(model, "fira", svd_layout="implementation")
    ldadam = frugal.estimate_state_bytes(model, "ldadam", svd_layout="implementation")
    assert fira == galore + 4 * n
    assert ldadam == galore + sum(4 * p.numel() for p in matrices)
    adamem = frugal.estimate_state_bytes(model, "adamem", svd_layout="implementation")
    adamw_rest = frugal.estimate_state_bytes(model, "frugal", density=0.0)
    expected = adamw_rest
    for p in matrices:
        big, small = max(p.shape), min(p.shape)
        r = P.matrix_rank(p.shape, 0.25)
        expected += 4 * (small * r + big * r + big + r + big) + 4 + 8
    assert adamem == expected


# ---- bad combinations are named before any step ----------------------------------------------------
@pytest.mark.parametrize("overrides,words", [
    (dict(projection="block"), "needs a projection with a reduced dimension.*'block'"),
    (dict(projection="randk"), "'randk'; valid choices: svd, random, power, column, row, randperm"),
])
def test_fira_refuses_projections_without_a_reduced_dimension(overrides, words):
    with pytest.raises(HyperparameterError, match=words):
        frugal.build_optimizer(tiny_llama(), "fira", **overrides)


@pytest.mark.parametrize("name,overrides,words", [
    ("ldadam", dict(state_free="signsgd"), "error_feedback=True .* state_free 'signsgd'"),
    ("ldadam", dict(projection="column"), "projection 'column'"),
    ("frugal", dict(reset_state="transport"), "reset_state 'transport' with projection 'block'"),
    ("adamem", dict(projection="randk", state_free="none"), "'adafactor_momentum' .* projection 'randk'"),
    ("adamem", dict(reset_state="reproject"), "reset_state 'reproject'"),
    ("frugal", dict(state_full="adafactor_momentum"), "shape \\(16,\\).*state_full='adamw'"),
    ("frugal", dict(fira_gamma=0.5), "Invalid fira_gamma: 0.5 .* or None"),
    ("frugal", dict(subspace_momentum=1.0), "Invalid subspace_momentum: 1.0"),
])
def test_bad_combinations_are_named(name, overrides, words):
    with pytest.raises(HyperparameterError, match=words):
        frugal.build_optimizer(tiny_llama(), name, **overrides)


def test_state_free_modules_of_a_contextual_entry_take_signsgd():
    """Table 4's option on Fira / AdaMeM: a module moved to the state-free set has no split for the
    contextual rule to read, so it takes FRUGAL's signSGD (and holds no state)."""
    model = tiny_llama()
    opt = frugal.build_optimizer(model, "fira", state_free_modules=["norms"])
    free = [g for g in opt.param_groups if g["always_state_free"]]
    assert [g["state_free"] for g in free] == ["signsgd"]
    run(model, opt, 2)
    assert not any(p in opt.state for p in free[0]["params"])


# ---- the fast path against the single-tensor reference -------------------------------------------
def groups_with_conv1d(dtype=torch.float64):
    """Two layers: a Linear-style (out, in) weight and a Conv1D-style (in, out) one per layer."""
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: nn.Parameter(torch.randn(*s, generator=gen, dtype=dtype))  # noqa: E731
    params = [make(8, 12), make(12, 8), make(8, 12), make(12, 8), make(5)]
    groups = [{"params": [params[0]], "projectable": True, "block": 0},
              {"params": [params[1]], "projectable": True, "block": 0, "transposed": True},
              {"params": [params[2]], "projectable": True, "block": 1},
              {"params": [params[3]], "projectable": True, "block": 1, "transposed": True},
              {"params": [params[4]]}]
    return params, groups


@pytest.mark.parametrize("config", [
    dict(projection="svd", state_free="fira", reset_state="keep", projectable_lr_scale=0.25),
    dict(projection="row", state_free="fira"),
    dict(projection="randperm", state_free="fira", fira_gamma=None),
    dict(projection="power", update_gap=1, reset_state="transport", state_free="none", error_feedback=True,
         subspace_momentum=0.9),
    dict(projection="svd", state_full="adafactor_momentum", state_free="one_sided_adafactor"),
    dict(projection="column", state_full="adafactor_momentum", state_free="one_sided_adafactor"),
    dict(projection="svd", state_free="none", error_feedback=True, reset_state="reset"),
])
def test_fast_path_matches_single_tensor_reference(config):
    """Batched phases and Algorithm 1 one tensor at a time agree for every piece the concurrent
    methods add, Conv1D (transposed) weights included, across subspace changes."""
    runs = []
    for foreach in (True, False):
        params, groups = groups_with_conv1d()
        if config.get("state_full") == "adafactor_momentum":
            groups[-1]["state_full"] = "adamw"
        opt = FRUGAL(groups, lr=2e-2, density=0.4, weight_decay=0.1, state_free_lr_scale=0.5,
                     **{"update_gap": 3, **config}, foreach=foreach)
        for t in range(8):
            for p, g in zip(params, grads_for(params, t)):
                p.grad = g
            opt.step()
        runs.append((params, opt))
    (fast, opt_fast), (ref, opt_ref) = runs
    for p, q in zip(fast, ref):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    for p, q in zip(fast, ref):
        a, b = opt_fast.state[p], opt_ref.state[q]
        assert a.keys() == b.keys()
        for name in a:
            if torch.is_tensor(a[name]):
                torch.testing.assert_close(a[name], b[name], rtol=1e-10, atol=1e-12)


def test_contextual_rules_refuse_fsdp2_shards(tmp_path):
    """Fira's limiter and AdaMeM's statistic read whole matrices; a DTensor shard is refused by name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)]))
        for free in ("fira", "one_sided_adafactor"):
            with pytest.raises(HyperparameterError, match=f"state_free '{free}' .* FSDP2 shard; valid choices"):
                FRUGAL([{"params": [shard], "projectable": True, "block": 0}], projection="column", state_free=free)
        FRUGAL([{"params": [shard], "projectable": True, "block": 0}], projection="column")  # signSGD: fine
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_materialize_state_has_the_shapes_of_a_checkpoint(name):
    """What torch.distributed.checkpoint loads into: the error buffer, Fira's norm, AdaMeM's factors,
    statistic and counters, in the checkpoint's shapes and dtypes."""
    model = tiny_llama()
    opt = frugal.build_optimizer(model, name, **ENTRIES[name])
    run(model, opt, 4)
    fresh = frugal.build_optimizer(tiny_llama(), name, **ENTRIES[name])
    fresh.materialize_state(4)

    def layout(o):
        return {k: {n: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for n, v in s.items()}
                for k, s in o.state_dict()["state"].items()}

    assert layout(fresh) == layout(opt)


@pytest.mark.parametrize("projection", ["block", "column", "power"])
def test_materialize_state_at_a_window_boundary(projection):
    """A checkpoint of step S holds the state of step S - 1's window, also when step S starts a new
    one (which blocks own state, which coordinates, which window a basis was chosen in)."""
    hp = dict(update_gap=2, projection=projection, block_order="ascending")
    if projection == "power":
        hp.update(reset_state="transport", state_free="none")
    model = tiny_llama()
    opt = frugal.build_optimizer(model, "frugal", **hp)
    run(model, opt, 4)
    fresh = frugal.build_optimizer(tiny_llama(), "frugal", **hp)
    fresh.materialize_state(4)
    saved, made = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert saved.keys() == made.keys()
    for key, st in saved.items():
        assert {n: (tuple(v.shape) if torch.is_tensor(v) else v) for n, v in st.items()} == \
            {n: (tuple(v.shape) if torch.is_tensor(v) else v) for n, v in made[key].items()}
