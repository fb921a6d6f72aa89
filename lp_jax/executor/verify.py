"""Verification of drafts against the target model: exact, whatever the draft.

A speculating sequence runs k + 1 rows through the target: its last token and its k
drafts d_0..d_{k-1}. Row j's logits are the target's distribution p_j of the token at
position + j, given the drafts before it. `verify` decides how many drafts stand and
which token follows them:

- greedy rows (temperature 0): d_j stands while it is p_j's argmax; the next token is the
  argmax at the first row whose draft fell (or at row k, the bonus), so the output equals
  the non-speculative greedy output token for token;
- sampled rows: d_j stands with probability min(1, p_j(d_j) / q_j(d_j)), q_j the draft's
  distribution (a point mass for n-gram drafts); at the first rejection the token is drawn
  from the residual max(p_j - q_j, 0), renormalised; when all stand, the bonus token is
  drawn from p_k. By Leviathan et al. (2023) every emitted token is then distributed as
  the target's, so speculation changes speed, never the output's law.

p_j is the distribution the non-speculative sampler draws from: temperature, then
top-k, top-p and min-p, so filtered tokens have p_j = 0 and a draft of one is always
rejected (as is a draft a grammar's bitmask has already set to -inf in the logits).
Randomness is keyed by (seed, position), as the sampler's: one acceptance uniform and
one draw per position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lp_jax.executor.sampler import filter_top_k_top_p


def target_probs(logits_SKV, temperature_S, top_k_S, top_p_S, min_p_S):
    """p_SKV: each row's sampling distribution: temperature, top-k, top-p, then min-p
    (tokens below min_p x the most likely one's probability are dropped)."""
    S, K, V = logits_SKV.shape
    rows = lambda x: jnp.repeat(x, K)
    scaled_NV = (logits_SKV.reshape(S * K, V).astype(jnp.float32)
                 / jnp.maximum(rows(temperature_S), 1e-6)[:, None])
    top_k_N, top_p_N = rows(top_k_S), rows(top_p_S)
    masked_NV = jax.lax.cond(jnp.any((top_k_N > 0) | (top_p_N < 1.0)), filter_top_k_top_p,
                             lambda x, *_: x, scaled_NV, top_k_N, top_p_N)
    p_NV = jax.nn.softmax(masked_NV, axis=-1)
    keep_NV = p_NV >= rows(min_p_S)[:, None] * jnp.max(p_NV, axis=-1, keepdims=True)
    p_NV = jnp.where(keep_NV, p_NV, 0.0)
    return (p_NV / jnp.sum(p_NV, axis=-1, keepdims=True)).reshape(S, K, V)


def residual_probs(p_SKV, draft_SK, q_SKV=None):
    """max(p - q, 0), renormalised: where a rejected draft's token is drawn from. A point
    mass q (q_SKV None: the draft is d itself) leaves p with d removed. A residual of no
    mass (p == q, so rejection had probability 0) falls back to p."""
    V = p_SKV.shape[-1]
    if q_SKV is None:
        q_SKV = jax.nn.one_hot(draft_SK, V, dtype=p_SKV.dtype)
    r_SKV = jnp.maximum(p_SKV - q_SKV, 0.0)
    mass_SK1 = jnp.sum(r_SKV, axis=-1, keepdims=True)
    return jnp.where(mass_SK1 > 0, r_SKV / jnp.where(mass_SK1 > 0, mass_SK1, 1.0), p_SKV)


def final_probs(p_SKV, residual_SKV, num_draft_S):
    """The distribution of the token after the accepted drafts, per row j: the residual
    where row j held a draft (it was rejected there), the target itself past the last
    draft (the bonus token)."""
    j_K = jnp.arange(p_SKV.shape[1])
    has_draft_SK1 = (j_K[None, :] < num_draft_S[:, None])[..., None]
    return jnp.where(has_draft_SK1, residual_SKV, p_SKV)


def _row_keys(seed_S2, position_S, K):
    """[S, K] keys: row j of sequence s keyed by (seed, position + j)."""
    def keys(seed2, pos):
        key = jax.random.wrap_key_data(seed2.astype(jnp.uint32), impl="threefry2x32")
        return jax.vmap(lambda j: jax.random.fold_in(key, pos + j))(jnp.arange(K))
    return jax.vmap(keys)(seed_S2, position_S)


def verify(logits_SKV, draft_SK, num_draft_S, temperature_S, top_k_S, top_p_S, min_p_S,
           seed_S2, position_S, draft_probs_SKV=None):
    """(tokens_SK, num_accepted_S) for S sequences of K = k + 1 verification rows.

    logits_SKV: the target's logits (bias, penalties and bitmask applied) at each row;
    draft_SK: the k drafts, padded to K (entries at or past num_draft_S are ignored);
    draft_probs_SKV: the drafter's distributions q_j (None: point masses at the drafts).
    Sequence s emits tokens_SK[s, :num_accepted_S[s] + 1]: its accepted drafts, then the
    token drawn after them."""
    S, K, V = logits_SKV.shape
    logits_SKV = logits_SKV.astype(jnp.float32)
    j_K = jnp.arange(K)
    draft_SK = jnp.clip(draft_SK, 0, V - 1)
    has_draft_SK = j_K[None, :] < num_draft_S[:, None]
    greedy_SK = jnp.argmax(logits_SKV, axis=-1).astype(jnp.int32)

    p_SKV = target_probs(logits_SKV, temperature_S, top_k_S, top_p_S, min_p_S)
    p_draft_SK = jnp.take_along_axis(p_SKV, draft_SK[..., None], axis=-1)[..., 0]
    if draft_probs_SKV is None:
        ratio_SK = p_draft_SK
    else:
        q_draft_SK = jnp.take_along_axis(draft_probs_SKV, draft_SK[..., None], axis=-1)[..., 0]
        ratio_SK = p_draft_SK / jnp.maximum(q_draft_SK, 1e-30)
    keys_SK = _row_keys(seed_S2, position_S, K)
    u_SK = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0))))(keys_SK)
    sampled_SK = u_SK < ratio_SK
    is_greedy_S1 = (temperature_S <= 0.0)[:, None]
    accept_SK = has_draft_SK & jnp.where(is_greedy_S1, draft_SK == greedy_SK, sampled_SK)
    num_accepted_S = jnp.sum(jnp.cumprod(accept_SK, axis=1), axis=1).astype(jnp.int32)

    final_SKV = final_probs(p_SKV, residual_probs(p_SKV, draft_SK, draft_probs_SKV),
                            num_draft_S)
    at_S = num_accepted_S
    final_SV = jnp.take_along_axis(final_SKV, at_S[:, None, None], axis=1)[:, 0]
    key_S = jnp.take_along_axis(jax.random.key_data(keys_SK), at_S[:, None, None], axis=1)[:, 0]
    drawn_S = jax.vmap(lambda kd, p: jax.random.categorical(
        jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), 1),
        jnp.log(p)))(key_S, final_SV).astype(jnp.int32)
    greedy_at_S = jnp.take_along_axis(greedy_SK, at_S[:, None], axis=1)[:, 0]
    last_S = jnp.where(temperature_S <= 0.0, greedy_at_S, drawn_S)
    tokens_SK = jnp.where(j_K[None, :] < at_S[:, None], draft_SK,
                          jnp.where(j_K[None, :] == at_S[:, None], last_S[:, None], 0))
    return tokens_SK.astype(jnp.int32), num_accepted_S
