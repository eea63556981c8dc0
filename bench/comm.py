"""The state-free vote (frugal.comm) measured: bytes on the wire and step time, exact vs vote.

    python -m bench.comm bytes                         # hook counters vs a private loopback's bytes (root)
    python -m bench.comm time                          # step time with the loopback rate-limited (root)
    python -m bench.comm agreement                     # one-process simulator: vote vs sign of the mean
    python -m bench.comm compute                       # the pack / vote / unpack compute, no communication
    python -m bench.comm payload                       # arithmetic: what the vote sends per model size
    python -m bench.comm project                       # a link model fitted to `time`, projected to 7B nodes

Each `bytes`/`time` case runs `torchrun --standalone` inside a private network namespace (`unshare -n`),
whose loopback counters then hold that case's traffic alone (`time` shapes it with tc's tbf); the ranks
train a LLaMA with FRUGAL in a plain DDP loop, `exact` through frugal.comm.count_allreduce_hook, `vote`
through frugal.comm.attach_vote. The worker (`--worker`) prints one JSON line per case; the driver a
markdown table. Method and results: docs/communication.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the worker: one case, under torchrun ---------------------------------------------------------
def lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmit bytes
    raise RuntimeError("no lo in /proc/net/dev")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.nn.parallel import DistributedDataParallel as DDP

    import models
    from frugal import FRUGAL
    from frugal.comm import attach_vote, count_allreduce_hook
    from train_utils.distributed import leave, park

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = OmegaConf.load(os.path.join(REPO, "configs", "model", f"{args.model}.yaml"))
    model = models.build_model(cfg, vocab_size=args.vocab)
    optimizer = FRUGAL(model, lr=1e-3, density=args.density, update_gap=args.update_gap)
    ddp = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
    counted: list[int] = []
    vote = attach_vote(ddp, optimizer) if args.mode == "vote" else None
    if vote is None:
        ddp.register_comm_hook(None, count_allreduce_hook(counted))
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    times, sent, before = [], [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            before = lo_tx_bytes() if rank == 0 else 0
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        t0 = time.perf_counter()
        counted.clear()
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        (vote.clip_grad_norm_ if vote is not None else torch.nn.utils.clip_grad_norm_)(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            sent.append(vote.last.bytes_sent if vote is not None else sum(counted))
    dist.barrier()
    after = lo_tx_bytes() if rank == 0 else 0
    totals = [None] * world
    dist.all_gather_object(totals, {"sent": sent, "times": times})
    if rank == 0:
        voted = vote.last.voted_elements if vote is not None else 0
        n_params = sum(p.numel() for p in params)
        times_all = sorted(max(t["times"][i] for t in totals) for i in range(args.steps))
        print("RESULT " + json.dumps({
            "mode": args.mode, "world": world, "model": args.model, "vocab": args.vocab, "density": args.density,
            "params": n_params, "voted_elements": voted, "steps": args.steps,
            "hook_bytes_per_rank_per_step": totals[0]["sent"][-1],
            "hook_bytes_all_ranks": sum(sum(t["sent"]) for t in totals),
            "loopback_bytes": after - before, "step_time_median_s": times_all[len(times_all) // 2],
            "step_times_s": times_all}), flush=True)
    dist.barrier()
    park(ddp)  # freeing DDP's reducer and gloo's group at exit can abort (train_utils.distributed.leave)
    leave(0)


# ---- the driver -----------------------------------------------------------------------------------
def run_case(mode: str, world: int, *, rate: str | None, model: str, vocab: int, density: float, steps: int,
             warmup: int = 2, batch: int = 1, seq: int = 64, timeout: int = 600) -> dict:
    inner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
             "-m", "bench.comm", "--worker", "--mode", mode, "--model", model, "--vocab", str(vocab),
             "--density", str(density), "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch),
             "--seq", str(seq)]
    shape = f"tc qdisc add dev lo root tbf rate {rate} burst 256kb latency 100ms; " if rate else ""
    script = f"ip link set lo up; {shape}exec {shlex.join(inner)}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"case {mode} W={world} rate={rate} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "rate": rate or "unshaped"}


def wire_table(args, rates) -> None:
    """One row per case: step time, the hooks' bytes and the loopback's."""
    print("| link | ranks | mode | step s (median of the slowest rank) | hook bytes / rank / step | "
          "hook bytes, all ranks | loopback bytes | loopback / hook |")
    print("|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for world in args.worlds:
            for mode in args.modes:
                r = run_case(mode, world, rate=None if rate == "unshaped" else rate, model=args.model,
                             vocab=args.vocab, density=args.density, steps=args.steps, warmup=args.warmup)
                print(f"| {rate} | {world} | {mode} | {r['step_time_median_s']:.3f} | "
                      f"{r['hook_bytes_per_rank_per_step']:,} | {r['hook_bytes_all_ranks']:,} | "
                      f"{r['loopback_bytes']:,} | {r['loopback_bytes'] / r['hook_bytes_all_ranks']:.4f} |", flush=True)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if args.save:
                    with open(args.save, "a") as f:
                        f.write(json.dumps(r) + "\n")


def agreement_table(args) -> None:
    """One process simulates W ranks (the mean gradient plus each rank's noise): the share of coordinates
    where the vote agrees with the sign of the mean, against the noise's size."""
    import torch

    from frugal.comm import majority_vote

    g = torch.Generator().manual_seed(0)
    n = args.elements
    mean = torch.randn(n, generator=g)
    print("| ranks W | noise / signal | agreement of the vote with sign(mean of the W gradients) |")
    print("|---|---|---|")
    for noise in args.noise:
        for world in args.sim_worlds:
            grads = mean + noise * torch.randn(world, n, generator=g)
            agree = (majority_vote(grads) == torch.sign(grads.mean(0))).double().mean().item()
            print(f"| {world} | {noise:g} | {agree:.4f} |", flush=True)


def compute_table(args) -> None:
    """The vote's compute on one rank without communication (pack the signs, vote on the own chunk,
    unpack to +-1) for n voted elements, against the adds of a ring all-reduce (W fp32 tensors of n / W)."""
    import torch

    from frugal.comm import chunk_layout, pack_bits, unpack_table, vote_own_chunk

    torch.set_num_threads(1)
    print("| voted elements | ranks W | pack signs ms | vote on own chunk ms | unpack to +-1 ms | "
          "all-reduce's local adds ms (fp32, for comparison) |")
    print("|---|---|---|---|---|---|")
    for n in args.compute_elements:
        for world in args.worlds:
            e, c = chunk_layout(n, world)
            grad = torch.randn(n)
            bits = torch.zeros(e * world, dtype=torch.bool)
            received = torch.randint(0, 256, (world * c,), dtype=torch.uint8)
            out = torch.empty(n)

            def pack():
                torch.gt(grad, 0, out=bits[:n])
                return pack_bits(bits)

            parts = [torch.randn(-(-n // world)) for _ in range(world)]

            def adds():
                acc = parts[0].clone()
                for p in parts[1:]:
                    acc.add_(p)

            ms = []
            for fn in (pack, lambda: vote_own_chunk(received, world, [n], [0], 0),
                       lambda: out.copy_(unpack_table(received, out.dtype)[:n]), adds):
                fn()
                t0 = time.perf_counter()
                for _ in range(5):
                    fn()
                ms.append((time.perf_counter() - t0) / 5 * 1e3)
            print(f"| {n:,} | {world} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {ms[3]:.1f} |", flush=True)


def voted_split(name: str, density: float) -> tuple[int, int]:
    """(parameters, voted elements) of a model in FRUGAL's first window (block projection, meta device)."""
    import torch
    from omegaconf import OmegaConf

    import models
    from frugal import FRUGAL
    from frugal.comm import VOTED_RULES
    from frugal.windows import FREE

    with torch.device("meta"):
        model = models.build_model(OmegaConf.load(os.path.join(REPO, "configs", "model", f"{name}.yaml")))
    roles = FRUGAL(model, lr=1e-3, density=density).next_roles()
    voted = sum(t.param.numel() for t in roles if t.role == FREE and t.group["state_free"] in VOTED_RULES)
    return sum(p.numel() for p in model.parameters()), voted


def payload_table(args) -> None:
    """Arithmetic: each model's voted and exact elements in the first window and the vote's bytes over
    the exact all-reduce's (fp32 gradients, padding ignored)."""
    from frugal.comm import payload_ratio

    print("| model | parameters | density | voted elements | exact elements | vote bytes / exact bytes | cut |")
    print("|---|---|---|---|---|---|---|")
    for name in args.payload_models:
        for density in args.payload_densities:
            total, voted = voted_split(name, density)
            ratio = payload_ratio(total - voted, voted)
            print(f"| {name} | {total / 1e6:,.1f}M | {density:g} | {voted / 1e6:,.1f}M | "
                  f"{(total - voted) / 1e6:,.1f}M | {ratio:.3f} | {1 / ratio:.2f}x |", flush=True)


def bytes_per_s(rate: str) -> float:
    """'1gbit' -> 1.25e8: tc's rate units (bits per second)."""
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale / 8
    raise ValueError(f"rate {rate!r}: expected a number followed by kbit, mbit or gbit")


def fit_link(cases: list[dict]) -> tuple[float, dict, float]:
    """Least squares fit of step = c + k * bytes / rate to the shaped `time` cases (bytes: the loopback's
    per step; one k, one c per (ranks, mode)): k, the c's and the largest relative residual."""
    groups = defaultdict(list)
    for r in cases:
        if r["rate"] != "unshaped":
            groups[(r["world"], r["mode"])].append(
                (r["loopback_bytes"] / r["steps"] / bytes_per_s(r["rate"]), r["step_time_median_s"], r["rate"]))
    groups = {g: [p[:2] for p in pts] for g, pts in groups.items() if len({p[2] for p in pts}) > 1}
    if not groups:
        raise ValueError("fitting the link needs two shaped rates of one (ranks, mode) case")
    means = {g: (statistics.mean(x for x, _ in pts), statistics.mean(y for _, y in pts)) for g, pts in groups.items()}
    sxy = sum((x - means[g][0]) * (y - means[g][1]) for g, pts in groups.items() for x, y in pts)
    sxx = sum((x - means[g][0]) ** 2 for g, pts in groups.items() for x, _ in pts)
    k = sxy / sxx
    c = {g: my - k * mx for g, (mx, my) in means.items()}
    worst = max(abs(c[g] + k * x - y) / y for g, pts in groups.items() for x, y in pts)
    return k, c, worst


def node_bytes(params: int, voted: int, nodes: int, gpus: int, mode: str, element_size: int = 4) -> float:
    """Bytes one node sends to the others per step (W = nodes x gpus): a ring all-reduce 2 (W-1)/W of the
    reduced bytes; the vote's all-to-all (W - gpus)/W of the packed signs, its all-gather (W-1)/W."""
    world = nodes * gpus
    ring = 2 * (world - 1) / world
    if mode == "exact":
        return ring * params * element_size
    return ring * (params - voted) * element_size + (world - gpus) / world * voted + (world - 1) / world * voted / 8


def project_table(args) -> None:
    """The link model fitted to --measured, applied to a model's bytes on nodes: one step's communication."""
    with open(args.measured) as f:
        cases = [json.loads(line) for line in f if line.strip()]
    k, c, worst = fit_link(cases)
    print(f"fitted on {len(cases)} cases of {os.path.relpath(args.measured)}: step = c + {k:.3f} x bytes / rate; "
          f"largest residual {worst:.1%}; c per (ranks, mode): "
          + ", ".join(f"{w} {m} {v:.3f} s" for (w, m), v in sorted(c.items())))
    print()
    print("| model | density | nodes x GPUs | link per node | exact: bytes / node / step | exact s | "
          "vote: bytes / node / step | vote s | exact / vote |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.payload_models:
        for density in args.payload_densities:
            params, voted = voted_split(name, density)
            for nodes in args.nodes:
                for rate in args.links:
                    b = {m: node_bytes(params, voted, nodes, args.gpus, m) for m in ("exact", "vote")}
                    t = {m: k * v / bytes_per_s(rate) for m, v in b.items()}
                    print(f"| {name} | {density:g} | {nodes} x {args.gpus} | {rate} | {b['exact'] / 1e9:.2f} GB | "
                          f"{t['exact']:.2f} | {b['vote'] / 1e9:.2f} GB | {t['vote']:.2f} | "
                          f"{t['exact'] / t['vote']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["bytes", "time", "agreement", "compute", "payload", "project"])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="exact", choices=["exact", "vote"])
    parser.add_argument("--model", default="llama_60m")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--update_gap", type=int, default=200)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--modes", nargs="+", default=["exact", "vote"], choices=["exact", "vote"])
    parser.add_argument("--rates", nargs="+", default=["unshaped", "1gbit", "200mbit"])
    parser.add_argument("--elements", type=int, default=1_000_000)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    parser.add_argument("--compute_elements", type=int, nargs="+", default=[1_000_000, 19_000_000])
    parser.add_argument("--payload_models", nargs="+", default=["llama_60m", "llama_130m", "llama_1b", "llama_7b"])
    parser.add_argument("--payload_densities", type=float, nargs="+", default=[0.25, 0.0])
    parser.add_argument("--sim_worlds", type=int, nargs="+", default=[2, 3, 8, 16, 32])
    parser.add_argument("--save", help="time/bytes: also append each case's JSON line to this file")
    parser.add_argument("--measured", default=os.path.join(REPO, "docs", "comm_time.jsonl"),
                        help="project: the `time` cases (JSON lines, --save) the link model is fitted to")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--links", nargs="+", default=["25gbit", "100gbit", "200gbit"])
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.what in ("bytes", "time"):
        return wire_table(args, ["unshaped"] if args.what == "bytes" else args.rates)
    {"agreement": agreement_table, "compute": compute_table, "payload": payload_table,
     "project": project_table}[args.what](args)


if __name__ == "__main__":
    main()
