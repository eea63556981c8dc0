"""Checkpoints of a sharded (FSDP2) run: every rank writes its shards, any process count reads them.

    step_00000100/  dcp/.metadata  dcp/__<rank>_0.distcp ...   weights + optimizer state (DCP)
                    rank00000.pt ...    per-rank optimizer state (column/row/randk only)
                    trainer.pt  config.yaml  manifest.json

Same promises as checkpoint.py (atomic rename after every rank's files and the manifest; a failed write
on any rank names the intact previous checkpoint). DCP needs a file system every rank sees. Column/row/
randk state is per rank (coordinates inside each shard, DESIGN invariant 10): restored exactly on the
same process count, fresh on another (an `optimizer_state_reset` event). Reads are data only: DCP's
reader would unpickle `.metadata` and `torch.load(weights_only=False)` other items, so `_SafeReader`
(an allow-list, files of this `dcp/` only) and `_SafePlanner` (weights_only=True) refuse anything else
with checkpoint.RefusedFile (docs/reliability.md).
"""
from __future__ import annotations

import copy
import errno
import glob
import os
import pickle
import shutil
import warnings

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from train_utils import checkpoint as ckpt
from train_utils.hooks import OptimizerHooks

SHARDED_DIR, is_sharded = ckpt.SHARDED_DIR, ckpt.is_sharded  # also reached as sharded_checkpoint.*


# What DCP's `.metadata` pickle may name (dtypes, layouts, memory formats are checked by type below):
# nothing that runs code besides torch's layout lookup by name.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise ckpt.refusal(self.path, f"a reference to {module}.{name}")

    def persistent_load(self, pid):
        raise ckpt.refusal(self.path, "a persistent reference")


