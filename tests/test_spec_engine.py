"""Speculative decoding in the scheduler and the engine, on the fake executor (nothing
compiles): a fake token depends only on the sequence and its position, and the fake
verifies drafts by the greedy rule, so speculation must leave every output as it is,
under every policy, with and without overlap; rejected drafts leave no page behind and
nothing in the prefix cache; the drafts are counted as vLLM's metrics."""

import numpy as np
import pytest
from fake_executor import fake_token
from test_engine_fake import POLICIES, VOCAB, _drive, expected_tokens, fake_llm

from lp_jax import LLM, SamplingParams
from lp_jax.core.sequence import Sequence

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def _future(sid: int, prompt_len: int, n: int) -> list[int]:
    return [fake_token(sid, prompt_len + i, VOCAB) for i in range(n)]


def _prompts(L: int = 40) -> list[list[int]]:
    """Request 0 quotes its own future (drafts accepted), request 1 quotes it with every
    third token wrong (drafts part-rejected), request 2 is unrelated text."""
    good = _future(0, L, L - 8) + list(range(8))
    bad = [t if i % 3 else (t + 1) % VOCAB for i, t in enumerate(_future(1, L, L - 8))]
    return [good, bad + list(range(8)), [(5 * i + 3) % VOCAB for i in range(L)]]


def _run(policy, spec, overlap, params, num_prompts=3):
    llm = fake_llm(policy, async_scheduling=overlap, speculative_config=spec)
    outs = llm.generate(prompt_token_ids=_prompts()[:num_prompts], sampling_params=params)
    cfg = llm.engine.scheduler.config
    for plan in llm.engine.runner.plans:
        # verification rows count in a budget that counts decodes, and every sampled
        # row fits the step's max_num_seqs sampled rows
        assert plan.num_decode_rows + plan.num_prefill_tokens <= (
            cfg.max_num_batched_tokens if policy == "chunked" else 10**9)
        assert plan.num_decode_rows + len(plan.sampling_seqs) - len(plan.decode) <= (
            cfg.max_num_seqs)
    return outs, llm.stats()


@pytest.mark.parametrize("policy", POLICIES)
def test_speculation_changes_no_output_under_every_policy(policy):
    """Greedy outputs, stop ids, max_tokens, logprobs and n > 1 are the same with n-gram
    drafts as without, with fewer steps; every page comes back."""
    stop = _future(0, 40, 20)[13]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2,
                             stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    for overlap in (True, False):
        base, s0 = _run(policy, None, overlap, params)
        spec, s1 = _run(policy, NGRAM, overlap, params)
        for b, o in zip(base, spec, strict=True):
            assert [c.token_ids for c in o.outputs] == [c.token_ids for c in b.outputs]
            assert [c.finish_reason for c in o.outputs] == [c.finish_reason for c in b.outputs]
            assert [c.logprobs for c in o.outputs] == [c.logprobs for c in b.outputs]
        assert base[0].outputs[0].token_ids[-1] == stop  # request 0 ends at its stop id
        assert s1["spec_decode_num_accepted_tokens"] > 0
        assert s1["spec_decode_num_draft_tokens"] > s1["spec_decode_num_accepted_tokens"]
        assert s0["spec_decode_num_drafts"] == 0
        assert s1["free_pages"] == s1["total_pages"]
    # Request 0 alone (its drafts all stand) takes fewer steps.
    steps = [_run(policy, spec, False, params[:1], 1)[1]["iterations"] for spec in (None, NGRAM)]
    assert steps[1] < steps[0]


