"""Table 2's memory column: optimizer-state memory per method and model size.

    python -m scripts.memory_table                       # estimate for every size, measured up to 150M params
    python -m scripts.memory_table --measure-max-params 4e8 --csv memory.csv

Per cell, in GiB of fp32 state as in the paper: `estimate` (`frugal.estimate_state_bytes` on the meta
device: Appendix D's formula, checked against the paper's column to two decimals) and `measured`
(`frugal.state_bytes` after one real step, for models up to --measure-max-params parameters).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

import frugal
from scripts.paper_tables import GIB, SIZE, TABLE2_MEMORY_GIB, TABLE2_OPTIMIZERS

ROOT = Path(__file__).resolve().parent.parent

TABLE2_MODELS = ["llama_60m", "llama_130m", "llama_350m", "llama_1b"]


def optimizer_config(option: str) -> dict:
    """configs/optimizer/<option>.yaml as a run composes it: its registry entry's keys and defaults
    with the option's changes, interpolations resolved."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("config", overrides=[f"optimizer={option}"])
    return OmegaConf.to_container(cfg.optimizer, resolve=True)


def model_config(name: str, configs: Path = ROOT / "configs") -> dict:
    return OmegaConf.to_container(OmegaConf.load(configs / "model" / f"{name}.yaml"), resolve=True)


def build(model_name: str, device: str):
    import models

    with torch.device(device):
        return models.build_model(model_config(model_name))


def estimate(model_name: str, opt: dict) -> int:
    model = build(model_name, "meta")
    hp = dict(opt)
    return frugal.estimate_state_bytes(model, hp.pop("name"), **hp)


def measure(model_name: str, opt: dict) -> int:
    """State bytes after one real step (lazy state exists only after the first step)."""
    model = build(model_name, "cpu")
    hp = dict(opt)
    optimizer = frugal.build_optimizer(model, hp.pop("name"), **hp)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    n = frugal.state_bytes(optimizer)
    del optimizer, model
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=TABLE2_MODELS)
    ap.add_argument("--measure-max-params", type=float, default=1.5e8,
                    help="measure the real state only for models up to this many parameters")
    ap.add_argument("--csv", help="also write a CSV here")
    args = ap.parse_args(argv)

    rows, all_match = [], True
    cells = [(label, opt_name, m) for label, opt_name in TABLE2_OPTIMIZERS.items() for m in args.models]
    for done, (label, opt_name, m) in enumerate(cells, 1):
        opt = optimizer_config(opt_name)
        # one line per cell on stderr: measuring a model takes minutes on a CPU
        n_params = sum(p.numel() for p in build(m, "meta").parameters())
        measured = n_params <= args.measure_max_params
        print(f"[{done}/{len(cells)}] {label} {SIZE.get(m, m)}: " + ("estimating and measuring (one real step)..."
              if measured else "estimating..."), file=sys.stderr, flush=True)
        est = estimate(m, opt) / GIB
        meas = measure(m, opt) / GIB if measured else None
        paper = TABLE2_MEMORY_GIB.get(label, {}).get(SIZE.get(m, m))
        if paper is not None and round(est, 2) != paper:
            all_match = False
        rows.append((label, m, n_params, est, meas, paper))

    sizes = [SIZE.get(m, m) for m in args.models]
    print("Optimizer-state memory, GiB: estimate (frugal.estimate_state_bytes) / measured (after one step) "
          "/ paper (Table 2)\n")
    print("| method | " + " | ".join(sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for label in TABLE2_OPTIMIZERS:
        cells = []
        for m in args.models:
            _, _, _, est, meas, paper = next(r for r in rows if r[0] == label and r[1] == m)
            cells.append(f"{est:.2f} / {'-' if meas is None else f'{meas:.2f}'} / "
                         f"{'-' if paper is None else f'{paper:.2f}'}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nestimate == paper (2 decimals) in every cell: {all_match}")
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["method", "model", "params", "estimate_gib", "measured_gib", "paper_gib"])
            for r in rows:
                w.writerow([r[0], r[1], r[2], f"{r[3]:.6f}", "" if r[4] is None else f"{r[4]:.6f}",
                            "" if r[5] is None else r[5]])
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
