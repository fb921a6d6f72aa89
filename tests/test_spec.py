"""Speculative decoding's parts that need no engine: speculative_config's validation, the
n-gram drafter, and the acceptance test, whose output law is checked against plain
sampling on a tiny bigram model (and shown to catch a wrong residual or bonus token)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.executor import verify as V
from lp_jax.spec import SpeculativeConfig, propose_ngram
from lp_jax.spec.accept import accept_sampled

# ----- speculative_config -----


def test_config_vllm_shape_and_defaults():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 5})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 5, 5)
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 3)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(c) is c


@pytest.mark.parametrize("value, match", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "mtp", "num_speculative_tokens": "auto"}, "fixed k"),
    ({"method": "deepseek_mtp", "model": "/m"}, "own next-token layers"),
    ({"method": "eagle3", "model": "/m", "num_speculative_tokens": "auto"}, "fixed k"),
    ({"method": "eagle3"}, "takes a draft 'model' path"),
    ({"method": "ngram", "model": "x"}, "takes no 'model'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min 4 > "),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokns": 3}, "unknown speculative_config keys"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_config_bad_values_get_clear_errors(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


# ----- the n-gram drafter -----


def test_ngram_copies_what_followed_the_longest_match():
    #         0  1  2  3  4  5  6  7  8
    tokens = [6, 7, 8, 9, 1, 6, 7, 6, 7]
    # No earlier "7 6 7": n = 2. "6 7" occurs at 0 and 5; only the match at 0 has 3
    # tokens after it, and with k = 2 the latest, at 5, has.
    assert propose_ngram(tokens, 3, 1, 3) == [8, 9, 1]
    assert propose_ngram(tokens, 2, 1, 3) == [6, 7]
    assert propose_ngram(tokens, 3, 3, 3) == []  # no n-gram of 3
    assert propose_ngram([1, 2, 3], 2, 1, 2) == []  # nothing repeats
    assert propose_ngram([4], 2, 1, 2) == []


def test_ngram_prefers_longer_context():
    # The 1-gram "3" last occurred before 9, the 2-gram "2 3" before 4.
    tokens = [2, 3, 4, 0, 3, 9, 2, 3]
    assert propose_ngram(tokens, 1, 1, 2) == [4]
    assert propose_ngram(tokens, 1, 1, 1) == [9]


def _ngram_reference(tokens, k, min_n, max_n):
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        starts = [i for i in range(L - n) if tokens[i:i + n] == tokens[L - n:]]
        if starts:
            full = [i for i in starts if i + n + k <= L]
            i = full[-1] if full else starts[0]
            return tokens[i + n:i + n + k]
    return []


def test_ngram_matches_a_plain_scan():
    """The byte-string search agrees with a plain scan, also for ids whose bytes make
    matches inside a token (256 + 1 shares bytes with 1 and 256)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = (3, 6, 257 * 256 + 1)[trial % 3]
        tokens = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        if trial % 3 == 2:
            tokens = [t % 3 * 256 + t % 2 for t in tokens]
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        assert propose_ngram(tokens, k, lo, hi) == _ngram_reference(tokens, k, lo, hi)


# ----- the acceptance test -----


def _verify(logits_SKV, draft_SK, num_draft_S, temperature, *, top_k=-1, top_p=1.0,
            min_p=0.0, seed_S=None, position_S=None, q_SKV=None):
    S = logits_SKV.shape[0]
    full = lambda v, dt: jnp.full(S, v, dt)
    seed_S2 = jnp.stack([jnp.zeros(S, jnp.uint32),
                         jnp.asarray(np.arange(S) if seed_S is None else seed_S, jnp.uint32)], 1)
    pos_S = jnp.zeros(S, jnp.int32) if position_S is None else jnp.asarray(position_S)
    return V.verify(jnp.asarray(logits_SKV), jnp.asarray(draft_SK, jnp.int32),
                    jnp.asarray(num_draft_S, jnp.int32), full(temperature, jnp.float32),
                    full(top_k, jnp.int32), full(top_p, jnp.float32), full(min_p, jnp.float32),
                    seed_S2, pos_S, q_SKV)