def test_policies_and_the_latency_model_count_verification_rows(monkeypatch):
    """Each policy's prefill half is planned next to the plan's decode rows (drafts
    included), which the adaptive layer-group span and chunked's budget spend, and the
    latency model predicts and fits a plan by its rows."""
    llm = fake_llm("layered", layer_groups="adaptive", tbt_slo_ms=50.0, max_num_seqs=16,
                   speculative_config=NGRAM, async_scheduling=False)  # room: no draft dropped
    sched = llm.engine.scheduler
    seen = []
    real = sched.policy.schedule_prefill
    monkeypatch.setattr(sched.policy, "schedule_prefill",
                        lambda n, admit: seen.append(n) or real(n, admit))
    llm.generate(prompt_token_ids=_prompts()[:2],
                 sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    rows = [p.num_decode_rows for p in llm.engine.runner.plans]
    assert seen == rows and max(r - len(p.decode) for r, p in
                                zip(rows, llm.engine.runner.plans, strict=True)) > 0
    plan = next(p for p in llm.engine.runner.plans if p.drafts)
    assert sched.latency.plan_features(plan)[5] == plan.num_layers * plan.num_decode_rows


def test_flowprefill_counts_verification_rows():
    """FlowPrefill's slack sees a speculating decode as its k + 1 rows."""
    llm = fake_llm("flowprefill", speculative_config=NGRAM)
    sched = llm.engine.scheduler
    plain, penalized = (Sequence(i, [1, 2], SamplingParams(presence_penalty=x)) for i, x in
                        ((0, 0.0), (1, 0.5)))
    assert (sched.max_decode_rows(plain), sched.max_decode_rows(penalized)) == (4, 4)
    sched.running += [plain, penalized]
    sched.policy._remaining([(8, 0)], 0)
    assert sched.policy._load == (8, 4)


@pytest.mark.parametrize("policy", ["chunked", "layered-preemptible", "flowprefill"])
def test_random_workloads_with_aborts_and_preemptions_leak_nothing(policy):
    """Echoing and unrelated prompts arriving at random, some aborted, on a pool small
    enough to preempt: every survivor gets its own tokens, aborted ones a prefix, and
    every page comes back."""
    rng = np.random.default_rng(1)
    n = 10
    prompts = []
    for i in range(n):
        L = int(rng.integers(20, 60))
        prompts.append(_future(i, L, L) if i % 2 else rng.integers(0, VOCAB, L).tolist())
    arrive = list(range(n))  # request i is id i: its echo prompt quotes its own future
    abort_at = {i: i + int(rng.integers(1, 8)) for i in range(n) if rng.random() < 0.3}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    preemptions = 0
    for overlap in (True, False):
        llm = fake_llm(policy, async_scheduling=overlap, kv_pages=10,
                       speculative_config=NGRAM)
        ids, outs, deltas = _drive(llm.engine, prompts, params, arrive, abort_at)
        for i, out in outs.items():
            want = expected_tokens(ids[i], len(prompts[i]), params.max_tokens)
            assert deltas[ids[i]] == out.token_ids
            if out.finish_reason == "abort":
                assert out.token_ids == want[: len(out.token_ids)]
            else:
                assert out.token_ids == want
        s = llm.stats()
        assert s["free_pages"] == s["total_pages"]
        assert s["spec_decode_num_accepted_tokens"] > 0 and s["aborted"] > 0
        preemptions += s["preemptions"]
    assert preemptions > 0


def test_rejected_drafts_free_their_pages_and_never_reach_the_prefix_cache():
    """Drafts that cross into a new page and are all rejected give that page back at
    commit, and the prefix cache never answers for a prompt holding a rejected draft."""
    L, P = 10, 4
    f = _future(0, L, 6)
    prompt = [f[0], 7, 7, 7, 1, 2, 3, 4, 5, 6]  # after f0 the 1-gram drafts 7 7 7
    assert 7 not in f[:2] and f[0] not in prompt[1:]
    llm = fake_llm("chunked", page_size=P, async_scheduling=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 1})
    eng, bm = llm.engine, llm.engine.scheduler.block_manager
    sid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()  # the prefill samples f0
    seq = eng.scheduler.get(sid)
    plan = eng.scheduler.schedule(eng.clock.now())
    assert plan.drafts == ((7, 7, 7),) and len(seq.page_ids) == 4  # rows at 10..13
    eng.scheduler.commit(plan, eng.runner.dispatch(plan).collect(), eng.clock.now())
    assert seq.token_ids[L:] == f[:2]  # all three rejected, f1 after them
    assert len(seq.page_ids) == 3 and bm.num_free_pages == bm.num_pages - 3
    s = llm.stats()
    assert (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"],
            s["spec_decode_num_accepted_tokens"]) == (1, 3, 0)
    while eng.has_unfinished():
        eng.step()
    assert bm.num_free_pages == bm.num_pages
    real = prompt + f
    assert bm.cached_prefix(Sequence(99, real + [0]), len(real)) == 12
    for j in range(L, L + 4):  # a rejected draft at position j: no hit reaches it
        impostor = real[:j] + [7] + real[j + 1:]
        assert bm.cached_prefix(Sequence(98, impostor), len(impostor)) <= j


