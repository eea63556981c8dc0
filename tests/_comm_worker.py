"""Run by tests/test_comm.py under torchrun (gloo, CPU): the state-free vote's DDP hook against DDP's
own reduction and the one-process reference (frugal.comm.majority_vote).

A small residual MLP with odd sizes (4 blocks, 1 state-full: density 0.25, windows of 2 steps) is
trained 5 steps with the vote, beside a copy under plain DDP and a copy without DDP (the rank's
local gradients), all three with the same weights before each step. Small buckets, so buckets mix
voted and exact tensors. Each rank writes what it measured to `<out>/rank<r>.json`."""
import copy
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from frugal import FRUGAL
from frugal.comm import RoleMismatchError, attach_vote, majority_vote, ring_bytes, tie_ranks
from train_utils.distributed import leave, park

D, LAYERS, STEPS = 13, 4, 5


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d + 1, bias=False)  # 27 x 13: not a multiple of 8
        self.down = torch.nn.Linear(2 * d + 1, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, d=D, layers=LAYERS):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x).pow(2).mean()


def groups(model):
    layers = [{"params": list(b.parameters()), "projectable": True, "block": i} for i, b in enumerate(model.layers)]
    return layers + [{"params": list(model.inp.parameters()) + list(model.out.parameters())}]


def flat_all_gather(t: torch.Tensor, world: int) -> torch.Tensor:
    out = [torch.empty_like(t.reshape(-1)) for _ in range(world)]
    dist.all_gather(out, t.reshape(-1).contiguous())
    return torch.stack(out)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "steps": []}
    torch.manual_seed(0)
    model = Net()
    ref, local = copy.deepcopy(model), copy.deepcopy(model)
    opt = FRUGAL(groups(model), lr=1e-2, density=0.25, update_gap=2, seed=3)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.002)  # ~2 KB buckets: several, mixed
    ref_ddp = DDP(ref, gradient_as_bucket_view=True, bucket_cap_mb=0.002)
    hook = attach_vote(ddp, opt)
    params, ref_params, local_params = list(model.parameters()), list(ref.parameters()), list(local.parameters())
    zero_hooks = [m.layers[0].up.weight.register_hook(lambda g: _zeros(g, rank)) for m in (model, ref, local)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, D, generator=g)
        for m, d in ((ddp, ddp), (ref_ddp, ref_ddp), (local, local)):
            d(x).backward()
        voted = hook.last_layout
        voted_ids = {id(p) for bucket in voted for p in bucket}
        names = {id(p): n for n, p in model.named_parameters()}
        row = {"step": step, "voted": sorted(names[i] for i in voted_ids), "buckets": len(voted)}
        # exact tensors: DDP's own reduction, bit for bit
        row["exact_equal"] = all(torch.equal(p.grad, q.grad) for p, q in zip(params, ref_params)
                                 if id(p) not in voted_ids)
        row["exact_count"] = sum(id(p) not in voted_ids for p in params)
        # voted tensors: the reference vote of every bucket, on the ranks' local gradients
        position = {id(p): i for i, p in enumerate(params)}
        ident = {id(t.param): t.ident for t in opt.next_roles()}
        same, ties, zeros = True, 0, 0
        for bucket in voted:
            if not bucket:
                continue
            locals_ = torch.cat([flat_all_gather(local_params[position[id(p)]].grad, world) for p in bucket], dim=1)
            expected = majority_vote(locals_, tie_ranks([p.numel() for p in bucket], [ident[id(p)] for p in bucket],
                                                        world))
            got = torch.cat([p.grad.reshape(-1) for p in bucket])
            same &= torch.equal(expected, got)
            ties += int(((locals_ > 0).sum(0) * 2 == world).sum())
            zeros += int((locals_ == 0).sum())
        row["vote_equal"], row["ties"], row["zeros"] = same, ties, zeros
        # the norm: exact tensors' norm with B = mean of the ranks' local norms of the voted gradients
        free_local = torch.cat([q.grad.reshape(-1) for p, q in zip(params, local_params) if id(p) in voted_ids])
        local_norms = flat_all_gather(torch.linalg.vector_norm(free_local).reshape(1), world)
        bound = float(local_norms.sum()) / world
        exact_sq = sum(float(q.grad.double().square().sum()) for p, q in zip(params, ref_params)
                       if id(p) not in voted_ids)
        row["norm"] = float(hook.grad_norm(params))
        row["norm_expected"] = math.sqrt(exact_sq + bound ** 2)
        row["norm_exact_mode"] = float(torch.nn.utils.get_total_norm([q.grad for q in ref_params]))
        row["norm_with_votes"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        stats = hook.last
        row["bytes_sent"] = stats.bytes_sent
        exact_bytes = sum(ring_bytes(p.grad.numel() * 4, world) for p in params if id(p) not in voted_ids)
        row["exact_bytes_if_one_buffer"] = exact_bytes
        row["stats"] = {"exact_bytes": stats.exact_bytes, "vote_bytes": stats.vote_bytes,
                        "voted_elements": stats.voted_elements, "exact_elements": stats.exact_elements}
        result["steps"].append(row)
        opt.step()
        for m in (ref, local):  # the next step starts from the vote model's weights
            m.load_state_dict(model.state_dict())
        for m in (model, ref, local):
            m.zero_grad(set_to_none=False)
    for handle in zero_hooks:
        handle.remove()
    # replicas in sync: every rank's weights, bit for bit
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    result["in_sync"] = bool((flat_all_gather(flat, world) == flat).all())
    # a forced mismatch: the roles change between backward and step (the step count moved by a window)
    ddp(torch.randn(6, D)).backward()
    for group in opt.param_groups:
        group["step"] += 2
    try:
        opt.step()
        result["mismatch"] = "no error"
    except RoleMismatchError as err:
        result["mismatch"] = str(err)
    for group in opt.param_groups:
        group["step"] -= 2
    opt.zero_grad(set_to_none=False)
    with ddp.no_sync():  # gradients that never passed the hook
        ddp(torch.randn(6, D)).backward()
    try:
        opt.step()
        result["unsynced"] = "no error"
    except RoleMismatchError as err:
        result["unsynced"] = str(err)
    opt.zero_grad(set_to_none=False)
    ref_ddp.zero_grad(set_to_none=False)
    ref.load_state_dict(model.state_dict())
    # identical data on every rank: the norm is exact mode's
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(7))
    ddp(x).backward()
    ref_ddp(x).backward()
    result["identical_norm"] = float(hook.grad_norm(params))
    result["identical_norm_exact"] = float(torch.nn.utils.get_total_norm([q.grad for q in ref_params]))
    opt.step()
    opt.zero_grad(set_to_none=False)
    # a NaN in one rank's voted gradient: every rank's norm is NaN
    target = next(p for p in params if id(p) in hook.voted_params())
    nan_hook = target.register_hook(lambda g: g.clone().fill_(float("nan")) if rank == world - 1 else g)
    ddp(torch.randn(6, D)).backward()
    result["nan_norm"] = float(hook.grad_norm(params))
    nan_hook.remove()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    park(ddp, ref_ddp)  # leave without freeing gloo's group (train_utils.distributed.leave)
    leave(0)


def _zeros(g, rank):
    """Exact zeros in a gradient: the first 7 entries on every rank, the next 5 on rank 0 only."""
    g = g.clone()
    flat = g.view(-1)
    flat[:7] = 0
    if rank == 0:
        flat[7:12] = 0
    return g


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
