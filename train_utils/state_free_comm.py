"""train.state_free_comm: how data parallelism communicates FRUGAL's state-free part.

`exact` (the default): DDP's own all-reduce of every gradient, and the sign of the mean (the paper's
algorithm). `vote`: frugal.comm's DDP communication hook: the state-free tensors' signs on the wire,
one bit each, and their majority vote; the state-full and split tensors keep the exact all-reduce;
the clipping norm never reads the votes (frugal/comm.py, docs/communication.md).

Refused in one line (at start-up, with the valid choices: validation.check_state_free_comm): FSDP2,
the step inside backward and optimizers not built on FRUGAL. On one process there is nothing to
communicate: the run is said to be exact's and is, bit for bit. A vote run says so in its run name,
its first lines, its summary and in metrics.jsonl (the start and end rows' `state_free_comm`; every
training row's bytes sent per rank by the hook, `comm_bytes_per_rank` and its parts).
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from .hooks import OptimizerHooks

MODES = ("exact", "vote")


def mode(cfg: DictConfig) -> str:
    return OmegaConf.select(cfg, "train.state_free_comm", default="exact")


def attach(run):
    """The vote's hook on the run's DDP model (frugal.comm.VoteHook), or None: `exact`, or one process
    (then it says that the vote is a no-op)."""
    if mode(run.cfg) != "vote":
        return None
    if run.world == 1:
        run.say("train.state_free_comm=vote on one process: nothing to communicate, so this run is exact's "
                "(the vote is a no-op)")
        return None
    from frugal.comm import attach_vote

    return attach_vote(run.model, run.optimizer)


def label(cfg: DictConfig, world_size: int) -> str:
    """The start and end rows' `state_free_comm`: exact, vote, or what a vote on one process is."""
    value = mode(cfg)
    if value == "vote" and world_size == 1:
        return "exact (vote requested: a no-op on one process)"
    return value


class VoteHooks(OptimizerHooks):
    """The optimizer's loop hooks, whose training-row metrics add the vote's counts of the last step:
    bytes sent per rank (all, exact all-reduce, packed signs), voted elements."""

    def __init__(self, hooks: OptimizerHooks, vote):
        super().__init__(hooks.optimizer)
        self.vote = vote

    def metrics(self) -> dict:
        stats = self.vote.last
        row = {"state_free_comm": "vote"}
        if stats is not None:
            row.update(comm_bytes_per_rank=stats.bytes_sent, comm_exact_bytes_per_rank=stats.exact_bytes,
                       comm_vote_bytes_per_rank=stats.vote_bytes + stats.norm_bytes,
                       comm_voted_elements=stats.voted_elements, comm_exact_elements=stats.exact_elements)
        return {**super().metrics(), **row}
