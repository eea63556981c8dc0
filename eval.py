"""Validation loss and perplexity of a checkpoint.

    python eval.py checkpoint=<checkpoint dir or run dir> [data=<option>] [data.path=...]
                   [train.eval_tokens=N] [train.micro_batch_size=N] [train.precision=fp32] [eval.mode=authors]
                   [out=<file>]

Arguments have the training command line's key=value form, but the base config is the checkpoint's
own (its resolved config.yaml), so the model is rebuilt exactly as trained. `data=<option>` swaps in a
data config from configs/data/; dotted keys override existing values. A run directory means its
latest checkpoint. Prints one JSON object {"val_loss", "val_ppl", "val_tokens", "step", ...} and writes
it to <checkpoint>/eval.json (or out=); progress goes to stderr. The loss is train.py's evaluation
(token-weighted, same validation set and code); `eval.mode=authors` evaluates as the paper's code did
(C4 only; data/stream.py, EVAL_MODES). Runs under torchrun too (the ranks split the validation set);
a sharded (fsdp) checkpoint is read whole into each process, on any number of processes.

Exit codes: 0 done; 2 bad arguments (a mistyped key, section, argument or data option is named with
the valid ones and the closest), or a missing or damaged checkpoint (verified against its manifest; a
run directory falls back to its newest intact one).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from accelerate import Accelerator
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

import data
import models
from frugal.checks import check_integer
from train_utils import checkpoint as ckpt
from train_utils.report import EvalProgress
from train_utils.schema import (bad_group_choice, closest, did_you_mean, group_option_error, group_options,
                                 unknown_key_line)
from train_utils.validation import ConfigError, check_precision, resolve_precision
from train_utils.loop import evaluate
from train_utils.resume import choose_checkpoint

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
SWAPPABLE_GROUPS = ("data",)  # the model must stay the one trained; optimizer/schedule play no part
OWN_ARGUMENTS = ("checkpoint", "out")  # eval.py's own; every other argument sets the checkpoint's config
_ABSENT = object()


def check_argument_names(argv: list[str]) -> None:
    """A top-level argument is checkpoint=, out= or data=; any other must be a dotted key (checked
    against the checkpoint's config by `load_config`). Checked before the checkpoint is looked for, so
    that `chekpoint=...` is named as the typo it is rather than reported as a missing checkpoint."""
    valid = [*OWN_ARGUMENTS, *SWAPPABLE_GROUPS]
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if sep and "." not in key and key not in valid:
            raise ConfigError(f"unknown argument {arg!r}{did_you_mean(closest(key, valid))}; valid arguments: "
                              f"checkpoint=<checkpoint dir or run dir>, out=<file>, data=<option>, or "
                              f"<section>.<key>=<value> of the checkpoint's config (e.g. train.eval_tokens=100000)")


def check_group_option(group: str, option: str) -> None:
    """`data=<option>` names a file of configs/<group>/ (one line with the closest option, where
    Hydra's own error would list the options over several lines)."""
    if option not in group_options(group):
        raise ConfigError(group_option_error(group, option))


def unknown_key_message(cfg: DictConfig, arg: str) -> str:
    """`arg`'s key is not in the checkpoint's config: name its first missing part, the valid keys of
    the node above it and the closest one."""
    parts = arg.partition("=")[0].split(".")
    node, depth = cfg, 0
    while depth < len(parts) - 1 and isinstance(node.get(parts[depth]), DictConfig):
        node, depth = node[parts[depth]], depth + 1
    parent, missing = ".".join(parts[:depth]), parts[depth]
    valid = [str(k) for k in node.keys()]
    near = closest(missing, valid)
    if not parent:  # a section the checkpoint's config does not have: suggest the key under the closest one
        hint = did_you_mean(".".join([near, *parts[1:]]) if near else None)
        return (f"unknown argument {arg!r}: the checkpoint's config has no section {missing!r}{hint}; "
                f"valid sections: {', '.join(valid)}")
    if missing in node:  # the key is a value, and the argument goes below it
        return f"unknown argument {arg!r}: {parent}.{missing} is a value, not a section"
    return f"unknown argument {arg!r}: " + unknown_key_line(f"{parent}.{missing}", valid,
                                                             "a key of the checkpoint's config")


class EvalLines:
    """The data module as `evaluate` sees it, with a line on stderr at each quarter of the validation
    batches: where stderr is not a terminal (a log file, a pipe) a bar's redraws would be one long line."""

    def __init__(self, dm):
        self._dm = dm

    def __getattr__(self, name):
        return getattr(self._dm, name)

    def val_batches(self, eval_tokens: int):
        batches = self._dm.val_batches(eval_tokens)
        n, started = len(batches), time.perf_counter()
        quarters = {math.ceil(n * q / 4) for q in range(1, 5)}
        for i, batch in enumerate(batches, 1):
            yield batch  # back here once `evaluate` has scored it
            if i in quarters:
                print(f"evaluated {i}/{n} batches ({i / n:.0%}) in {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)


def with_progress(dm, main_process: bool):
    """What `evaluate` reads: on the main process a bar on a terminal (train.py's), a few lines
    otherwise; stdout stays the one JSON object."""
    if not main_process:
        return dm
    return EvalProgress(dm, enabled=True) if sys.stderr.isatty() else EvalLines(dm)


def load_config(ckpt_dir: str, overrides: list[str]):
    """The checkpoint's resolved config with `overrides` applied (see the module docstring)."""
    cfg = OmegaConf.load(os.path.join(ckpt_dir, "config.yaml"))
    if OmegaConf.select(cfg, "eval.mode", default=None) is None:  # a checkpoint from before eval.mode existed
        cfg = OmegaConf.merge(cfg, {"eval": {"mode": "tokens"}})
    groups = [o for o in overrides if o.partition("=")[0] in SWAPPABLE_GROUPS]
    for o in groups:
        check_group_option(*o.split("=", 1))
    if groups:  # let Hydra compose the option (its defaults lists)
        try:
            with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
                fresh = compose(config_name="config", overrides=groups)
        except HydraException as err:  # e.g. an unknown option: Hydra's message lists the available ones
            raise ConfigError(str(err)) from err
        for o in groups:
            group = o.partition("=")[0]
            # Unresolved, so interpolations like ${model.tokenizer} refer to the checkpoint's model.
            cfg[group] = OmegaConf.create(OmegaConf.to_container(fresh[group], resolve=False))
    for o in overrides:
        key, sep, value = o.partition("=")
        if key in SWAPPABLE_GROUPS:
            continue
        if not sep:
            raise ConfigError(f"unknown argument {o!r}: expected key=value with a key of the checkpoint's "
                              f"config (e.g. train.eval_tokens=100000), data=<option> or out=<file>")
        if OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(unknown_key_message(cfg, o))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o]))
    check_precision(cfg.train.precision, allow_auto=True)
    check_integer("train.eval_tokens", cfg.train.eval_tokens, 1, error=ConfigError)  # as train.py checks it
    return cfg