class _SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` unpickled through the allow-list above, and its storage
    entries checked to name files of this directory."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        shown = os.path.join(os.path.basename(os.path.dirname(str(path))), os.path.basename(str(path)))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, str(path)).load()
            except ckpt.RefusedFile:
                raise
            except Exception as err:  # noqa: BLE001 - any malformed pickle: refused, named
                raise ckpt.refusal(str(path), f"a malformed pickle ({type(err).__name__}: {err})") from err
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise ckpt.refusal(str(path), f"a {type(metadata).__name__} where DCP metadata belongs")
        for info in metadata.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise ckpt.refusal(str(path), f"a storage entry naming {str(name)[:80]!r}, not a file of {shown}")
            if os.path.islink(os.path.join(str(self.path), name)):  # a link would read whatever it points at
                raise ckpt.refusal(str(path), f"a storage entry naming {name!r}, a symbolic link, not a file of "
                                              f"{shown}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor items loaded as plain data only."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

        item = ckpt.torch_load(value, f"{self.where} (item {read_item.dest_index.fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
        else:
            self.state_dict[read_item.dest_index.fqn] = item


def _behind(err: BaseException, kind: type):
    """The `kind` exception behind a failed DCP load or save (DCP gathers every rank's exception into
    one), or None."""
    if isinstance(err, kind):
        return err
    for exc, _trace in getattr(err, "failures", {}).values():
        if isinstance(exc, kind):
            return exc
    cause = err.__cause__ or err.__context__
    return _behind(cause, kind) if cause is not None else None


def _read(state: dict, ckpt_dir: str, **kwargs) -> None:
    """dcp.load of `state` from the checkpoint's DCP files, data only (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.path.join(ckpt_dir, SHARDED_DIR)
    # Checked here first: inside dcp.load a failed metadata read is logged with tracebacks and
    # re-raised as text, and DCP then tries per-rank metadata files.
    try:
        _SafeReader(path).read_metadata()
    except FileNotFoundError as err:
        raise ckpt.CheckpointError(f"{err.filename} is missing: "
                                   f"{ckpt_dir} is not a complete sharded checkpoint") from err
    try:
        dcp.load(state, storage_reader=_SafeReader(path), planner=_SafePlanner(path), **kwargs)
    except (CheckpointException, ckpt.RefusedFile) as err:
        refused = _behind(err, ckpt.RefusedFile)
        if refused is not None:
            raise ckpt.RefusedFile(str(refused)) from err
        raise


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _per_rank_keys(optim_sd: dict) -> list[str]:
    """Parameter names whose optimizer state is per rank: FRUGAL's coordinate projections on shards."""
    from frugal import projections as proj

    keys = []
    for group in optim_sd.get("param_groups", []):
        if group.get("projectable") and not group.get("always_state_free") \
                and group.get("projection") in proj.COORDINATE:
            keys += list(group["params"])
    return keys


def _state_dicts(model, optimizer) -> tuple[dict, dict, dict]:
    """(model state, optimizer state without the per-rank part, the per-rank part), FQN-keyed."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(model)
    # get_optimizer_state_dict gives a stateless optimizer without gradients one lr-0 step (torch's lazy
    # state init): the weights stay, but the step counter (every FRUGAL group) and window clock (first
    # group) would move. Restored, so checkpointing never changes a run.
    kept = [{k: copy.deepcopy(g[k]) for k in ("step", "clock") if k in g} for g in optimizer.param_groups]
    optim_sd = get_optimizer_state_dict(model, optimizer)
    if any(g.get(k) != v for g, saved in zip(optimizer.param_groups, kept) for k, v in saved.items()):
        for group, group_sd, saved in zip(optimizer.param_groups, optim_sd["param_groups"], kept):
            group.update(saved)
            group_sd.update(copy.deepcopy(saved))
        OptimizerHooks(optimizer).pop_events()  # nothing happened: drop what the lr-0 step reported
    per_rank = {k: optim_sd["state"].pop(k) for k in _per_rank_keys(optim_sd) if k in optim_sd["state"]}
    return model_sd, optim_sd, per_rank


def save(root: str, step: int, *, model, optimizer, trainer: dict | None, texts: dict, keep: int,
         accelerator) -> str | None:
    """Write checkpoint `step` of a sharded run (collective). `trainer` is the main process's
    trainer.pt content (None elsewhere). Returns the checkpoint's path on the main process."""
    import torch.distributed.checkpoint as dcp
    from accelerate.utils import broadcast_object_list, gather_object
    from torch.distributed.checkpoint.api import CheckpointException

    rank, main = accelerator.process_index, accelerator.is_main_process
    previous = ckpt.latest(root) if main else None
    tmp, error = None, None
    if main:
        tmp = ckpt.temporary_dir(root, step)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as err:
            error = ckpt._describe_write_error(err, tmp, previous)
    tmp, error, previous = broadcast_object_list([tmp, error, previous])  # every rank's error names it
    entries: dict = {}
    if error is None:
        model_sd, optim_sd, per_rank = _state_dicts(model, optimizer)
        path = os.path.join(tmp, SHARDED_DIR)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            mine = glob.glob(os.path.join(path, f"__{rank}_*")) + ([os.path.join(path, ".metadata")] if main else [])
            for file in mine:
                entries[os.path.relpath(file, tmp)] = ckpt.file_entry(file)
            if per_rank:
                path = os.path.join(tmp, rank_file(rank))
                entries[rank_file(rank)] = ckpt._write_file(path, per_rank)
        except (OSError, CheckpointException) as err:
            cause = _behind(err, OSError) or OSError(errno.EIO, str(err).splitlines()[0])
            error = ckpt._describe_write_error(cause, path.replace(tmp, os.path.join(root, ckpt.step_dir_name(step))),
                                               previous)
    reports = gather_object([(entries, error)])
    final = None
    if main:
        error = next((e for _, e in reports if e is not None), None)
        if error is None:
            written = {name: entry for part, _ in reports for name, entry in part.items()}
            try:
                final = ckpt.save(root, step, {"trainer": trainer}, texts=texts, keep=keep, written=(tmp, written))
            except ckpt.CheckpointError as err:
                error = str(err)
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    error = broadcast_object_list([error])[0]  # also the barrier: nobody moves on before it exists
    if error is not None:
        raise ckpt.CheckpointError(error)
    return final


def load(ckpt_dir: str, *, model, optimizer, step: int, rank: int, same_world_size: bool,
         hyperparameters: list[dict] | None = None) -> int:
    """Load a sharded checkpoint into a freshly built (sharded or not) model and optimizer
    (collective). `hyperparameters`: param-group settings that replace the checkpoint's (a named
    change on resume). Returns how many tensors' per-rank state started fresh (another process count)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    OptimizerHooks(optimizer).materialize_state(step)  # FRUGAL: which tensors hold state depends on the window
    model_sd, optim_sd, fresh = _state_dicts(model, optimizer)
    # Older checkpoints keep the step counter in the first group only; FRUGAL.load_state_dict shares it.
    for group_sd in optim_sd["param_groups"][1:]:
        group_sd.pop("step", None)
    _read({"model": model_sd, "optim": optim_sd}, ckpt_dir)
    set_model_state_dict(model, model_sd)
    if hyperparameters is not None:
        for saved, current in zip(optim_sd["param_groups"], hyperparameters):
            saved.update({k: v for k, v in current.items() if k not in ("params", "step")})
    reset = 0
    if fresh:
        path = os.path.join(ckpt_dir, rank_file(rank))
        if same_world_size and os.path.exists(path):
            optim_sd["state"].update(ckpt.torch_load(path, path, map_location="cpu", mmap=True))
        else:  # no state for them: their next step starts it afresh (frugal.state_management)
            reset = len(fresh)
    # strict=False: FRUGAL's state-free tensors own no state (torch's check expects every tensor to).
    set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(strict=False))
    return reset


def load_model(ckpt_dir: str, model) -> None:
    """Only the weights of a sharded checkpoint, into any model (eval.py: a whole model in one process)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    # Without a process group (one process) every rank's shards are read here; with one, it is collective.
    alone = not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _read(state, ckpt_dir, no_dist=alone)
    set_model_state_dict(model, state["model"])
