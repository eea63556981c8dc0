"""The density census: what the next step's window of a FRUGAL optimizer makes state-full
(`FRUGAL.density_report`, `FRUGAL.state_full_fraction`). It imports no optimizer module, so
`optimizer` depends on it one way; it reads the optimizer through its public methods (`next_roles`,
`block_ids`, `active_blocks`): the roles come from `frugal.windows`, as the step's do."""
from __future__ import annotations

import math
from collections import defaultdict

from . import projections as proj
from .windows import FULL


def _census(optimizer) -> tuple[int, int, int, float]:
    """(projectable elements, state-full ones next step, one selection unit, density asked)."""
    total = full = units = asked = 0
    block_sizes: dict = defaultdict(int)
    for t in optimizer.next_roles():
        group, p = t.group, t.param
        if not group["projectable"] or group["always_state_free"]:
            continue
        n = p.numel()
        total += n
        asked += group["density"] * n
        if group["projection"] == "block":
            block_sizes[t.block] += n
            full += n if t.role == FULL else 0
            continue
        shape = proj.reduced_shape(group["projection"], p.shape, group["transposed"], group["density"])
        full += math.prod(shape)
        if group["projection"] == "randk":
            units += 1
        elif group["projection"] in proj.MATRIX:  # one more rank: a column (row) of the state
            units += shape[0] if proj.matrix_side(p.shape, group["transposed"]) == "right" else shape[1]
        else:  # one more column (row): the elements across the other dimension
            units += n // p.shape[proj.coordinate_dim(group["projection"], p.shape, group["transposed"])]
    units += max(block_sizes.values(), default=0)
    return total, full, units, (asked / total if total else optimizer.defaults["density"])


def density_report(optimizer) -> dict:
    """The density asked for and the one realised in the next step's window (``FRUGAL.density_report``):
    ``requested`` (the ``density`` setting averaged over projectable elements); ``realised``, as the paper
    defines it: k / L state-full blocks for block projection (Appendix D), else the state-full share of
    projectable elements; ``unit``, the share one selection unit (block, column, row, element, rank) moves
    (more than half a unit off is worth a warning); ``state_full_share`` (``state_full_fraction()``);
    ``blocks``: ``[k, L]`` for block projection, else None."""
    total, full, units, asked = _census(optimizer)
    share = full / total if total else 0.0
    report = {"requested": asked, "realised": share, "unit": units / total if total else 0.0,
              "state_full_share": share, "blocks": None}
    blocks = optimizer.block_ids()
    blockwise = all(g["projection"] == "block" for g in optimizer.param_groups
                    if g["projectable"] and not g["always_state_free"])
    if blocks and blockwise:
        k, n = len(optimizer.active_blocks()), len(blocks)
        report.update(realised=k / n, unit=1 / n, blocks=[k, n])
    return report
