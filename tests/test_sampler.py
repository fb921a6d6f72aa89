"""Device sampler: greedy, top-k, top-p and seeds, on a hand-made distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.executor.sampler import sample

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


# ---- penalties, logit bias, min_tokens and log-probabilities, against numpy references
# of vLLM's definitions.

def _np_penalize(logits, counts, prompt_seen, presence, frequency, repetition):
    """vLLM: repetition over prompt + output tokens, then frequency and presence over
    output tokens, written out per entry."""
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        for v in range(out.shape[1]):
            if prompt_seen[r, v] or counts[r, v] > 0:
                x = out[r, v]
                out[r, v] = x / repetition[r] if x > 0 else x * repetition[r]
            out[r, v] -= frequency[r] * counts[r, v]
            out[r, v] -= presence[r] * (counts[r, v] > 0)
    return out


def test_penalties_match_a_numpy_reference():
    from lp_jax.executor.sampler import apply_penalties

    rng = np.random.default_rng(0)
    S, V = 5, 37
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)
    counts = rng.integers(0, 4, (S, V)) * (rng.random((S, V)) < 0.3)
    seen = rng.random((S, V)) < 0.2
    presence = np.array([0.0, 0.5, -1.0, 2.0, 0.0], np.float32)
    frequency = np.array([0.0, 0.3, 0.0, -0.5, 1.0], np.float32)
    repetition = np.array([1.0, 1.3, 0.7, 2.0, 1.1], np.float32)
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                          jnp.asarray(seen), jnp.asarray(presence), jnp.asarray(frequency),
                          jnp.asarray(repetition))
    want = _np_penalize(logits, counts, seen, presence, frequency, repetition)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_logit_bias_adds_per_row_and_ignores_padding():
    from lp_jax.executor.sampler import apply_bias

    logits = np.zeros((2, 6), np.float32)
    ids = np.array([[1, 4, -1], [5, -1, -1]], np.int32)
    bias = np.array([[2.0, -np.inf, 9.0], [-3.0, 9.0, 9.0]], np.float32)
    got = np.asarray(apply_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(bias)))
    want = np.zeros((2, 6))
    want[0, 1], want[0, 4], want[1, 5] = 2.0, -np.inf, -3.0
    np.testing.assert_array_equal(got, want)


def test_token_logprobs_are_the_log_softmax_with_its_top_20():
    from lp_jax.executor.sampler import token_logprobs

    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (3, 50)).astype(np.float32)
    tokens = np.array([0, 7, 49], np.int32)
    chosen, top, ids = map(np.asarray, token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)))
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, logp[np.arange(3), tokens], atol=1e-5)
    assert top.shape == ids.shape == (3, 20)
    np.testing.assert_array_equal(ids, np.argsort(-logp, axis=-1)[:, :20])
    np.testing.assert_allclose(top, np.take_along_axis(logp, ids, -1), atol=1e-5)


def _np_logp(x):
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_engine_penalties_bias_min_tokens_and_logprobs_match_numpy(tiny_model, engines):
    """Greedy decoding with every option on, on a layered engine (a prompt spans several
    groups and plans, overlapped scheduling): each output token is the argmax of the
    reference logits after numpy's bias, min_tokens mask and vLLM penalties over the
    tokens so far, and the log-probabilities are the raw log-softmax within 1e-4."""
    from lp_jax import SamplingParams

    llm = engines("layered")  # a 64-token budget in 2 groups
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 200, n).tolist() for n in (9, 90, 30)]
    prompts[2] = prompts[2][:10] * 3  # repeats: the repetition penalty bites
    params = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=5, repetition_penalty=1.8,
                       presence_penalty=0.4, frequency_penalty=0.6),
        SamplingParams(temperature=0, max_tokens=10, logprobs=0, logit_bias={7: 3.0, 11: -2.5},
                       min_tokens=10, stop_token_ids=[13]),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=0.5,
                       frequency_penalty=-0.5, logit_bias={prompts[2][0]: 1.0}),
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    _check_against_numpy(tiny_model, llm, prompts, params, outs)
    assert outs[1].finish_reason == "length"  # min_tokens == max_tokens: no stop
    stats = llm.engine.stats()
    assert stats["compilations_after_warmup"] == 0 and stats["programs"] == 2
    assert stats["free_pages"] == stats["total_pages"]


def test_penalty_counts_survive_recompute_preemption(tiny_model):
    """Under KV pressure sequences are preempted and prefilled again with their outputs:
    the re-prefill rebuilds their device counts (prompt mask and output histogram), so
    penalized greedy decoding still matches the numpy reference."""
    from checkpoints.make_tiny import ensure_tiny
    from lp_jax import LLM, SamplingParams

    # 24 pages of 16 tokens cannot hold four 100-token sequences growing to 140.
    llm = LLM(ensure_tiny(preset="tiny"), max_num_seqs=4, max_model_len=256, log=None,
              scheduling="chunked",
              max_num_batched_tokens=256, token_buckets=(4, 256), kv_pages=24)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 509, 100).tolist() for _ in range(4)]
    # negative penalties make outputs repeat: each one depends on the counts so far
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1,
                             presence_penalty=-1.0, frequency_penalty=-0.5,
                             repetition_penalty=1.3)] * 4
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    s = llm.engine.stats()
    assert s["preemptions"] > 0 and s["free_pages"] == s["total_pages"]
    _check_against_numpy(tiny_model, llm, prompts, params, outs)


def _check_against_numpy(tiny_model, llm, prompts, params, outs):
    """Each output token is the argmax of the reference logits after numpy's bias,
    min_tokens mask and penalties; log-probabilities are the raw log-softmax (1e-4)."""
    from lp_jax.models.simple import greedy_generate

    eos = llm.engine.model_config.eos_token_id
    V = llm.engine.model_config.vocab_size
    for prompt, p, o in zip(prompts, params, outs, strict=True):
        out = o.token_ids
        _, logits = greedy_generate(tiny_model, prompt + out[:-1], 1, return_prompt_logits=True)
        for i, tok in enumerate(out):
            raw = logits[len(prompt) - 1 + i].astype(np.float64)
            x = raw.copy()
            for t, b in p.logit_bias:
                x[t] += b
            if i < p.min_tokens:
                x[list(p.stop_token_ids) + [eos]] = -np.inf
            counts = np.bincount(out[:i], minlength=V)[None]
            seen = (np.bincount(prompt, minlength=V) > 0)[None]
            x = _np_penalize(x[None], counts, seen, [p.presence_penalty],
                             [p.frequency_penalty], [p.repetition_penalty])[0]
            assert tok == int(np.argmax(x)), (i, tok, np.argsort(-x)[:3])
            if p.logprobs is not None:
                lp, want = o.logprobs[i], _np_logp(raw)
                assert len(lp) in (p.logprobs, p.logprobs + 1) or (p.logprobs == 0 and len(lp) == 1)
                assert next(iter(lp)) == tok
                for t, v in lp.items():
                    assert abs(v - want[t]) < 1e-4
                top = np.argsort(-want)[: p.logprobs]
                assert set(top.tolist()) <= set(lp)
        if p.logprobs is None:
            assert o.logprobs is None