def test_speculative_config_errors():
    """A bad speculative_config fails at LLM() with the key named."""
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        fake_llm("layered", speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        fake_llm("layered", speculative_config='{"method": "ngram", "k": 2}')


@pytest.mark.parametrize("policy", ["orca", "chunked", "layered", "flowprefill"])
def test_speculation_equals_plain_decoding_on_the_golden_checkpoint(engines, policy):
    """The golden tiny checkpoint (float32) gives the same greedy and seeded sampled
    tokens with n-gram drafts verified as k + 1 rows as the shared engine without
    (log-probabilities to float noise: the rows take the ragged attention path), some
    drafts accepted (their KV then serves later tokens), with the shared engine's
    programs and no compile while serving."""
    rng = np.random.default_rng(0)
    pat = rng.integers(0, VOCAB, 12).tolist()
    prompts = [pat * 4, rng.integers(0, VOCAB, 30).tolist(), pat[:5] * 6, pat * 3]
    # greedy, and seeded sampling: a row keyed by (seed, position) draws what plain
    # decoding draws there once the drafts before it stand (lp_jax/spec/accept.py)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40, ignore_eos=True, logprobs=1)
              for t, s in ((0.0, None), (0.8, 7), (1.0, 11), (0, None))]
    llm = LLM(**engines.kwargs(policy), speculative_config=NGRAM)
    _same_outputs(engines(policy), llm, prompts, params)
    s = llm.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["compilations_after_warmup"] == 0
    assert s["programs"] == engines(policy).stats()["programs"]
    assert s["free_pages"] == s["total_pages"]


