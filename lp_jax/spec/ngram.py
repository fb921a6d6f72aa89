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

from array import array

_W = array("i").itemsize  # bytes per token id in the searched buffer


def _aligned(buf: bytes, pat: bytes, end: int, *, last: bool) -> int:
    """Token index of the last (or first) occurrence of `pat` at a token boundary in
    buf[:end], or -1. bytes.find / rfind do the scan in C; a hit inside a token (not at
    a multiple of _W) is skipped."""
    lo, hi = 0, end
    while True:
        at = buf.rfind(pat, lo, hi) if last else buf.find(pat, lo, hi)
        if at < 0 or at % _W == 0:
            return at // _W if at >= 0 else -1
        if last:
            hi = at + len(pat) - 1
        else:
            lo = at + 1


def propose_ngram(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens continuing `token_ids`; [] when no n-gram of length in
    [min_n, max_n] ending the sequence occurs earlier in it. Pure Python (the scheduler
    core imports it): the search is a byte-string scan of the ids."""
    tokens = list(token_ids)
    L = len(tokens)
    buf = array("i", tokens).tobytes()
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pat = buf[(L - n) * _W:]
        # a match at i has k tokens after it if it ends by L - k; any, if by L - 1
        i = _aligned(buf, pat, (L - k) * _W, last=True) if L - k >= n else -1
        if i < 0:
            i = _aligned(buf, pat, (L - 1) * _W, last=False)
        if i >= 0:
            return tokens[i + n:i + n + k]
    return []
