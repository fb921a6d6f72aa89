"""A plan's prefill token budget: one count, or one count per data rank.

Under data-parallel attention (dp_placement.py) every rank runs the same rows in a step
(SPMD), so a step costs what its busiest rank's rows cost. With one budget for all ranks
a rank's long prompt can take all of it while the other ranks pad, and one rank's bucket
must hold the whole budget. A policy that declares `rank_budgets` (orca, chunked,
layered) gets `max_num_batched_tokens` on each rank instead, as each engine core of
vLLM's data-parallel deployment has its own: a rank's budget holds its own sequences'
chunks (and its decode rows, for a policy whose decodes count against the budget), so
the ranks prefill side by side, each up to its budget.

A waiting sequence has no rank until it is admitted; `ranks(seq)` names the ranks its
first chunk may go to, and the placement rule chooses among them as it always does
(prefix affinity, then load: dp_placement.RankedBlockManager.place). With one rank, or a
policy without rank budgets, the budget is a single count, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable

from lp_jax.core.sequence import Sequence


class PrefillBudget:
    """Tokens left to the plan being made, per rank (`left_R`), and tokens taken.

    `rank_of(seq)`: the rank an admitted sequence's pages are on; `uncached(seq, r)`: the
    prompt tokens a waiting sequence would compute if placed on rank r (its cached prefix
    there excluded)."""

    def __init__(self, left_R: list[int], rank_of: Callable[[Sequence], int],
                 uncached: Callable[[Sequence, int], int]) -> None:
        self.left_R = [max(0, n) for n in left_R]
        self.taken_R = [0] * len(left_R)
        self._rank_of = rank_of
        self._uncached = uncached

    def left(self, seq: Sequence) -> int:
        """Tokens left on an admitted sequence's rank."""
        return self.left_R[self._rank_of(seq)]

    def take(self, seq: Sequence, n: int) -> None:
        """Charges n prompt tokens of an admitted sequence to its rank (a whole prompt
        may take more than is left: the rank then has none)."""
        r = self._rank_of(seq)
        self.left_R[r] = max(0, self.left_R[r] - n)
        self.taken_R[r] += n

    def any_left(self) -> bool:
        return any(self.left_R)

    def ranks(self, seq: Sequence | None = None) -> tuple[int, ...]:
        """The ranks a waiting sequence's first chunk may go to. Without seq: every rank
        with tokens left (a chunk may be cut to fit). With seq, for a policy that cuts
        prompts only when they open a batch: the ranks its uncached prompt fits whole, and
        the ranks with tokens left that have taken nothing yet (a prompt longer than what
        is left there opens the rank's share alone)."""
        if seq is None:
            return tuple(r for r, n in enumerate(self.left_R) if n)
        return tuple(r for r, n in enumerate(self.left_R)
                     if n and (not self.taken_R[r] or self._uncached(seq, r) <= n))

    @property
    def max_taken(self) -> int:
        """The busiest rank's tokens: what a step's prefill costs under SPMD."""
        return max(self.taken_R)
