"""Token sampling on device: greedy, temperature, top-k, top-p, per-row seeds.

Each row carries its own parameters, so one compiled sampler serves any mix of
requests. Randomness is keyed by (seed, position): a seeded request draws the same
tokens whatever it is batched with, and recompute after preemption reproduces it.

Sorting the vocabulary (151,936 entries for Qwen3) for top-k/top-p costs more than
the rest of sampling, so it runs only when some row asks for it (`lax.cond`), and an
all-greedy batch skips randomness entirely.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _filter_top_k_top_p(scaled_RV, top_k_R, top_p_R):
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
        masked_RV = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda x, *_: x,
                                 scaled_RV, top_k_R, top_p_R)

        def draw(seed2, position, row):
            key = jax.random.wrap_key_data(seed2.astype(jnp.uint32), impl="threefry2x32")
            return jax.random.categorical(jax.random.fold_in(key, position), row)

        sampled_R = jax.vmap(draw)(seed_R2, position_R, masked_RV).astype(jnp.int32)
        return jnp.where(temperature_R <= 0.0, greedy_R, sampled_R)

    return jax.lax.cond(jnp.all(temperature_R <= 0.0), lambda _: greedy_R, stochastic, None)
