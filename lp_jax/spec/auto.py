"""`"num_speculative_tokens": "auto"`: k per step from a cost model and the acceptance seen.

Design note. With per-token acceptance alpha, k drafts emit tau(alpha, k) = (1 -
alpha^(k+1)) / (1 - alpha) tokens per sequence and step, and the step costs
ratio(B, k) decode steps of the running batch B (the roofline of B (k + 1) verification
rows plus the draft, lp_jax/roofline/spec_pays.py; the engine hands it in as a
function, so this module stays below the roofline in the import floors). Each plan takes
the k in [0, max_k] that maximises tau / ratio; k = 0 (no drafts) wins whenever no k
beats plain decoding, as on a MoE at a batch where every verified row loads experts of
its own, or a compute-bound step.

alpha is estimated from the drafts verified so far. Draft j is tested only when drafts
0..j-1 stood, so a verified run of d drafts with a accepted is a accepted trials and,
if a < d, one rejected trial; the estimate is the Beta posterior mean

    alpha = (accepted + w * prior) / (trials + w),

with `prior` = PRIOR_ALPHA and weight w = PRIOR_WEIGHT pseudo-trials, so a few
lucky or unlucky steps do not swing k. Counts decay once they pass WINDOW trials
(both scaled back to WINDOW), so the estimate follows a workload that changes. While
k = 0 nothing is verified and the estimate stands still; a smaller batch, where
speculation costs less, picks k > 0 again and resumes the measurement.
"""

from __future__ import annotations

from collections.abc import Callable

# ASSUMED: a middle value, below the 0.71-0.86 per position n-gram drafts reached on the
# demo model (docs/benchmarks/speculative.md); measured trials outweigh it within a few steps.
PRIOR_ALPHA = 0.6
PRIOR_WEIGHT = 8.0  # pseudo-trials the prior counts for
WINDOW = 1024.0  # trials remembered


def expected_tokens(alpha: float, k: int) -> float:
    """tau(alpha, k): tokens a sequence emits per step with k drafts at per-token
    acceptance alpha, (1 - alpha^(k+1)) / (1 - alpha); k + 1 at alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0 or int(k) != k:
        raise ValueError(f"k must be a non-negative integer, got {k}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AutoK:
    """Chooses each plan's k from `step_ratio(batch, k)` (a step with k drafts over a
    plain decode step of `batch` sequences) and the running acceptance estimate."""

    def __init__(self, step_ratio: Callable[[int, int], float], max_k: int, *,
                 prior_alpha: float = PRIOR_ALPHA, prior_weight: float = PRIOR_WEIGHT,
                 window: float = WINDOW) -> None:
        if not 0.0 <= prior_alpha <= 1.0 or prior_weight <= 0 or window <= 0:
            raise ValueError("need prior_alpha in [0, 1], prior_weight > 0, window > 0")
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.step_ratio, self.max_k = step_ratio, max_k
        self.prior_alpha, self.prior_weight, self.window = prior_alpha, prior_weight, window
        self.accepted = 0.0  # accepted trials (decayed)
        self.trials = 0.0  # tested draft positions (decayed)
        self.last_k = 0

    @property
    def alpha(self) -> float:
        """The acceptance estimate: the Beta posterior mean over the trials kept."""
        w = self.prior_weight
        return (self.accepted + w * self.prior_alpha) / (self.trials + w)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verified run: num_accepted of its num_drafts drafts stood."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        if not num_drafts:
            return
        self.accepted += num_accepted
        self.trials += num_accepted + (num_accepted < num_drafts)
        if self.trials > self.window:
            scale = self.window / self.trials
            self.accepted, self.trials = self.accepted * scale, self.trials * scale

    def choose(self, batch: int, max_rows: int | None = None) -> int:
        """k for a plan of `batch` decodes: argmax over k of tau(alpha, k) / ratio(batch, k),
        k <= max_k and batch (k + 1) <= max_rows (the rows a step may verify); 0 when
        no k beats plain decoding. `last_k` keeps the choice: the scheduler holds a decode
        out of an overlapped plan (to draft after its commit) only while it is > 0."""
        if batch <= 0:
            return 0  # a plan without decodes leaves last_k as it was
        top = self.max_k if max_rows is None else min(self.max_k, max_rows // batch - 1)
        best, best_gain, alpha = 0, 1.0, self.alpha
        for k in range(1, top + 1):
            gain = expected_tokens(alpha, k) / self.step_ratio(batch, k)
            if gain > best_gain:
                best, best_gain = k, gain
        self.last_k = best
        return best
