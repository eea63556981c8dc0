"""Everything the training loop eats besides the optimizer: ``build_data(cfg, ...) -> DataModule``.

Sources (``cfg.name``): ``c4`` (Hub or local shards, T5 tokenizer), ``local`` (your .txt/.jsonl/
.json.gz files), ``synthetic`` (a seeded Markov language with a known loss floor; the quickstart
default) and ``tokens`` (pre-tokenized files from ``scripts/pretokenize.py``). ``data/rows.py`` says
what a source gives and how documents become rows, ``data/stream.py`` how batches, logical readers
and exact resume work for all of them; docs/data_pipeline.md has the whole picture.

Expected problems (a bad path, value or tokenizer, an unreachable Hub, an empty validation set) are
raised as ``DataConfigError`` (a ValueError; ``DataFileNotFoundError`` is also a FileNotFoundError).
"""
from __future__ import annotations

from typing import Any, Mapping

from .errors import DataConfigError, DataFileNotFoundError
from .rows import TRUNCATIONS, Source
from .stream import DEFAULT_READERS, DataModule, merge_states
from .tokenizer import TokenizerInfo, load_tokenizer

__all__ = ["build_data", "build_source", "DataModule", "DataConfigError", "DataFileNotFoundError", "Source",
           "SOURCES", "TRUNCATIONS", "load_tokenizer", "merge_states"]

SOURCES = ("c4", "local", "synthetic", "tokens")


def _get(cfg, key, default=None):
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None and default is not None else value


def _source_name(cfg) -> str:
    name = _get(cfg, "name")
    if name not in SOURCES:
        raise DataConfigError(f"data.name={name!r} is not a data source; valid choices: {list(SOURCES)}")
    return name


def build_source(cfg: Mapping[str, Any], *, model_vocab_size: int | None = None) -> Source:
    """The document source named by ``cfg.name`` (no batching, no rank logic)."""
    name = _source_name(cfg)
    seq_len = int(_get(cfg, "seq_len", 256))
    if name == "synthetic":
        from .synthetic import SyntheticSource

        src = SyntheticSource(
            seq_len,
            vocab_size=int(_get(cfg, "vocab_size", 512)),
            successors=int(_get(cfg, "successors", 8)),
            branching=int(_get(cfg, "branching", 3)),
            alpha=float(_get(cfg, "alpha", 0.5)),
            language_seed=int(_get(cfg, "language_seed", 0)),
        )
        if model_vocab_size is not None and src.vocab_size > model_vocab_size:
            raise DataConfigError(f"synthetic vocab_size {src.vocab_size} > model vocab {model_vocab_size}")
        return src
    if name == "tokens":
        from .token_files import TokenSource

        return TokenSource(_get(cfg, "path"), model_vocab_size=model_vocab_size,
                           shuffle=bool(_get(cfg, "shuffle", True)))
    # c4 and local: check the data path before loading a tokenizer, the likelier mistake.
    path = _get(cfg, "path")
    if name == "local":
        from .local import find_files

        find_files(path)
    elif path is not None:
        from .c4 import c4_files

        c4_files(path, "train")
    tok = load_tokenizer(_get(cfg, "tokenizer"))
    # Defaults as in configs/data/{local,c4}.yaml: your own text gets the tokenizer's vocabulary.
    info = TokenizerInfo(tok, model_vocab_size,
                         vocab_from=str(_get(cfg, "vocab_from", "tokenizer" if name == "local" else "model")))
    if name == "local":
        from .local import LocalSource

        return LocalSource(path, tok, info, text_field=str(_get(cfg, "text_field", "text")),
                           val_stride=_get(cfg, "val_stride", 100), shuffle=bool(_get(cfg, "shuffle", True)))
    from .c4 import C4Source

    return C4Source(path, tok, info, shuffle=bool(_get(cfg, "shuffle", True)),
                    shuffle_window=_get(cfg, "shuffle_window", 1024))


def build_data(cfg: Mapping[str, Any], *, micro_batch_size: int, rank: int = 0, world_size: int = 1,
               seed: int = 0, model_vocab_size: int | None = None,
               max_positions: int | None = None) -> DataModule:
    """Build this rank's DataModule from one ``configs/data/*.yaml`` node.

    ``model_vocab_size``: the model's embedding size; token ids are guaranteed below it (T5 sentinel
    ids are mapped to unk; an incompatible tokenizer raises) unless the data decides the vocabulary
    (``DataModule.vocab_size``: the synthetic language, ``data.vocab_from=tokenizer``).
    ``max_positions``: the model's position limit; a longer ``seq_len`` is refused here rather than
    as an index error mid-run. ``seed`` drives the training order (file order, windows,
    permutations); validation never depends on it.
    """
    _source_name(cfg)
    seq_len = int(_get(cfg, "seq_len", 256))
    if max_positions is not None and seq_len > int(max_positions):
        raise DataConfigError(
            f"data.seq_len={seq_len} is longer than the model's max_position_embeddings={max_positions}; "
            "lower data.seq_len or use a model config with more positions"
        )
    source = build_source(cfg, model_vocab_size=model_vocab_size)
    return DataModule(source, micro_batch_size=micro_batch_size, seq_len=seq_len,
                      packing=bool(_get(cfg, "packing", source.name == "local")),  # as in the yaml files
                      truncation=str(_get(cfg, "truncation", "reference")),
                      readers=_get(cfg, "readers", DEFAULT_READERS), num_workers=_get(cfg, "num_workers", 0),
                      pin_memory=_get(cfg, "pin_memory", "auto"), rank=rank, world_size=world_size, seed=seed)