# The two unit tests' calls: one program, every argument given.
_verify_jit = jax.jit(lambda logits, draft, n, t, top_k, top_p, min_p: _verify(
    logits, draft, n, t, top_k=top_k, top_p=top_p, min_p=min_p))
_S = 64


def test_greedy_keeps_the_argmax_chain():
    """Temperature 0: drafts stand while each is the argmax, then the argmax follows."""
    logits_SKV = jnp.log(jnp.array([[[.1, .7, .2], [.6, .3, .1], [.2, .2, .6]]] * _S))
    draft_SK = np.array([[1, 0, 0], [1, 2, 0], [0, 0, 0]] + [[1, 0, 0]] * (_S - 3))
    tokens_SK, acc_S = _verify_jit(logits_SKV, draft_SK, np.array([2, 2, 0] + [2] * (_S - 3)),
                                   0.0, -1, 1.0, 0.0)
    np.testing.assert_array_equal(acc_S[:3], [2, 1, 0])
    np.testing.assert_array_equal(tokens_SK[:3], [[1, 0, 2], [1, 0, 0], [1, 0, 0]])


def test_filters_apply_before_the_test():
    """A draft outside the target's top-k, top-p or min-p set is never accepted, and the
    token drawn instead is the filtered distribution's."""
    logits_SKV = jnp.broadcast_to(jnp.log(jnp.array([.5, .3, .2])), (_S, 3, 3))
    # top-k 1, top-p 0.4 and min-p 0.7 each leave token 0 alone; min-p 0.5 keeps 0 and 1
    for top_k, top_p, min_p, allowed in ((1, 1.0, 0.0, {0}), (-1, 0.4, 0.0, {0}),
                                         (-1, 1.0, 0.7, {0}), (-1, 1.0, 0.5, {0, 1})):
        tokens_SK, acc_S = _verify_jit(logits_SKV, np.full((_S, 3), 2), np.full(_S, 2), 1.0,
                                       top_k, top_p, min_p)
        assert int(acc_S.max()) == 0, (top_k, top_p, min_p)
        assert set(np.asarray(tokens_SK[:, 0]).tolist()) == allowed


# A tiny model: bigram logits, with two likely fixed drafts after the start token.
_V, _START, _DRAFT, _N = 5, 0, (1, 2), 3
_TABLE_VV = np.log(np.array([
    [.05, .50, .20, .15, .10],
    [.10, .05, .55, .20, .10],
    [.30, .20, .10, .30, .10],
    [.25, .25, .25, .15, .10],
    [.10, .30, .30, .20, .10]]))


def _bigram_step(ctx_B, draft_BK, pos_B, q_VV):
    """One verification of the bigram model at temperature 1: rows for the context and
    each draft, the drafter's q read from q_VV (None: point masses)."""
    B, k = draft_BK.shape
    rows_BK = jnp.concatenate([ctx_B[:, None], draft_BK], axis=1)
    return _verify(jnp.asarray(_TABLE_VV, jnp.float32)[rows_BK],
                   jnp.pad(draft_BK, ((0, 0), (0, 1))), jnp.full(B, k), 1.0,
                   position_S=pos_B, q_SKV=None if q_VV is None else q_VV[rows_BK])


_BIGRAM_STEP = jax.jit(_bigram_step)


def _speculative_samples(B: int, q_VV=None, step=_BIGRAM_STEP) -> np.ndarray:
    """B generations of _N tokens from _START, each step verifying k = 2 drafts: the fixed
    _DRAFT, or (q_VV given) drafts drawn from the bigram drafter q_VV."""
    k = len(_DRAFT)
    rng = np.random.default_rng(1)
    out_BN = np.full((B, _N + k + 1), -1)
    count_B = np.zeros(B, np.int64)
    while (count_B < _N).any():
        ctx_B = np.where(count_B == 0, _START, out_BN[np.arange(B), np.maximum(count_B - 1, 0)])
        if q_VV is None:
            draft_BK = np.tile(_DRAFT, (B, 1))
        else:
            draft_BK, prev = np.zeros((B, k), np.int64), ctx_B
            for j in range(k):
                u = rng.random(B)[:, None]
                draft_BK[:, j] = prev = (np.cumsum(q_VV[prev], 1) < u).sum(1)
        tokens_BK, acc_B = map(np.asarray, step(
            jnp.asarray(ctx_B, jnp.int32), jnp.asarray(draft_BK, jnp.int32),
            jnp.asarray(count_B, jnp.int32), None if q_VV is None else jnp.asarray(q_VV)))
        for j in range(k + 1):
            put = (j <= acc_B) & (count_B < _N)
            out_BN[put, count_B[put] + j] = tokens_BK[put, j]
        count_B = np.where(count_B < _N, count_B + acc_B + 1, count_B)
    return out_BN[:, :_N]


