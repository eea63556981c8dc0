"""FSDP2 shards: the values this process holds, and how a shard keys its coordinate draw.

Under ``fully_shard`` parameters, gradients and block state are DTensors (DESIGN invariant 10);
element-wise work runs on their local tensors (same storage), and the subspace is a pure function of
(seed, window, parameter), plus the shard's mesh place where coordinates are drawn within the shard.
"""
from __future__ import annotations

import sys

from torch import Tensor

from . import projections as proj


def _dtensor_type():
    """torch's DTensor class if `torch.distributed.tensor` has been imported (whatever makes a DTensor
    does), else None: not importing it keeps ~1 s out of `import frugal`."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """The values this process holds: the local shard of an FSDP2 DTensor (same storage)."""
    return t.to_local() if is_dtensor(t) else t


def mesh_coordinate(p: Tensor) -> tuple[int, ...]:
    """Where a sharded tensor's local part sits on its device mesh (() when not sharded)."""
    return tuple(p.device_mesh.get_coordinate() or ()) if is_dtensor(p) else ()


def shard_key(p: Tensor, group: dict) -> tuple[int, ...]:
    """Keys the coordinate draw of an FSDP2 shard: its place on the device mesh when the
    selection runs along a sharded dimension (rows, randk's flat index), so shards draw different
    coordinates; () otherwise (unsharded, or columns of a row-sharded weight: every shard then
    picks the columns the unsharded weight would)."""
    if not is_dtensor(p):
        return ()
    dim = proj.coordinate_dim(group["projection"], p.shape, group["transposed"])
    sharded = {pl.dim for pl in p.placements if pl.is_shard()}
    return mesh_coordinate(p) if dim is None or dim in sharded else ()
