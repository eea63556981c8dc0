"""The scripts that redraw Figure 2 (principal angles of SVD subspaces) and Figure 3 (the Appendix C
re-projection toy): the properties the paper reads from them, and both input paths of Figure 2."""
from __future__ import annotations

import glob

import pytest
import torch

from _train_helpers import run_inprocess  # noqa: F401
from scripts import figure2_subspace_angles as fig2
from scripts import figure3_reprojection as fig3


# ----------------------------------------------------------------------------------- Figure 3
@pytest.mark.parametrize("rank", [3, 6])
def test_reprojection_converges_faster_in_the_toy(rank):
    result = fig3.compute((rank,), runs=5, steps=120, update_gap=10, lr=0.05, momentum=0.9)
    keep = result["curves"][str(rank)]["keep"]["mean"]
    reproject = result["curves"][str(rank)]["reproject"]["mean"]
    assert keep[0] == reproject[0]  # the same initial matrices
    assert reproject[-1] < keep[-1] - 1.0  # >10x lower loss (log10 units) after 120 steps
    assert all(len(c) == 121 for c in (keep, reproject))


def test_without_momentum_the_two_variants_coincide():
    """With momentum 0 there is no state to move: the toy isolates the effect of the state."""
    a = fig3.run_toy(3, reproject=False, seed=1, steps=40, momentum=0.0)
    b = fig3.run_toy(3, reproject=True, seed=1, steps=40, momentum=0.0)
    assert a == b


def test_figure3_script_writes_png_and_json(tmp_path, capsys):
    out, js = tmp_path / "f3.png", tmp_path / "f3.json"
    fig3.main(["--runs", "2", "--steps", "30", "--out", str(out), "--json", str(js)])
    assert out.stat().st_size > 1000 and js.exists()
    assert "rank 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fig3.main(["--ranks", "11", "--out", str(out)])


# ----------------------------------------------------------------------------------- Figure 2
def _drifting_record(steps=4, m=48, n=32, rank=8, drift=0.05, seed=0) -> dict:
    """Gradients with a dominant rank-8 structure that rotates slowly, plus noise: what the paper
    observes in LLaMA gradients."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, rank, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(n, rank, generator=gen)).Q
    grads = []
    for _ in range(steps):
        v = torch.linalg.qr(v + drift * torch.randn(n, rank, generator=gen)).Q
        grads.append(u @ torch.diag(torch.linspace(10, 5, rank)) @ v.t() + 0.1 * torch.randn(m, n, generator=gen))
    return {"name": "w", "steps": list(range(0, 100 * steps, 100)), "grads": torch.stack(grads)}


def test_svd_subspaces_overlap_while_random_ones_stay_in_the_bulk():
    result = fig2.histograms(_drifting_record(), rank=8)
    edge = result["edge"]  # sqrt(4c(1-c)), c = 8/32: 0.866
    assert edge == pytest.approx(0.8660, abs=1e-4)
    assert float(result["random"].max()) < edge + 0.1  # finite-size slack around the Wachter edge
    assert int((result["random"] > 0.9).sum()) == 0
    for pair in result["pairs"]:
        assert int((pair["cos"] > 0.9).sum()) >= 6  # the tracked directions barely move
        assert float(pair["cos"].mean()) > float(result["random"].mean()) + 0.2


def test_default_pairs_skip_the_initialisation_and_bad_input_is_named():
    result = fig2.histograms(_drifting_record(steps=5), rank=4)
    assert [p["steps"] for p in result["pairs"]] == [(100, 200), (100, 300), (100, 400)]
    with pytest.raises(ValueError, match="rank 40 is not in"):
        fig2.histograms(_drifting_record(), rank=40)
    with pytest.raises(ValueError, match="outside the 4 recorded"):
        fig2.histograms(_drifting_record(), pairs=[(0, 7)])


def test_record_from_a_run_then_plot(tmp_path, capsys):
    grads = tmp_path / "grads.pt"
    rec = fig2.main(["record", "--out", str(grads), "--steps", "4", "--every", "2", "--batch", "2",
                     "--seq-len", "16"])
    assert rec["steps"] == [0, 2, 4] and rec["grads"].shape == (3, 128, 128)
    assert not torch.equal(rec["grads"][0], rec["grads"][2])  # the weights moved between recordings
    out = tmp_path / "f2.png"
    fig2.main(["plot", str(grads), "--out", str(out)])
    assert out.stat().st_size > 1000
    assert "random:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no weight 'nope'"):
        fig2.record_run("nope", 1, 1, batch=1, seq_len=8)


@pytest.mark.slow
def test_record_from_checkpoints(tmp_path):
    run = tmp_path / "run"
    run_inprocess(run, "train.steps=4", "checkpoint.every=2")
    ckpts = sorted(glob.glob(str(run / "checkpoints" / "step_*")))
    assert len(ckpts) == 2
    rec = fig2.record_checkpoints(fig2.DEFAULT_WEIGHT, ckpts[::-1], batch=2)
    assert rec["steps"] == [2, 4] and rec["source"] == "checkpoints"
    assert rec["grads"].shape == (2, 128, 128) and bool(torch.isfinite(rec["grads"]).all())
