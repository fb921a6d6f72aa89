"""The n-gram draft (prompt lookup): no model, a scan of the sequence's own tokens.

The last n tokens of a sequence are searched for earlier in it, longest n first
(prompt_lookup_max down to prompt_lookup_min); the tokens that followed the match are
the draft. Of several matches the latest with a full k tokens after it wins (recent
text predicts best), else the earliest (the longest draft there is). Text that repeats
what the prompt holds (a summary quoting its source, code edited in place, a story
retold) gets long accepted runs; text that does not gets no draft, and its step is an
ordinary decode.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens continuing `token_ids`; [] when no n-gram of length in
    [min_n, max_n] ending the sequence occurs earlier in it."""
    tokens_L = np.asarray(token_ids, dtype=np.int64)
    L = tokens_L.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows of the first L - 1 tokens: a match at i has a token after it (i + n < L)
        windows_WN = sliding_window_view(tokens_L[:-1], n)
        starts_M = np.flatnonzero((windows_WN == tokens_L[L - n:]).all(axis=1))
        if starts_M.size:
            full_M = starts_M[starts_M + n + k <= L]
            i = int(full_M[-1] if full_M.size else starts_M[0])
            return tokens_L[i + n:i + n + k].tolist()
    return []
