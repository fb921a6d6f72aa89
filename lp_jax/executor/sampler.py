"""Token sampling on device: greedy, temperature, top-k, top-p, per-row seeds.

Each row carries its own parameters, so one compiled sampler serves any mix of
requests. Randomness is keyed by (seed, position): a seeded request draws the same
tokens whatever it is batched with, and recompute after preemption reproduces it.

Sorting the vocabulary (151,936 entries for Qwen3) for top-k/top-p costs more than
the rest of sampling, so it runs only when some row asks for it (`lax.cond`), and an
all-greedy batch skips randomness entirely.

Before sampling, `process_logits` applies per-row logit biases (min_tokens' masks are
-inf biases) and then vLLM's penalties from each row's token counts (a verification
row's with the drafts before it added, `add_drafts`); `token_logprobs`
reports log-probabilities of the raw model distribution (vLLM's default), with the top
MAX_LOGPROBS alternatives. Both run for every row at fixed shapes: no program per feature.
`apply_bitmask` then sets the tokens a row's grammar forbids to -inf (structured outputs,
lp_jax/structured): the mask is llguidance's layout, bit v % 32 of int32 word v // 32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lp_jax.core.sampling_params import MAX_LOGPROBS


def apply_bias(logits_SV, ids_SK, bias_SK):
    """Adds bias_SK[s, k] to logits_SV[s, ids_SK[s, k]]; ids < 0 are padding."""
    S, V = logits_SV.shape
    ids_SK = jnp.where(ids_SK < 0, V, ids_SK)
    return logits_SV.at[jnp.arange(S)[:, None], ids_SK].add(bias_SK, mode="drop")


def apply_bitmask(logits_SV, bitmask_SW):
    """-inf where row s's bit for token v is 0; rows of all ones (-1) are unchanged.
    Logit columns past the mask's 32 x W tokens are never allowed. The words' 32 bits
    are spread along a new minor axis and flattened (no gather: XLA:TPU laid a gather of
    the [V] word indices out as s32[V, S] with S padded to 128 lanes, a 98 MiB temporary
    at GPT-OSS's V = 201,088 and S = 8; this form fuses into the select)."""
    (S, V), W = logits_SV.shape, bitmask_SW.shape[1]
    bits_SWB = (bitmask_SW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    bits_SV = bits_SWB.reshape(S, 32 * W)
    bits_SV = bits_SV[:, :V] if 32 * W >= V else jnp.pad(bits_SV, ((0, 0), (0, V - 32 * W)))
    return jnp.where(bits_SV != 0, logits_SV, -jnp.inf)


def apply_penalties(logits_SV, counts_SV, prompt_SV, presence_S, frequency_S, repetition_S):
    """vLLM's penalties: repetition over prompt and output tokens (divides positive
    logits, multiplies negative ones), then frequency (x output count) and presence
    (output token seen) subtracted."""
    seen_SV = prompt_SV | (counts_SV > 0)
    rep_SV = jnp.where(seen_SV, repetition_S[:, None], 1.0)
    logits_SV = jnp.where(logits_SV > 0, logits_SV / rep_SV, logits_SV * rep_SV)
    logits_SV = logits_SV - frequency_S[:, None] * counts_SV.astype(jnp.float32)
    return logits_SV - presence_S[:, None] * (counts_SV > 0).astype(jnp.float32)


def add_drafts(counts_SV, prefix_SK):
    """counts_SV plus one count per token of prefix_SK (-1 is padding): a verification
    row's output counts are its sequence's plus the drafts before the row, the tokens
    that precede it if those drafts stand."""
    S, V = counts_SV.shape
    ids_SK = jnp.where(prefix_SK < 0, V, prefix_SK)
    return counts_SV.at[jnp.arange(S)[:, None], ids_SK].add(1, mode="drop")


def drafts_stand(tokens_S, prefix_SK):
    """[S] bool: whether every draft before sampled row s stands, so that its token is
    committed (lp_jax/spec/accept.py). Row s's n drafts (prefix_SK[s, :n], the rest -1)
    are verified by rows s - n .. s - 1, the rows of the same run before it: draft i
    stands iff tokens_S[s - n + i] equals it. A row with no drafts before it is kept."""
    S, K = prefix_SK.shape
    n_S1 = jnp.sum(prefix_SK >= 0, axis=1, keepdims=True)
    i_1K = jnp.arange(K)[None, :]
    sampled_SK = tokens_S[jnp.clip(jnp.arange(S)[:, None] - n_S1 + i_1K, 0, S - 1)]
    return jnp.all((i_1K >= n_S1) | (sampled_SK == prefix_SK), axis=1)


def token_logprobs(logits_SV, tokens_S):
    """Log-softmax of the (raw) logits: the chosen token's [S] and the top MAX_LOGPROBS
    ([S, 20] values, ids)."""
    logp_SV = jax.nn.log_softmax(logits_SV.astype(jnp.float32), axis=-1)
    chosen_S = jnp.take_along_axis(logp_SV, tokens_S[:, None], axis=-1)[:, 0]
    k = min(MAX_LOGPROBS, logits_SV.shape[-1])
    top_SK, ids_SK = jax.lax.top_k(logp_SV, k)
    return chosen_S, top_SK, ids_SK.astype(jnp.int32)


def filter_top_k_top_p(scaled_RV, top_k_R, top_p_R):
    """Masks logits outside each row's top-k and top-p (nucleus) sets with -inf."""
    V = scaled_RV.shape[-1]
    sorted_RV = -jnp.sort(-scaled_RV, axis=-1)
    k_R = jnp.where(top_k_R <= 0, V, jnp.minimum(top_k_R, V))
    kth_R = jnp.take_along_axis(sorted_RV, (k_R - 1)[:, None], axis=-1)[:, 0]
    # top-p over the top-k survivors: keep the smallest prefix whose mass reaches p.
    in_top_k_RV = jnp.arange(V)[None, :] < k_R[:, None]
    probs_RV = jax.nn.softmax(jnp.where(in_top_k_RV, sorted_RV, -jnp.inf), axis=-1)
    mass_before_RV = jnp.cumsum(probs_RV, axis=-1) - probs_RV
    keep_RV = in_top_k_RV & (mass_before_RV < top_p_R[:, None])
    num_keep_R = jnp.maximum(jnp.sum(keep_RV, axis=-1), 1)
    cutoff_R = jnp.take_along_axis(sorted_RV, (num_keep_R - 1)[:, None], axis=-1)[:, 0]
    threshold_R = jnp.maximum(kth_R, cutoff_R)
    return jnp.where(scaled_RV >= threshold_R[:, None], scaled_RV, -jnp.inf)


def sample(logits_RV, temperature_R, top_k_R, top_p_R, seed_R2, position_R):
    """Returns int32 tokens [R]. temperature 0 means greedy; top_k <= 0 disables top-k.
    seed_R2: each row's 64-bit seed as uint32 words (high, low): every seed keys its own
    stream, and a seed below 2**32 keys the stream of `jax.random.key(seed)`."""
    logits_RV = logits_RV.astype(jnp.float32)
    greedy_R = jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)

    def stochastic(_):
        scaled_RV = logits_RV / jnp.maximum(temperature_R, 1e-6)[:, None]
        needs_filter = jnp.any((top_k_R > 0) | (top_p_R < 1.0))
        masked_RV = jax.lax.cond(needs_filter, filter_top_k_top_p, lambda x, *_: x,
                                 scaled_RV, top_k_R, top_p_R)

        def draw(seed2, position, row):
            key = jax.random.wrap_key_data(seed2.astype(jnp.uint32), impl="threefry2x32")
            return jax.random.categorical(jax.random.fold_in(key, position), row)

        sampled_R = jax.vmap(draw)(seed_R2, position_R, masked_RV).astype(jnp.int32)
        return jnp.where(temperature_R <= 0.0, greedy_R, sampled_R)

    return jax.lax.cond(jnp.all(temperature_R <= 0.0), lambda _: greedy_R, stochastic, None)
