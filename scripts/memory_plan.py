"""Per-rank peak device memory of a training run: does it fit, and with what micro-batch?

    python scripts/memory_plan.py model=llama_7b optimizer=frugal_rho0 train.micro_batch_size=8
    python scripts/memory_plan.py model=llama_7b optimizer=frugal_rho0 --search      # largest micro-batch
    python scripts/memory_plan.py experiment=table5_3b optimizer=adamw --world-size 8 --parallelism fsdp
    python scripts/memory_plan.py --table                                  # the paper's models, 8 x 80 GB A100

Positional arguments are Hydra overrides, composed exactly as train.py composes its config: the
micro-batch, sequence length, precision, global batch (and `train.activation_checkpointing` /
`train.parallelism` once the loop has them) come from that config unless an option below sets them.
The vocabulary is the model's (the paper's C4 runs); `--vocab-size` overrides it (data=synthetic: 512).

Memory is planned on the meta device (nothing allocated; seconds for 7B) by
`train_utils.memory_plan`; docs/memory_plan.md explains what is counted and how it was validated.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hydra.errors import HydraException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from train_utils.memory_plan import (  # noqa: E402
    DEVICES, GIB, PARALLELISMS, PRECISIONS, largest_micro_batch, plan_memory,
)

TABLE_MODELS = ["llama_60m", "llama_130m", "llama_350m", "llama_1b", "llama_3b", "llama_7b"]
TABLE_OPTIMIZERS = {"AdamW": "adamw", "FRUGAL 0.25": "frugal", "FRUGAL 0": "frugal_rho0", "GaLore": "galore",
                    "BAdam": "badam"}
TABLE_SETTINGS = [("DDP", "ddp", False), ("DDP + AC", "ddp", True), ("FSDP2", "fsdp", False),
                  ("FSDP2 + AC", "fsdp", True)]


def compose(overrides: list[str]):
    """The config train.py would run with these overrides."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_settings(cfg, args) -> dict:
    """Planner keywords from the composed config, with the command-line options on top."""
    pick = lambda option, key, default=None: option if option is not None else OmegaConf.select(  # noqa: E731
        cfg, key, default=default)
    return dict(
        micro_batch_size=pick(args.micro_batch, "train.micro_batch_size"),
        seq_len=pick(args.seq_len, "data.seq_len"),
        precision=pick(args.precision, "train.precision"),
        parallelism=pick(args.parallelism, "train.parallelism", "ddp"),
        activation_checkpointing=pick(args.activation_checkpointing, "train.activation_checkpointing", False),
        world_size=args.world_size,
        vocab_size=args.vocab_size,
        gradient_as_bucket_view=not args.no_bucket_view,
        autocast_cache=not args.no_autocast_cache,
    )


def device_bytes(args) -> int:
    return int(args.device_gib * GIB) if args.device_gib else DEVICES[args.device]


def search(cfg, settings: dict, args) -> list[tuple]:
    """(activation checkpointing, micro-batch or None, plan) for the checkpointing setting(s) asked."""
    settings = dict(settings)
    settings.pop("micro_batch_size")
    ac_given = args.activation_checkpointing is not None
    rows = []
    for ac in ([settings["activation_checkpointing"]] if ac_given else [False, True]):
        settings["activation_checkpointing"] = ac
        micro, plan = largest_micro_batch(cfg.model, OmegaConf.to_container(cfg.optimizer, resolve=True),
                                          device_bytes=device_bytes(args),
                                          global_batch=OmegaConf.select(cfg, "train.batch_size"), **settings)
        rows.append((ac, micro, plan))
    return rows


def table(args) -> str:
    """Markdown: per model and optimizer, the largest micro-batch that fits and its per-rank peak."""
    dev = device_bytes(args)
    head = "| model | optimizer | " + " | ".join(name for name, _, _ in TABLE_SETTINGS) + " |"
    lines = [f"Per-rank peak allocated memory (GiB) at the largest micro-batch that fits {dev / GIB:.2f} GiB "
             f"with the allowance, {args.world_size} GPUs, global batch 512 x 256 tokens, bf16-mixed. "
             "Cell: micro-batch / peak (required incl. allowance); '-' = nothing fits.", "", head,
             "|---|---|" + "---|" * len(TABLE_SETTINGS)]
    for model in args.models:
        for label, opt_name in TABLE_OPTIMIZERS.items():
            if opt_name not in args.optimizers:
                continue
            cfg = compose([f"model={model}", f"optimizer={opt_name}", "experiment=table2"])
            opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
            cells = []
            for _, parallelism, ac in TABLE_SETTINGS:
                micro, plan = largest_micro_batch(cfg.model, opt, device_bytes=dev, seq_len=256,
                                                  world_size=args.world_size, global_batch=512,
                                                  parallelism=parallelism, activation_checkpointing=ac)
                cells.append("-" if micro is None else
                             f"{micro} / {plan.total / GIB:.1f} ({plan.required / GIB:.1f})")
            lines.append(f"| {model} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (model=..., optimizer=...)")
    ap.add_argument("--micro-batch", type=int, help="sequences per device and forward pass")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--world-size", type=int, default=1, help="processes (GPUs); default 1")
    ap.add_argument("--parallelism", choices=PARALLELISMS)
    ap.add_argument("--precision", choices=PRECISIONS)
    ap.add_argument("--activation-checkpointing", choices=["on", "off"],
                    help="per transformer block; with --search and not given, both are searched")
    ap.add_argument("--vocab-size", type=int, help="the data's vocabulary (default: the model's)")
    ap.add_argument("--device", choices=sorted(DEVICES), default="a100-80gb")
    ap.add_argument("--device-gib", type=float, help="device memory in GiB (instead of --device)")
    ap.add_argument("--no-bucket-view", action="store_true",
                    help="DDP without gradient_as_bucket_view (buckets beside the gradients)")
    ap.add_argument("--no-autocast-cache", action="store_true",
                    help="torch.autocast(cache_enabled=False): no cached bf16 weight copies in the forward")
    ap.add_argument("--search", action="store_true", help="find the largest micro-batch that fits")
    ap.add_argument("--table", action="store_true", help="the planner's table for the paper's models")
    ap.add_argument("--models", nargs="+", default=TABLE_MODELS, help="with --table")
    ap.add_argument("--optimizers", nargs="+", default=list(TABLE_OPTIMIZERS.values()), help="with --table")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    if args.activation_checkpointing is not None:
        args.activation_checkpointing = args.activation_checkpointing == "on"

    if args.table:
        if args.world_size == 1:
            args.world_size = 8
        print(table(args))
        return 0
    try:
        cfg = compose(args.overrides)
        settings = run_settings(cfg, args)
        if args.search:
            for ac, micro, plan in search(cfg, settings, args):
                checkpointing = "on" if ac else "off"
                if micro is None:
                    print(f"activation checkpointing {checkpointing}: no micro-batch fits; the smallest:")
                else:
                    print(f"activation checkpointing {checkpointing}: largest micro-batch that fits: {micro}")
                print(json.dumps(plan.as_dict()) if args.json else plan.format(device_bytes(args)))
            return 0
        plan = plan_memory(cfg.model, OmegaConf.to_container(cfg.optimizer, resolve=True), **settings)
    except (ValueError, HydraException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict()) if args.json else plan.format(device_bytes(args)))
    return 0 if plan.fits(device_bytes(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