def main(argv: list[str]) -> dict:
    check_argument_names(argv)
    args = dict(a.split("=", 1) for a in argv if a.startswith(("checkpoint=", "out=")))
    overrides = [a for a in argv if not a.startswith(("checkpoint=", "out="))]
    bad_choice = bad_group_choice(overrides)
    if bad_choice:
        raise ConfigError(bad_choice)
    if "checkpoint" not in args:
        raise ConfigError("missing checkpoint=<checkpoint dir or run dir>")
    # Verified against its manifest; a run dir means its newest intact checkpoint.
    ckpt_dir, notes = choose_checkpoint(args["checkpoint"], None, key="checkpoint")
    for note in notes:
        print(note, file=sys.stderr)
    cfg = load_config(ckpt_dir, overrides)

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
    tc = cfg.train
    tc.precision = resolve_precision(tc.precision, accelerator.device)  # train.precision=auto given here
    try:  # e.g. data=c4 offline without a local tokenizer, or a data.path that does not exist
        dm = data.build_data(cfg.data, micro_batch_size=tc.micro_batch_size, rank=accelerator.process_index,
                             world_size=accelerator.num_processes, seed=tc.seed,
                             model_vocab_size=cfg.model.vocab_size,
                             max_positions=cfg.model.max_position_embeddings, eval_mode=cfg.eval.mode)
    except data.DataConfigError as err:
        raise ConfigError(str(err)) from err
    model = models.build_model(cfg.model, vocab_size=dm.vocab_size)
    if tc.precision == "bf16":
        model.to(torch.bfloat16)
    if ckpt.is_sharded(ckpt_dir):  # written by an FSDP2 run: its shards, gathered whole here
        from train_utils import sharded_checkpoint  # torch.distributed.checkpoint: only for such a checkpoint

        sharded_checkpoint.load_model(ckpt_dir, model)
    else:
        model.load_state_dict(ckpt.load(ckpt_dir, "model"))
    model.to(accelerator.device)
    step = int(ckpt.load(ckpt_dir, "trainer")["step"])
    if accelerator.is_main_process:
        share = f" (split over {accelerator.num_processes} processes)" if accelerator.num_processes > 1 else ""
        print(f"evaluating {os.path.abspath(ckpt_dir)} (step {step}) on {tc.eval_tokens:,} validation tokens of "
              f"{cfg.data.name}{share}, {accelerator.device}, {tc.precision}", file=sys.stderr, flush=True)
    result = evaluate(model, with_progress(dm, accelerator.is_main_process), tc.eval_tokens, tc.precision,
                      accelerator)
    result.update(step=step, checkpoint=os.path.abspath(ckpt_dir),
                  model=cfg.model.name, data=cfg.data.name, precision=tc.precision, eval_tokens=tc.eval_tokens,
                  eval_mode=cfg.eval.mode,
                  loss_floor=dm.loss_floor)
    if accelerator.is_main_process:
        text = json.dumps(result)
        print(text)
        with open(args.get("out", os.path.join(ckpt_dir, "eval.json")), "w") as f:
            f.write(text + "\n")
    accelerator.end_training()  # destroy the process group before exit (see train.py)
    return result


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, ckpt.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