def _same_outputs(base_llm, spec_llm, prompts, params):
    """Both engines' tokens are equal, and their log-probabilities to float noise (the
    verification rows take the ragged attention path)."""
    base = base_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    spec = spec_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for b, o in zip(base, spec, strict=True):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(b.outputs[0].logprobs or (), o.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            np.testing.assert_allclose(list(y.values()), list(x.values()), atol=1e-4)
    return spec


def test_penalized_sequences_speculate_with_counts_after_the_drafts(engines):
    """Presence, frequency and repetition penalties (greedy, and seeded sampling with all
    three) give the shared engine's tokens and log-probabilities with speculation, drafts
    accepted and rejected. Row j counts drafts 0..j-1, and only committed tokens are
    counted: token 7, biased by +10 and penalized by 2 per occurrence, is the argmax
    three times, so of the drafts 7 7 7 after the first 7 the third must fall (a row that
    ignored the accepted drafts before it would keep it), and the slot's device counts
    end equal to the output (a rejected row's token counted would break that)."""
    rng = np.random.default_rng(0)
    pat = rng.integers(0, VOCAB, 12).tolist()
    r7 = np.random.default_rng(0)
    sevens = [r7.integers(0, VOCAB, 10).tolist() + [7] * 6,
              r7.integers(0, VOCAB, 10).tolist() + [9, 7, 7, 7, 9]]
    prompts = [pat * 4, pat[:5] * 6, pat * 3, rng.integers(0, VOCAB, 30).tolist(), *sevens]
    # negative penalties make the random-weight model repeat itself, so drafts stand
    pens = ({"frequency_penalty": -2.0}, {"presence_penalty": -1.5}, {"repetition_penalty": 0.7},
            {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 0.8},
            {"frequency_penalty": 2.0, "logit_bias": {7: 10.0}},
            {"frequency_penalty": 2.0, "logit_bias": {7: 10.0}, "repetition_penalty": 1.2})
    params = [SamplingParams(temperature=0.9 if i in (3, 5) else 0.0, seed=3, max_tokens=24,
                             ignore_eos=True, logprobs=1, **pen) for i, pen in enumerate(pens)]
    llm = LLM(**engines.kwargs("chunked"), speculative_config=NGRAM)
    # alone first: max_num_seqs = 4 sampled rows leave room for one decode's 3 drafts
    out = _same_outputs(engines("chunked"), llm, prompts[4:5], params[4:5])
    assert out[0].outputs[0].token_ids[:4] == [7, 7, 7, 192]  # the penalty binds in a run
    assert llm.stats()["spec_decode_num_accepted_tokens"] == 2  # 7 7 (7) after the first
    # the device counts of its slot hold exactly its output: no rejected row's token
    want_V = np.bincount(out[0].outputs[0].token_ids, minlength=VOCAB)
    counts_XV = np.asarray(llm.engine.runner.counts["output_XV"])
    assert any((row_V == want_V).all() for row_V in counts_XV)
    _same_outputs(engines("chunked"), llm, prompts, params)
    s = llm.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"]
    assert s["compilations_after_warmup"] == 0
    assert s["programs"] == engines("chunked").stats()["programs"]
    assert s["free_pages"] == s["total_pages"]


def test_lp_serve_flag_and_prometheus_metrics():
    """`lp-serve --speculative-config JSON` reaches EngineConfig (a bad one stops the
    parser); the engine's counters render as lp: metrics, and vLLM's names with
    --vllm-metric-names."""
    from lp_jax import serve
    from lp_jax.server.metrics import ServerMetrics
    from lp_jax.server.prometheus import parse_text

    args = serve.build_parser().parse_args(["--speculative-config", '{"method": "ngram", '
                                            '"num_speculative_tokens": 4}'])
    assert serve.engine_config(args).speculative_config.num_speculative_tokens == 4
    assert serve.engine_config(serve.build_parser().parse_args([])).speculative_config is None
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--speculative-config", '{"method": "eagle"}'])
    llm = fake_llm("chunked", speculative_config=NGRAM, async_scheduling=False)
    llm.generate(prompt_token_ids=_prompts()[:1],
                 sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stats = llm.stats()
    m = ServerMetrics("tiny", vllm_names=True)
    m.update_from_engine(stats, running=0, waiting=0)
    got = parse_text(m.render())
    assert got['lp:spec_decode_num_accepted_tokens_total{model_name="tiny"}'] == \
        stats["spec_decode_num_accepted_tokens"] > 0
    assert got['vllm:spec_decode_num_drafts_total{model_name="tiny"}'] == \
        stats["spec_decode_num_drafts"] > 0
    assert got['lp:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",'
               'position="0"}'] == stats["spec_decode_num_accepted_tokens_pos_0"] > 0


def test_grammar_masks_each_verification_row_after_its_drafts(engines):
    """Under a grammar, verification row j is masked by the matcher after drafts 0..j-1
    (consumed, then rolled back); drafts the grammar forbids are rejected. Greedy and
    seeded outputs equal the shared engine's without speculation, every output matches
    its regex, and every matcher and page is released."""
    import re

    from lp_jax.structured.params import StructuredOutputsParams as SO

    regex, trigger = "(one two three ){4}four", "(ab|cd) (ab|cd) (ab|cd) end"
    prompts = ["one two three one two four", "ab cd ab cd ab ab cd", "one two three"]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40,
                             structured_outputs=SO(regex=r))
              for t, s, r in ((0.0, None, regex), (0.0, None, trigger), (0.9, 5, regex))]
    base = engines("chunked").generate(prompts, params)
    llm = LLM(**engines.kwargs("chunked"), speculative_config=NGRAM)
    spec = llm.generate(prompts, params)
    for b, o, p in zip(base, spec, params, strict=True):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids
        assert re.fullmatch(p.structured_outputs.regex, o.outputs[0].text), o.outputs[0].text
    s = llm.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"]
    assert s["structured_outputs"]["live"] == 0 and s["free_pages"] == s["total_pages"]
    assert s["compilations_after_warmup"] == 0
