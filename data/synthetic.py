"""A seeded synthetic language whose best achievable loss is known exactly: data that downloads
nothing, needs no tokenizer, is learnable by a tiny model in minutes, and says how far the loss is
from the best possible.

A sparse second-order Markov chain over ``V`` symbols: every symbol ``b`` has ``successors`` possible
next symbols ``S(b)``; after the pair ``(a, b)`` comes one of ``branching`` members of ``S(b)``, with
probabilities drawn once from a Dirichlet(``alpha``). Its ``V * successors`` pair states have a
stationary distribution ``pi`` found by power iteration (on the lazy chain). Each row is a window of
the stationary chain (first pair drawn from ``pi``), so the optimal loss is ``H(X1 | X0)`` for the
first prediction and the entropy rate ``h = sum pi(pair) H(next | pair)`` for each later one;
``loss_floor`` averages them over a row's ``seq_len - 1`` predictions. Row ``g`` comes from an RNG
seeded by ``(language_seed, split, seed, g)``: random access, so resuming is exact by construction.
"""
from __future__ import annotations

import numpy as np

from .errors import DataConfigError
from .rows import Source

__all__ = ["MarkovLanguage", "SyntheticSource"]


def _entropy(p: np.ndarray, axis=-1) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=axis)


class MarkovLanguage:
    """The chain itself: transition tables, exact entropies, and vectorised sampling."""

    def __init__(self, vocab_size: int = 512, successors: int = 8, branching: int = 3,
                 alpha: float = 0.5, seed: int = 0):
        if not 2 <= branching <= successors <= vocab_size:
            raise DataConfigError(
                f"data: need 2 <= branching ({branching}) <= successors ({successors}) <= vocab_size ({vocab_size})")
        if alpha <= 0:
            raise DataConfigError(f"data.alpha must be > 0, got {alpha}")
        V, s, m = int(vocab_size), int(successors), int(branching)
        self.V, self.s, self.m = V, s, m
        rng = np.random.default_rng([int(seed), 1729])
        succ = np.argsort(rng.random((V, V)), axis=1)[:, :s]  # S(b): s distinct symbols
        n_pairs = V * s
        # Pair state p = a * s + j stands for the last two symbols (a, succ[a, j]).
        self.pair_first = np.repeat(np.arange(V), s)
        self.pair_second = succ.reshape(-1)
        choice = np.argsort(rng.random((n_pairs, s)), axis=1)[:, :m]  # which members of S(b) may follow
        probs = rng.dirichlet(np.full(m, float(alpha)), size=n_pairs)
        b = self.pair_second
        self.next_pair = b[:, None] * s + choice  # (n_pairs, m)
        self.next_token = succ[b[:, None], choice]  # (n_pairs, m)
        self.probs = probs
        self.cum = np.cumsum(probs, axis=1)
        self.cum[:, -1] = 1.0
        self.pi = self._stationary()
        self.pi_cum = np.cumsum(self.pi)
        self.pi_cum[-1] = 1.0

        # Exact entropies (nats).
        self.pair_entropy = _entropy(probs)  # H(next | pair)
        self.entropy_rate = float(np.dot(self.pi, self.pair_entropy))
        first = np.bincount(self.pair_first, weights=self.pi, minlength=V)
        self.unigram_entropy = float(_entropy(first))  # H(X0) under the stationary marginal
        self.first_step_entropy = float(_entropy(self.pi) - self.unigram_entropy)  # H(X1 | X0)

    def _stationary(self, tol: float = 1e-14, max_iter: int = 200_000) -> np.ndarray:
        n = self.next_pair.shape[0]
        pi = np.full(n, 1.0 / n)
        flat_next = self.next_pair.reshape(-1)
        for _ in range(max_iter):
            moved = np.bincount(flat_next, weights=(pi[:, None] * self.probs).reshape(-1), minlength=n)
            new = 0.5 * pi + 0.5 * moved
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise RuntimeError("the stationary distribution did not converge")

    def loss_floor(self, seq_len: int) -> float:
        """Expected loss of the true model per predicted token of a row of seq_len symbols."""
        return (self.first_step_entropy + (seq_len - 2) * self.entropy_rate) / (seq_len - 1)

    def sample(self, uniforms: np.ndarray) -> np.ndarray:
        """Rows from uniforms of shape (B, L): row i is a deterministic function of uniforms[i]."""
        B, L = uniforms.shape
        out = np.empty((B, L), dtype=np.int64)
        pair = np.minimum(np.searchsorted(self.pi_cum, uniforms[:, 0], side="right"), len(self.pi) - 1)
        out[:, 0] = self.pair_first[pair]
        if L > 1:
            out[:, 1] = self.pair_second[pair]
        for t in range(2, L):
            k = np.minimum((uniforms[:, t, None] >= self.cum[pair]).sum(axis=1), self.m - 1)
            out[:, t] = self.next_token[pair, k]
            pair = self.next_pair[pair, k]
        return out


class SyntheticSource(Source):
    """Rows of ``seq_len`` symbols from :class:`MarkovLanguage`; no padding, no tokenizer."""

    name = "synthetic"
    CHUNK = 64  # validation rows generated together (vectorised over rows)
    TRAIN_CHUNK = 16  # per reader: one process may serve many readers, each starting with one chunk

    def __init__(self, seq_len: int, vocab_size: int = 512, successors: int = 8, branching: int = 3,
                 alpha: float = 0.5, language_seed: int = 0):
        self.language = MarkovLanguage(vocab_size, successors, branching, alpha, language_seed)
        self.language_seed, self.alpha = int(language_seed), float(alpha)
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.loss_floor = self.language.loss_floor(self.seq_len)
        self.entropy_rate = self.language.entropy_rate
        self.unigram_entropy = self.language.unigram_entropy
        self.pad_id, self.eos_id = 0, None
        self.rows = {"seq_len": self.seq_len, "truncation": None}  # complete windows of the chain

    def identity(self) -> dict:
        lang = self.language
        return {"name": self.name, "vocab_size": self.vocab_size, "successors": lang.s, "branching": lang.m,
                "alpha": self.alpha, "language_seed": self.language_seed}

    def sample_rows(self, split: int, seed: int, indices: np.ndarray) -> np.ndarray:
        u = np.stack([np.random.default_rng([self.language_seed, split, seed, int(g)]).random(self.seq_len)
                      for g in indices])
        return self.language.sample(u)

    def train_docs(self, reader, n_readers, seed, start, max_tokens):
        j = int(start[1])
        while True:
            local = np.arange(j, j + self.TRAIN_CHUNK)
            for i, row in zip(local, self.sample_rows(0, seed, reader + local * n_readers)):
                yield [0, int(i), 0], row, [0, int(i) + 1, 0]
            j += self.TRAIN_CHUNK

    def val_docs(self, max_tokens):
        # Validation rows ignore the training seed: every run evaluates on the same rows.
        j = 0
        while True:
            yield from self.sample_rows(1, 0, np.arange(j, j + self.CHUNK))
            j += self.CHUNK
