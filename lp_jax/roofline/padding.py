"""Rows a grouped (ragged) matmul really computes once each expert's rows are tile-padded.

Design note. A grouped matmul over experts (megablocks / ragged_dot / a Pallas kernel)
processes each active expert's rows in tiles of `tile` rows (128 on TPU MXUs and Hopper
wgmma tiles is typical). An expert that received n rows costs ceil(n / tile) * tile
rows of compute; an expert with no rows costs nothing. With n_e ~ Binomial(T, p_e)
(independent tokens, inclusion probability p_e from `routing`),

    padded(T) = sum_e E[ceil(n_e / tile) * tile],   useful(T) = k * T.

The waste padded - useful dominates at small chunks: 512 tokens x top-8 over 128
experts is 32 rows per expert, so a 128-row tile wastes ~3/4 of the MXU work. We sum the
binomial pmf exactly over a +-12 sigma window per expert (pmf renormalised on the window).
Local axis letters (beyond docs/glossary.md): W = that window of row counts, U = the
distinct inclusion probabilities (uniform routing needs one evaluation, not E).
"""

from __future__ import annotations

import math

import numpy as np


def _padded_rows_one_expert(p: float, tokens: int, tile: int) -> float:
    if p <= 0.0 or tokens == 0:
        return 0.0
    if p >= 1.0:
        return float(math.ceil(tokens / tile) * tile)
    mean = tokens * p
    sd = math.sqrt(tokens * p * (1.0 - p))
    lo = max(0, math.floor(mean - 12.0 * sd - 2.0))
    hi = min(tokens, math.ceil(mean + 12.0 * sd + 2.0))
    n_W = np.arange(lo, hi + 1, dtype=np.float64)
    log_c0 = math.lgamma(tokens + 1) - math.lgamma(lo + 1) - math.lgamma(tokens - lo + 1)
    steps_W = np.log(tokens - n_W[:-1]) - np.log(n_W[:-1] + 1.0)
    log_c_W = log_c0 + np.concatenate(([0.0], np.cumsum(steps_W)))
    log_pmf_W = log_c_W + n_W * math.log(p) + (tokens - n_W) * math.log1p(-p)
    pmf_W = np.exp(log_pmf_W - log_pmf_W.max())
    pmf_W /= pmf_W.sum()
    padded_W = np.ceil(n_W / tile) * tile
    return float(np.dot(pmf_W, padded_W))


def expected_padded_rows(p_E: np.ndarray, tokens: int, tile: int) -> float:
    """Expected rows computed by a tile-padded grouped matmul for `tokens` tokens.

    `p_E` are per-expert inclusion probabilities (see `routing`); `tile` = 1 means no
    padding and returns the useful rows k * T exactly.
    """
    if tile < 1:
        raise ValueError("tile must be >= 1")
    if tokens < 0 or int(tokens) != tokens:
        raise ValueError("tokens must be a non-negative integer")
    tokens = int(tokens)
    p_E = np.asarray(p_E, dtype=np.float64)
    if tile == 1:
        return float(p_E.sum() * tokens)
    values_U, counts_U = np.unique(p_E, return_counts=True)
    pairs = zip(values_U, counts_U, strict=True)
    return float(sum(c * _padded_rows_one_expert(float(p), tokens, tile) for p, c in pairs))