def _chi2_pvalue(samples_BN: np.ndarray) -> float:
    """Chi-square test of the sampled N-token sequences against the bigram model's exact
    law (cells with fewer than 5 expected draws pooled)."""
    p_VV = np.exp(_TABLE_VV)
    expected, observed = [], []
    cells = {tuple(r): 0 for r in itertools.product(range(_V), repeat=_N)}
    for row in map(tuple, samples_BN):
        cells[row] += 1
    B = len(samples_BN)
    pool_e = pool_o = 0.0
    for seq, n in cells.items():
        prob, prev = 1.0, _START
        for t in seq:
            prob, prev = prob * p_VV[prev, t], t
        if prob * B < 5:
            pool_e, pool_o = pool_e + prob * B, pool_o + n
        else:
            expected.append(prob * B)
            observed.append(n)
    expected.append(pool_e)
    observed.append(pool_o)
    e, o = np.array(expected), np.array(observed)
    stat = float(((o - e) ** 2 / e).sum())
    return float(jax.scipy.special.gammaincc((len(e) - 1) / 2, stat / 2))


_B = 20_000


def test_rejection_sampling_keeps_the_target_distribution():
    """Speculative samples (point-mass drafts, and a drafter with its own q) follow the
    model's law of 3-token sequences; plain sampling, the reference, passes the same test."""
    p = np.exp(_TABLE_VV)
    plain = np.zeros((_B, _N), np.int64)
    rng = np.random.default_rng(0)
    prev = np.full(_B, _START)
    for i in range(_N):
        u = rng.random(_B)[:, None]
        plain[:, i] = prev = (np.cumsum(p[prev], 1) < u).sum(1)
    assert _chi2_pvalue(plain) > 1e-3
    assert _chi2_pvalue(_speculative_samples(_B)) > 1e-3
    q_VV = np.full((_V, _V), 0.1) + 0.5 * np.eye(_V)[[2, 2, 4, 1, 0]]
    assert _chi2_pvalue(_speculative_samples(_B, q_VV / q_VV.sum(1, keepdims=True))) > 1e-3


def _sample_and_compare_samples(B: int, rule) -> np.ndarray:
    """B generations of _N tokens as the model runner verifies n-gram drafts: every
    verification row sampled from its own bigram distribution (given the fixed _DRAFT
    before it), then `rule(drafts, sampled_BK) -> (accepted_B, token_B)`."""
    p_VV, k = np.exp(_TABLE_VV), len(_DRAFT)
    rng = np.random.default_rng(2)
    out_BN = np.full((B, _N + k + 1), -1)
    count_B = np.zeros(B, np.int64)
    while (count_B < _N).any():
        ctx_B = np.where(count_B == 0, _START, out_BN[np.arange(B), np.maximum(count_B - 1, 0)])
        sampled_BK = np.stack([(np.cumsum(p_VV[c], 1) < rng.random(B)[:, None]).sum(1)
                               for c in (ctx_B, *[np.full(B, d) for d in _DRAFT])], 1)
        acc_B, tok_B = rule(_DRAFT, sampled_BK)
        for j in range(k + 1):
            put = (j <= acc_B) & (count_B < _N)
            row = np.where(j < acc_B, _DRAFT[min(j, k - 1)], tok_B)
            out_BN[put, count_B[put] + j] = row[put]
        count_B = np.where(count_B < _N, count_B + acc_B + 1, count_B)
    return out_BN[:, :_N]


def _runner_rule(drafts, sampled_BK):
    runs = [accept_sampled(drafts, row) for row in sampled_BK.tolist()]
    return np.array([a for a, _ in runs]), np.array([t for _, t in runs])


