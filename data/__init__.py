"""Everything the training loop eats besides the optimizer: ``build_data(cfg, ...) -> DataModule``.

Sources (``cfg.name``): ``c4``, ``local``, ``synthetic`` and ``tokens``; the contract and rows in
``data/rows.py``, batches, readers and exact resume in ``data/stream.py``; docs/data_pipeline.md.
Expected problems raise ``DataConfigError`` (a ValueError; ``DataFileNotFoundError`` is also a
FileNotFoundError).
"""
from __future__ import annotations

from typing import Any, Mapping

from .errors import DataConfigError, DataFileNotFoundError
from .rows import TRUNCATIONS, Source
from .stream import AUTO_WORKERS, DEFAULT_READERS, DataModule, auto_workers, merge_states
from .tokenizer import TokenizerInfo, load_tokenizer

__all__ = ["build_data", "build_source", "DataModule", "DataConfigError", "DataFileNotFoundError", "Source",
           "AUTO_WORKERS", "auto_workers",
           "SOURCES", "TRUNCATIONS", "load_tokenizer", "merge_states"]

SOURCES = ("c4", "local", "synthetic", "tokens")

# Each source's settings when a mapping leaves them out; configs/data/<source>.yaml states the same values
# (test_yaml_files_state_the_code_defaults), except num_workers: 0 here, the runs' worker counts there.
_COMMON = {"seq_len": 256, "packing": False, "truncation": "reference", "readers": DEFAULT_READERS,
           "num_workers": 0, "pin_memory": "auto", "shuffle": True}
DEFAULTS = {
    "c4": {**_COMMON, "vocab_from": "model", "shuffle_window": 1024},
    "local": {**_COMMON, "packing": True, "vocab_from": "tokenizer", "text_field": "text", "val_stride": 100},
    "synthetic": {**{k: v for k, v in _COMMON.items() if k != "shuffle"},  # a generated language: no order
                  "vocab_size": 512, "successors": 8, "branching": 3, "alpha": 0.5, "language_seed": 0},
    "tokens": dict(_COMMON),
}


def _get(cfg, key, defaults: bool = True):
    """``cfg[key]``, or the source's default when the mapping leaves it out (or sets null)."""
    value = cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)
    if value is None and defaults:
        return DEFAULTS.get(_get(cfg, "name", defaults=False), {}).get(key)
    return value


def _source_name(cfg) -> str:
    name = _get(cfg, "name")
    if name not in SOURCES:
        raise DataConfigError(f"data.name={name!r} is not a data source; valid choices: {list(SOURCES)}")
    return name


def build_source(cfg: Mapping[str, Any], *, model_vocab_size: int | None = None) -> Source:
    """The document source named by ``cfg.name`` (no batching, no rank logic)."""
    name = _source_name(cfg)
    seq_len = int(_get(cfg, "seq_len"))
    if name == "synthetic":
        from .synthetic import SyntheticSource

        src = SyntheticSource(seq_len, vocab_size=int(_get(cfg, "vocab_size")), successors=int(_get(cfg, "successors")),
                              branching=int(_get(cfg, "branching")), alpha=float(_get(cfg, "alpha")),
                              language_seed=int(_get(cfg, "language_seed")))
        if model_vocab_size is not None and src.vocab_size > model_vocab_size:
            raise DataConfigError(f"synthetic vocab_size {src.vocab_size} > model vocab {model_vocab_size}")
        return src
    if name == "tokens":
        from .token_files import TokenSource

        return TokenSource(_get(cfg, "path"), model_vocab_size=model_vocab_size,
                           shuffle=bool(_get(cfg, "shuffle")))
    # c4 and local: check the data path before loading a tokenizer, the likelier mistake.
    path = _get(cfg, "path")
    if name == "local":
        from .local import find_files

        find_files(path)
    elif path is not None:
        from .c4 import c4_files

        c4_files(path, "train")
    tok = load_tokenizer(_get(cfg, "tokenizer"))
    # Your own text gets the tokenizer's vocabulary by default, C4 the model's (DEFAULTS).
    info = TokenizerInfo(tok, model_vocab_size, vocab_from=str(_get(cfg, "vocab_from")))
    if name == "local":
        from .local import LocalSource

        return LocalSource(path, tok, info, text_field=str(_get(cfg, "text_field")),
                           val_stride=_get(cfg, "val_stride"), shuffle=bool(_get(cfg, "shuffle")))
    from .c4 import C4Source

    return C4Source(path, tok, info, shuffle=bool(_get(cfg, "shuffle")),
                    shuffle_window=_get(cfg, "shuffle_window"))


def build_data(cfg: Mapping[str, Any], *, micro_batch_size: int, rank: int = 0, world_size: int = 1,
               seed: int = 0, model_vocab_size: int | None = None,
               max_positions: int | None = None, eval_mode: str = "tokens") -> DataModule:
    """Build this rank's DataModule from one ``configs/data/*.yaml`` node.

    Token ids stay below ``model_vocab_size`` unless the data decides the vocabulary; a ``seq_len``
    over ``max_positions`` is refused here, not mid-run. ``seed`` drives the training order only.
    ``eval_mode``: eval.mode (data/stream.py, EVAL_MODES).
    """
    _source_name(cfg)
    seq_len = int(_get(cfg, "seq_len"))
    if max_positions is not None and seq_len > int(max_positions):
        raise DataConfigError(
            f"data.seq_len={seq_len} is longer than the model's max_position_embeddings={max_positions}; "
            "lower data.seq_len or use a model config with more positions")
    source = build_source(cfg, model_vocab_size=model_vocab_size)
    return DataModule(source, micro_batch_size=micro_batch_size, seq_len=seq_len, packing=bool(_get(cfg, "packing")),
                      truncation=str(_get(cfg, "truncation")), readers=_get(cfg, "readers"),
                      num_workers=_get(cfg, "num_workers"),
                      pin_memory=_get(cfg, "pin_memory"), rank=rank, world_size=world_size, seed=seed,
                      eval_mode=eval_mode)
