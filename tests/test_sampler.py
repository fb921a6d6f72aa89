"""Device sampler: greedy, top-k, top-p and seeds, on a hand-made distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.engine.sampler import sample

LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4))


def _words(seeds):
    """64-bit seeds as the sampler takes them: uint32 (high, low) rows."""
    s = np.asarray([x % 2**64 for x in seeds], dtype=np.uint64)
    return jnp.asarray(np.stack([s >> 32, s & 0xFFFFFFFF], axis=1).astype(np.uint32))


def _draw(temperature, top_k, top_p, seeds, logits=LOGITS[:1]):
    n = len(seeds)
    return np.asarray(sample(jnp.tile(logits, (n, 1)), jnp.full(n, temperature),
                             jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p),
                             _words(seeds), jnp.zeros(n, jnp.int32)))


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    toks = sample(LOGITS, jnp.array([0.0, 1.0, 0.0, 1.0]), jnp.zeros(4, jnp.int32),
                  jnp.ones(4), _words(range(4)), jnp.zeros(4, jnp.int32))
    assert int(toks[0]) == 0 and int(toks[2]) == 0


def test_top_k_and_top_p_restrict_the_support():
    seeds = list(range(400))
    assert set(_draw(1.0, 2, 1.0, seeds)) == {0, 1}  # top-2
    assert set(_draw(1.0, 0, 0.6, seeds)) == {0, 1}  # 0.5 < 0.6, so two tokens
    assert set(_draw(1.0, 0, 0.5, seeds)) == {0}  # the first token alone reaches 0.5
    full = _draw(1.0, 0, 1.0, seeds)
    assert set(full) == {0, 1, 2, 3}
    freq = np.bincount(full, minlength=4) / len(seeds)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.08)


def test_same_seed_same_token_different_seeds_vary():
    a, b = _draw(1.0, 0, 1.0, [7] * 8), _draw(1.0, 0, 1.0, [7] * 8)
    assert (a == b).all() and len(set(a)) == 1
    assert len(set(_draw(1.0, 0, 1.0, list(range(32))))) > 1


def test_every_64_bit_seed_has_its_own_stream():
    """Seeds that agree in their low 31 or 32 bits still draw differently (they were
    masked to 31 bits once), and a seed below 2**32 keeps jax.random.key(seed)'s stream."""
    flat = jnp.zeros((1, 4096))  # uniform over 4096 tokens: streams are easy to tell apart
    base = 42
    draws = {s: _draw(1.0, 0, 1.0, [s], flat)[0] for s in
             (base, base + 2**31, base + 2**32, base - 2**63)}
    assert len(set(draws.values())) == len(draws)
    key = jax.random.fold_in(jax.random.key(base), 0)
    assert draws[base] == int(jax.random.categorical(key, flat[0]))
