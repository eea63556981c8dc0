"""Run by tests/test_fsdp.py under torchrun (2 processes, gloo, CPU): FRUGAL on FSDP2 shards.

Each check trains the same tiny residual MLP twice in every process: sharded with
`fully_shard` (per block and the root) and unsharded, on the same batches, and writes what it
measured to `<out>/rank<r>.json` for the test to assert on."""
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from frugal import FRUGAL, HyperparameterError, grad_norm, state_bytes, step_in_backward


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, d=16, layers=4):
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
    layers = [{"params": list(b.parameters()), "projectable": True, "block": i}
              for i, b in enumerate(model.layers)]
    return layers + [{"params": list(model.inp.parameters()) + list(model.out.parameters())}]


def build(sharded, mesh, dtype=torch.float32, **hp):
    torch.manual_seed(0)
    model = Net().to(dtype)
    if sharded:
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, FRUGAL(groups(model), lr=1e-2, update_gap=2, weight_decay=0.1, **hp)


def train(model, optimizer, steps, start=0, max_norm=None):
    dtype = next(model.parameters()).dtype
    for t in range(start, start + steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(t)).to(dtype)
        model(x).float().backward()
        if max_norm:  # the ordinary step's clipping, with the norm formula of the step inside backward
            params = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm(params))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def full(model):
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def compare(mesh, **hp):
    """Max |sharded - unsharded| after 7 steps (3 subspace switches), and state bytes of each."""
    sharded, opt = build(True, mesh, **hp)
    plain, ref = build(False, mesh, **hp)
    train(sharded, opt, 7)
    train(plain, ref, 7)
    dtensor_state = all(hasattr(v, "to_local") for s in opt.state.values() for k, v in s.items()
                        if k.startswith("exp_avg"))
    return {"diff": max_diff(full(sharded), full(plain)), "bytes": state_bytes(opt),
            "bytes_unsharded": state_bytes(ref), "dtensor_state": dtensor_state}


def checkpoint_round_trip(mesh, path, **hp):
    """DCP save after 3 steps, load into fresh sharded model + optimizer, 4 more steps on both."""
    hp = hp or {"density": 0.25}
    model, opt = build(True, mesh, **hp)
    train(model, opt, 3)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    twin, twin_opt = build(True, mesh, **hp)
    twin_opt.materialize_state(3)  # which tensors hold state depends on the window of step 3
    state = {"model": get_model_state_dict(twin), "optim": get_optimizer_state_dict(twin, twin_opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(twin, state["model"])
    # strict=False: state-free tensors own no state (torch's check expects every trained tensor to)
    set_optimizer_state_dict(twin, twin_opt, state["optim"], options=StateDictOptions(strict=False))
    same_step = twin_opt.step_count == opt.step_count == 3
    masters = sorted({str(s["master"].dtype) for s in twin_opt.state.values() if "master" in s})
    train(model, opt, 4, start=3)
    train(twin, twin_opt, 4, start=3)
    return {"diff": max_diff(full(model), full(twin)), "same_step": same_step, "masters": masters}


def in_backward(mesh):
    """The step inside backward on FSDP2 shards (its hooks see the reduce-scattered gradients) against
    the ordinary clipped step of one unsharded process on the same batches; plain (unsharded)
    parameters over 2 processes, and a DDP-wrapped model, are refused."""
    sharded, opt = build(True, mesh, density=0.25)
    stepper = step_in_backward(opt, max_norm=0.05)
    plain, ref = build(False, mesh, density=0.25)
    train(sharded, opt, 7)
    train(plain, ref, 7, max_norm=0.05)
    result = {"diff": max_diff(full(sharded), full(plain)), "clipped": float(stepper.grad_norm) > 0.05,
              "left": sum(p.grad is not None for p in sharded.parameters())}
    for name, model in (("plain", None), ("ddp", torch.nn.parallel.DistributedDataParallel(plain))):
        try:
            step_in_backward(build(False, mesh, density=0.25)[1], model=model)
            result[name] = None
        except ValueError as err:
            result[name] = str(err)
    return result


# optimizer=badam under setup/algorithm=authors (the badam package's options) on bf16 weights
BADAM_PACKAGE = dict(dtype=torch.bfloat16, density=0.25, state_free="none", reset_state="reset_everything",
                     window_offset=1, master_weights=True)


def badam_package(mesh, path):
    """bf16 shards with fp32 master copies (DTensors) and fp32 moments: as the unsharded model, through DCP."""
    result = compare(mesh, **BADAM_PACKAGE)
    sharded, opt = build(True, mesh, **BADAM_PACKAGE)
    train(sharded, opt, 2)
    result["masters"] = sorted({(type(s["master"]).__name__, str(s["master"].dtype), str(s["exp_avg"].dtype))
                                for s in opt.state.values() if "master" in s})
    result["dcp"] = checkpoint_round_trip(mesh, path, **BADAM_PACKAGE)
    return result


def main(out, ckpt):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {}
    try:
        result["block"] = compare(mesh, density=0.25)
        result["column"] = compare(mesh, density=0.25, projection="column", reset_state="reproject")
        result["row"] = compare(mesh, density=0.25, projection="row")
        result["randk"] = compare(mesh, density=0.25, projection="randk")
        result["dcp"] = checkpoint_round_trip(mesh, ckpt)
        result["in_backward"] = in_backward(mesh)
        result["badam_package"] = badam_package(mesh, ckpt + "_badam")
        try:
            build(True, mesh, projection="svd")
            result["svd_error"] = None
        except HyperparameterError as err:
            result["svd_error"] = str(err)
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
