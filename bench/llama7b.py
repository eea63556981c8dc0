"""LLaMA-7B pre-training steps in the memory of one 24 GB GPU, proven on the CPU: FRUGAL rho=0 with its
step inside backward (frugal/in_backward.py), pure bf16 with stochastic rounding, activation
checkpointing, clipping at 1.0 (the paper's 7B recipe), micro-batch 1 x 128 tokens.

    python -m bench.llama7b                       # two real 7B steps (minutes on 2 CPU cores, ~15 GiB)
    python -m bench.llama7b --optimizer adamw --cap-gib 24   # refused by the memory check before allocating
    python -m bench.llama7b optimizer.density=0.25 optimizer.state_precision=8bit   # density 0.25, 8-bit moments
    python -m bench.llama7b --model llama_tiny    # the same script on a tiny model (what CI runs)
    python -m bench.llama7b --device cuda --cap-gib 24   # a GPU held to 24 GiB (ops/preflight.py)

The memory planner (train.py's check) plans the run first and refuses one that does not fit (exit 2);
the model is built directly in bf16 and trained on random ids. The last line is one JSON object:
`peak_rss_gib` (this process's high-water mark), `planned_gib` (the plan plus PROCESS_BYTES), `step_s`,
`loss`, `weights_changed`; on a GPU also the caching allocator's `max_allocated_gib`/`max_reserved_gib`
(`--cap-gib` holds the process to that much of the device). docs/in_backward.md.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: idle OpenMP threads sleep

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

import frugal
import models
from train_utils.loop import count_targets, enable_activation_checkpointing, token_loss_sum
from train_utils.memory_check import PROCESS_BYTES
from train_utils.memory_plan import GIB, device_memory, plan_memory

ROOT = Path(__file__).resolve().parent.parent

SAMPLED = 1 << 20  # elements per sampled tensor for `weights_changed`


def compose(model: str, optimizer: str, extra: list[str] = ()):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = [f"model={model}", f"optimizer={optimizer}", *extra]
    if optimizer != "adamw":
        overrides.append("optimizer.stochastic_rounding=true")  # pure bf16: updates below half an ulp count
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return cfg.model, OmegaConf.to_container(cfg.optimizer, resolve=True)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def sample(model) -> list[torch.Tensor]:
    tensors = [model.get_input_embeddings().weight, model.get_output_embeddings().weight,
               next(iter(frugal.grouping.transformer_blocks(model)[0].parameters()))]
    return [t.detach().flatten()[:SAMPLED].clone() for t in tensors]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="optimizer.* Hydra overrides, e.g. optimizer.density=0.25")
    ap.add_argument("--model", default="llama_7b", help="a configs/model name (default llama_7b)")
    ap.add_argument("--optimizer", default="frugal_rho0", help="a configs/optimizer name (adamw: the ordinary step)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="plan against this much memory (e.g. 24: a 24 GB card); cuda: also hold the process to it")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.cap_gib is not None and not args.cap_gib > 0:
        ap.error(f"--cap-gib {args.cap_gib}: valid values are > 0")
    if args.steps < 1 or args.seq_len < 2 or args.micro_batch < 1:
        ap.error("--steps and --micro-batch must be >= 1 and --seq-len >= 2")
    others = [o for o in args.overrides if not o.startswith("optimizer.")]
    if others:
        ap.error(f"overrides set optimizer.* keys only, got {others}")
    torch.manual_seed(args.seed)
    model_cfg, opt_cfg = compose(args.model, args.optimizer, args.overrides)
    in_backward = opt_cfg["name"] in frugal.registry.frugal_based()
    plan = plan_memory(model_cfg, opt_cfg, micro_batch_size=args.micro_batch, seq_len=args.seq_len,
                       precision="bf16", activation_checkpointing=True, device_type=args.device,
                       optimizer_in_backward=in_backward, grad_clip=args.grad_clip > 0)
    device = torch.device(args.device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if args.cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device)
        planned, available = plan.required, min(total, args.cap_gib * GIB if args.cap_gib else total)
    else:
        planned, available = plan.total + PROCESS_BYTES, device_memory("cpu")
        if args.cap_gib:
            available = min(available, int(args.cap_gib * GIB))
    print(plan.format(), file=sys.stderr)
    result = {"model": args.model, "optimizer": args.optimizer, "overrides": args.overrides, "in_backward": in_backward,
              "planned_gib": round(planned / GIB, 2), "available_gib": round(available / GIB, 2)}
    if planned > available:  # the memory check: before anything is allocated
        where = f"{device} may use" if device.type == "cuda" or args.cap_gib else "this host has"
        print(f"refused by the memory check before allocating: {args.model} + {args.optimizer} plans "
              f"{planned / GIB:.1f} GiB (with the process) and {where} {available / GIB:.1f} GiB",
              file=sys.stderr)
        print(json.dumps({**result, "refused": True, "peak_rss_gib": round(peak_rss() / GIB, 2)}))
        return 2

    started = time.perf_counter()
    with device:
        model = models.build_model(model_cfg, dtype=torch.bfloat16)  # never in fp32: 13.5 GB for 7B, not 27
    enable_activation_checkpointing(model)
    model.train()
    optimizer = frugal.build_optimizer(model, **opt_cfg)
    clip = args.grad_clip or None
    if in_backward:
        frugal.step_in_backward(optimizer, max_norm=clip, model=model)
    build_s = time.perf_counter() - started
    print(f"built in {build_s:.0f} s; peak RSS so far {peak_rss() / GIB:.2f} GiB", file=sys.stderr, flush=True)
    before = sample(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=g).to(device)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        loss = token_loss_sum(logits, ids) / count_targets(ids)
        del logits
        loss.backward()  # in backward: each tensor updated and its gradient freed here
        if not in_backward and clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(round(time.perf_counter() - t0, 1))
        losses.append(round(float(loss.detach()), 4))
        print(f"step {step + 1}/{args.steps}: loss {losses[-1]}, {times[-1]} s, peak RSS {peak_rss() / GIB:.2f} GiB",
              file=sys.stderr, flush=True)
    changed = any(not torch.equal(a, b) for a, b in zip(before, sample(model)))
    if device.type == "cuda":
        result.update(max_allocated_gib=round(torch.cuda.max_memory_allocated(device) / GIB, 2),
                      max_reserved_gib=round(torch.cuda.max_memory_reserved(device) / GIB, 2))
    print(json.dumps({**result, "peak_rss_gib": round(peak_rss() / GIB, 2), "build_s": round(build_s, 1),
                      "step_s": times, "loss": losses, "weights_changed": changed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
