"""Log-probabilities against Hugging Face, offline: prompt log-probabilities (computed in
slices after the last layer) and sampled-token log-probabilities equal the golden
log-softmax within 1e-4 on the float32 tiny model, under chunked prefill (a prompt split
over several chunks) and layered prefill; n > 1 shares the prompt's pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from lp_jax.core.sampling_params import SamplingParams
from lp_jax.executor.step import SCORE_ROWS

GOLDEN = np.load("tests/golden/tiny.npz")
PROMPTS = [GOLDEN[f"prompt_{i}"].tolist() for i in range(3)]
TOL = 1e-4


@pytest.fixture(scope="module", params=["chunked", "layered"])
def llm(request, engines):
    # the shared engines: chunked's 16-token budget splits the 40-token prompt into 3
    # chunks; layered runs it in one batch of 2 groups
    return engines(request.param)


def test_prompt_and_sampled_logprobs_match_transformers(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for i, out in enumerate(outs):
        ids, want = PROMPTS[i], GOLDEN[f"prompt_logprobs_{i}"]
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for p in range(1, len(ids)):
            d = plp[p]
            assert next(iter(d)) == ids[p]  # the prompt token first, then the top 5
            top = np.argsort(-want[p - 1])[:5]
            assert set(d) == {ids[p], *top.tolist()}, p
            for t, v in d.items():
                assert abs(v - want[p - 1, t]) < TOL, (i, p, t)
        greedy = GOLDEN[f"greedy_{i}"][:8].tolist()
        assert out.token_ids == greedy
        for s, d in enumerate(out.logprobs):
            assert abs(d[greedy[s]] - GOLDEN[f"greedy_logprobs_{i}"][s]) < TOL
            top_ids = GOLDEN[f"greedy_top_ids_{i}"][s, :5].tolist()
            assert set(d) == {greedy[s], *top_ids}
            for t, v in zip(top_ids, GOLDEN[f"greedy_top_logprobs_{i}"][s, :5], strict=True):
                assert abs(d[t] - v) < TOL
    assert llm.stats()["compilations_after_warmup"] == 0


def test_prompt_logprobs_skip_the_prefix_cache(llm):
    """A request for prompt log-probabilities computes its whole prompt even when the
    cache holds it, and still gets every position."""
    before = llm.stats()["prefix_cache_hits"]
    llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=SamplingParams(max_tokens=1))
    warm = llm.stats()["prefix_cache_hits"]
    out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=SamplingParams(
        max_tokens=1, prompt_logprobs=0))[0]
    assert llm.stats()["prefix_cache_hits"] == warm >= before
    assert out.num_cached_tokens == 0
    assert all(d is not None and len(d) == 1 for d in out.prompt_logprobs[1:])


def test_n_samples_share_the_prompt_pages(llm):
    """n = 3 seeded: three different samples, reproducible; samples 1 and 2 take the
    prompt's two full pages (32 of 40 tokens) from the cache; every page comes back."""
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5, ignore_eos=True)
    prompt = [(t + 1) % 512 for t in PROMPTS[2]]  # not cached yet
    before = llm.stats()["prefix_cache_hits"]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    hits = llm.stats()["prefix_cache_hits"] - before
    samples = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2] and len(set(map(tuple, samples))) == 3
    assert hits == 2 * 32, hits
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert [o.token_ids for o in again.outputs] == samples
    # sample i is the seed + i request on its own
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=1.0, max_tokens=6, seed=6, ignore_eos=True))[0]
    assert alone.token_ids == samples[1]
    stats = llm.stats()
    assert stats["free_pages"] == stats["total_pages"]


def test_scoring_in_slices_equals_one_log_softmax():
    """`_score_prompt` over 600 rows (three 256-row slices, the last padded) gives each
    scored row's log-softmax entry and top 20 as one [600, V] log-softmax would; a slice
    with no scored row is skipped (zeros). Unscored rows of a scored slice carry values
    the host never reads."""
    import jax
    import jax.numpy as jnp

    from lp_jax.executor.step import _score_prompt

    class Head:  # logits = x itself: [N, V] rows
        def compute_logits(self, x):
            return x

    N, V = 600, 64
    assert N > 2 * SCORE_ROWS
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, V)).astype(np.float32) * 3
    target = rng.integers(0, V, N).astype(np.int32)
    target[SCORE_ROWS : 2 * SCORE_ROWS] = -1  # the middle slice scores nothing
    target[::7] = -1
    got, top, ids = jax.jit(lambda a, t: _score_prompt(Head(), a, t))(x, jnp.asarray(target))
    want = np.asarray(jax.nn.log_softmax(x.astype(np.float64), axis=-1))
    scored = target >= 0
    np.testing.assert_allclose(np.asarray(got)[scored], want[scored, target[scored]],
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(top)[scored], -np.sort(-want[scored])[:, :20],
                               atol=1e-5)
    assert (np.asarray(ids)[scored] == np.argsort(-want[scored])[:, :20]).all()
    skipped = slice(SCORE_ROWS, 2 * SCORE_ROWS)
    assert not np.asarray(got)[skipped].any() and not np.asarray(top)[skipped].any()