def test_sampling_every_row_and_comparing_is_exact_for_ngram_drafts():
    """The model runner's rule (lp_jax/spec/accept.py) keeps the model's law; it fails
    the same test when a rejected draft's token is drawn afresh (not the residual) or
    the bonus token comes from the last draft's row."""
    assert _chi2_pvalue(_sample_and_compare_samples(_B, _runner_rule)) > 1e-3
    rng = np.random.default_rng(3)
    p_VV = np.exp(_TABLE_VV)

    def fresh_residual(drafts, sampled_BK):
        acc_B, tok_B = _runner_rule(drafts, sampled_BK)
        ctx_B = np.array(drafts)[np.maximum(acc_B - 1, 0)]
        ctx_B = np.where(acc_B == 0, -1, ctx_B)  # row 0's context is not known here:
        redraw = (acc_B > 0) & (acc_B < len(drafts))  # redraw only rows after a draft
        fresh_B = (np.cumsum(p_VV[np.maximum(ctx_B, 0)], 1) < rng.random(len(acc_B))[:, None]
                   ).sum(1)
        return acc_B, np.where(redraw, fresh_B, tok_B)

    def bonus_from_last_draft_row(drafts, sampled_BK):
        acc_B, tok_B = _runner_rule(drafts, sampled_BK)
        k = len(drafts)
        return acc_B, np.where(acc_B == k, sampled_BK[:, k - 1], tok_B)

    for wrong in (fresh_residual, bonus_from_last_draft_row):
        assert _chi2_pvalue(_sample_and_compare_samples(_B, wrong)) < 1e-6, wrong.__name__


def _retraced():
    """The step traced afresh (a new function), so it sees a patched verify module."""
    return jax.jit(lambda *args: _bigram_step(*args))


def test_distribution_test_catches_a_wrong_residual_or_bonus(monkeypatch):
    """The same test fails when a rejected draft's token is drawn from p instead of the
    residual, or when the bonus token is drawn from the last draft's row."""
    with monkeypatch.context() as m:
        m.setattr(V, "residual_probs", lambda p, d, q=None: p)
        assert _chi2_pvalue(_speculative_samples(_B, step=_retraced())) < 1e-6
    shifted = lambda p, r, n: jnp.where(
        (jnp.arange(p.shape[1])[None, :] < n[:, None])[..., None], r, jnp.roll(p, 1, axis=1))
    with monkeypatch.context() as m:
        m.setattr(V, "final_probs", shifted)
        assert _chi2_pvalue(_speculative_samples(_B, step=_retraced())) < 1e-6


# ----- penalties inside a verification run -----


def test_verification_rows_count_the_drafts_before_them():
    """Row j of a run counts drafts 0..j-1 on top of its slot's counts; a row's token is
    committed (counted) iff every draft before it equals the token sampled before it."""
    from lp_jax.executor.sampler import add_drafts, drafts_stand

    # sampled rows: a plain decode, then a run of 4 rows verifying drafts (5, 5, 2)
    prefix_SK = np.full((5, 8), -1, np.int32)
    for j, d in enumerate([(), (), (5,), (5, 5), (5, 5, 2)]):
        prefix_SK[j, : len(d)] = d
    counts_SV = np.zeros((5, 7), np.int32)
    counts_SV[:, 5] = 1
    got = np.asarray(add_drafts(jnp.asarray(counts_SV), jnp.asarray(prefix_SK)))
    assert got[:, 5].tolist() == [1, 1, 2, 3, 3] and got[:, 2].tolist() == [0, 0, 0, 0, 1]
    assert got.sum() == counts_SV.sum() + 6
    for tokens, kept in (([4, 5, 5, 2, 3], [1, 1, 1, 1, 1]),   # every draft stands
                         ([4, 5, 6, 2, 3], [1, 1, 1, 0, 0]),   # draft 1 falls at row 1
                         ([4, 1, 5, 2, 3], [1, 1, 0, 0, 0]),   # draft 0 falls
                         ([5, 5, 5, 1, 3], [1, 1, 1, 1, 0])):  # draft 2 falls
        stand = drafts_stand(jnp.asarray(tokens, jnp.int32), jnp.asarray(prefix_SK))
        assert np.asarray(stand).astype(int).tolist() == kept, tokens
