"""Hydra's basic sweeper, with the command line winning over a preset's sweep of the same key.

A preset sweeps with `hydra.sweeper.params` (`optimizer.update_gap: 10,20,50,...`); the command line
may sweep the same key again to narrow it (`-m experiment=table15_update_gap optimizer.update_gap=10,20`:
two jobs). Hydra's BasicSweeper keys its sweep on the override's text, prefix included, and train.py
writes a plain key override that some option of its group does not declare as a force-add
(`++optimizer.update_gap=10,20`, so that a mistyped key gets the project's one-line error:
`train_utils.schema.force_add_key_overrides`). To the basic sweeper the two are different keys, and it
ran their product (14 jobs, each with the command line's value). This sweeper keys on the bare key
(`+`/`++` set aside): the later override, the command line's, replaces the preset's in place, so the
jobs keep the numbering the preset's order gives. Everything else is the basic sweeper's.

It imports neither torch nor the repository's packages: Hydra imports it whenever it scans its plugins.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException


def bare_key(override: Override) -> str:
    """The key an override sets, without the `+` / `++` of a (force-)add."""
    return override.get_key_element().lstrip("+")


class CommandLineWinsSweeper(BasicSweeper):
    @staticmethod
    def split_arguments(overrides: List[Override], max_batch_size: Optional[int]) -> List[List[List[str]]]:
        """BasicSweeper.split_arguments with one entry per bare key (the last override of a key wins,
        at the place of its first)."""
        final: "OrderedDict[str, list[str]]" = OrderedDict()
        for override in overrides:
            key = override.get_key_element()
            if override.is_sweep_override():
                if not override.is_discrete_sweep():
                    raise HydraException(f"{CommandLineWinsSweeper.__name__} does not support sweep type: "
                                         f"{override.value_type.name if override.value_type else None}")
                final[bare_key(override)] = [f"{key}={value}" for value in override.sweep_string_iterator()]
            else:
                final[bare_key(override)] = [f"{key}={override.get_value_element_as_str()}"]
        jobs = [list(job) for job in itertools.product(*final.values())]
        if max_batch_size is None:
            return [jobs]
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))
