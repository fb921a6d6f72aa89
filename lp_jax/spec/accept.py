"""The acceptance rule for point-mass drafts (n-gram): sample every row, keep a draft
while it equals the token sampled at the row before it.

Row j of a speculating decode is the target's distribution p_j given the drafts before
it, and the step samples x_j from it as it samples any row (temperature, top-k, top-p,
its own (seed, position) key). Draft d_j stands iff x_j == d_j, which has probability
p_j(d_j): the acceptance probability of Leviathan et al.'s test for a draft of
probability 1. At the first row where x_j != d_j, x_j is the token: given x_j != d_j it
is distributed as p_j without d_j, renormalised, which is their residual
max(p_j - q_j, 0) for that q_j. When every draft stands, x_k, drawn from the row after
the last draft, is the bonus token. So the output's law is the target's; at temperature
0 the rule reads "keep the draft while it is the argmax". A row keyed by its position
draws what plain decoding draws there once the drafts before it stand, so a seeded
request gets the same tokens with speculation as without.

Drafts with a distribution of their own (a draft model) need the general test with
explicit probabilities, lp_jax/executor/verify.py.
"""

from __future__ import annotations


def accept_sampled(drafts, sampled) -> tuple[int, int]:
    """(number of drafts accepted, the token after them), from the k drafts and the
    k + 1 tokens sampled at the verification rows."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a, int(sampled[a])
