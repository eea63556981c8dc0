"""train.state_free_comm: how data parallelism communicates FRUGAL's state-free part.

`exact` (default): DDP's all-reduce and the sign of the mean (the paper). `vote`: frugal.comm's DDP
hook sends the state-free tensors' signs, one bit each, and takes their majority; the rest keep the
exact all-reduce; the clipping norm never reads the votes (docs/communication.md). Refused at start-up
(validation.check_state_free_comm) with FSDP2, the step inside backward and non-FRUGAL optimizers.
On one process a run is exact's, bit for bit. A vote run says so in its name, first lines, summary and
metrics.jsonl (`state_free_comm`; each training row's `comm_bytes_per_rank`).
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
