"""The engine around an executor that computes nothing (tests/fake_executor.py): the
scheduling, abort, n > 1, prefix-cache and output plumbing of `LLMEngine` for every
policy, with nothing compiled. A fake token depends only on the sequence and its
position, so each request's tokens are known whatever the policy, the overlap, the
cache or the aborts around it. The real engine's tests (test_engine.py, test_logprobs.py,
test_prefix_cache.py) keep at least one case of each feature against the model."""

import numpy as np
import pytest
from conftest import short_request_ttft
from fake_executor import FakeExecutor, fake_logprob, fake_token

from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams
from lp_jax.executor import compile_guard

VOCAB = 512  # the tiny model's
POLICIES = {
    "orca": dict(scheduling="orca", max_num_batched_tokens=16),
    "chunked": dict(scheduling="chunked", max_num_batched_tokens=16),
    "layered": dict(scheduling="layered", layer_groups=2, max_num_batched_tokens=64),
    "layered-4": dict(scheduling="layered", layer_groups=4, max_num_batched_tokens=64),
    "layered-preemptible": dict(scheduling="layered", preemptible=True, layer_groups=4,
                                max_num_batched_tokens=64),
    "flowprefill": dict(scheduling="flowprefill", preemption_granularity="layer",
                        max_num_batched_tokens=64),
    "flowprefill-operator": dict(scheduling="flowprefill", preemption_granularity="operator",
                                 max_num_batched_tokens=64),
}


def fake_llm(policy="layered", **kw) -> LLM:
    args = dict(model=str(ensure_tiny(preset="tiny")), max_num_seqs=4, max_model_len=256,
                log=None, executor=FakeExecutor) | POLICIES[policy] | kw
    return LLM(**args)


def expected_tokens(seq_id: int, prompt_len: int, n: int) -> list[int]:
    return [fake_token(seq_id, prompt_len + i, VOCAB) for i in range(n)]


@pytest.fixture(autouse=True)
def _nothing_compiles():
    compile_guard.install()
    before = compile_guard.compilations()
    yield
    assert compile_guard.compilations() == before, "a fake-executor test compiled"


def _drive(eng, prompts, params, arrive, abort_at=None):
    """Adds prompt i at step arrive[i], aborts at abort_at[i]; returns finished outputs
    by index and the streamed deltas per request."""
    abort_at = abort_at or {}
    ids, outs, deltas, step = {}, {}, {}, 0
    while len(outs) < len(prompts):
        for i in range(len(prompts)):
            if arrive[i] == step:
                ids[i] = eng.add_request(prompts[i], params)
            if abort_at.get(i) == step and i in ids:
                eng.abort(ids[i])
        for out in eng.step():
            deltas.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                outs[[k for k, v in ids.items() if v == out.request_id][0]] = out
        step += 1
        assert step < 5000, "no progress"
    return ids, outs, deltas


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_with_aborts_give_each_request_its_tokens(policy, seed):
    """Random lengths, arrivals and aborts, with and without overlap: every survivor's
    tokens are its own fake tokens, streamed deltas add up to them, aborted ones hold a
    prefix of theirs, and every page comes back."""
    rng = np.random.default_rng(seed)
    n = 10
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 240))).tolist() for _ in range(n)]
    arrive = sorted(int(x) for x in rng.integers(0, 15, n))
    abort_at = {i: int(arrive[i] + rng.integers(0, 8)) for i in range(n) if rng.random() < 0.3}
    params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(2, 9)), ignore_eos=True)
    for overlap in (True, False):
        llm = fake_llm(policy, async_scheduling=overlap, kv_pages=40 + seed * 20)
        ids, outs, deltas = _drive(llm.engine, prompts, params, arrive, abort_at)
        for i, out in outs.items():
            want = expected_tokens(ids[i], len(prompts[i]), params.max_tokens)
            assert deltas[ids[i]] == out.token_ids
            if out.finish_reason == "abort":
                assert i in abort_at and out.token_ids == want[: len(out.token_ids)]
            else:
                assert out.token_ids == want and out.finish_reason == "length"
        s = llm.stats()
        assert s["free_pages"] == s["total_pages"] and s["programs"] == 0
        assert (s["overlapped_steps"] > 0) == overlap


def test_abort_in_every_state_frees_all_pages():
    """Moved from test_engine.py: an abort while decoding, while in a layered batch part
    way through its groups, and while waiting; an unknown id is refused."""
    llm = fake_llm("layered")
    eng = llm.engine
    long_params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    decoding = eng.add_request(list(range(40)), long_params)
    eng.step()
    eng.step()  # now decoding
    in_flight = eng.add_request(list(range(64)), long_params)  # a 2-group layered batch
    waiting = eng.add_request(list(range(100)), long_params)
    while not eng.scheduler.policy.in_flight():
        eng.step()
    assert eng.abort(in_flight) and eng.abort(waiting) and eng.abort(decoding)
    assert not eng.abort(12345)
    finished = {}
    while eng.has_unfinished():
        for out in eng.step():
            finished[out.request_id] = out
    assert {finished[r].finish_reason for r in (in_flight, waiting, decoding)} == {"abort"}
    s = llm.stats()
    assert s["free_pages"] == s["total_pages"] and s["aborted"] == 3


def test_bad_requests_fail_alone_and_leak_nothing():
    """Moved from test_engine.py: each bad request raises and changes nothing; the good
    one runs to its tokens."""
    llm = fake_llm("layered")
    eng = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    good = eng.add_request(list(range(1, 41)), greedy)
    for bad in ([], [1] * 4000, [3, 600, 5], [-1, 4]):
        with pytest.raises(ValueError):
            eng.add_request(bad, greedy)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert list(done) == [good] and done[good].token_ids == expected_tokens(good, 40, 6)
    s = llm.stats()
    assert s["free_pages"] == s["total_pages"]


@pytest.mark.parametrize("policy", POLICIES)
def test_n_samples_take_the_prompt_from_the_cache(policy):
    """n = 3: the later samples wait for the first's prefill and read its full pages from
    the prefix cache; each sample gets its own tokens, in index order."""
    llm = fake_llm(policy)
    prompt = list(range(3, 83))  # 80 tokens: five full pages of 16
    outs = llm.generate(prompt_token_ids=[prompt],
                        sampling_params=SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    samples = outs[0].outputs
    assert [s.index for s in samples] == [0, 1, 2]
    ids = [outs[0].request_id + i for i in range(3)]
    assert [s.token_ids for s in samples] == [expected_tokens(i, 80, 4) for i in ids]
    s = llm.stats()
    assert s["prefix_cache_hits"] == 2 * 64  # 4 full pages each: the last token computes
    assert s["free_pages"] == s["total_pages"]


@pytest.mark.parametrize("policy", ["chunked", "layered", "flowprefill"])
def test_logprobs_and_prompt_logprobs_reach_the_outputs(policy):
    """The executor's log-probabilities land in the outputs: one dict per output token
    with the sampled token first and k alternatives; per prompt position (None at 0) the
    prompt token's and k alternatives, also for a prompt cut into chunks and groups."""
    llm = fake_llm(policy)
    prompt = list(range(5, 105))  # 100 tokens: several chunks / groups
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2,
                            prompt_logprobs=3)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert next(iter(lp)) == tok and lp[tok] == fake_logprob(tok) and len(lp) == 3
    plp = out.prompt_logprobs
    assert len(plp) == 100 and plp[0] is None
    for p in range(1, 100):
        assert next(iter(plp[p])) == prompt[p] and len(plp[p]) == 4, p


def test_a_cached_prefix_is_skipped_and_counted():
    """A second request with the first's 64-token prefix computes only the rest: the
    cache reports the hit, and its tokens are still its own."""
    llm = fake_llm("chunked")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    system = list(range(100, 164))
    first = llm.generate(prompt_token_ids=[system + [1, 2, 3]], sampling_params=params)[0]
    second = llm.generate(prompt_token_ids=[system + [4, 5]], sampling_params=params)[0]
    assert second.num_cached_tokens == 64 and first.num_cached_tokens == 0
    assert second.token_ids == expected_tokens(second.request_id, 66, 3)
    assert llm.stats()["prefix_cache_hits"] == 64


def test_an_executor_is_for_one_process():
    with pytest.raises(ValueError, match="one process"):
        fake_llm("chunked", num_processes=2, process_id=0, coordinator_address="x:1")


def _short_ttft(policy, urgent_at=None, **kw):
    """TTFT of a 5-token request under a virtual clock: alone (urgent_at None), or
    arriving at virtual time `urgent_at` while a 60-token prompt prefills. Also returns
    the predicted step time of each plan that carried the long prompt."""
    return short_request_ttft(fake_llm(policy, virtual_clock=True, **kw), urgent_at)


@pytest.mark.parametrize("policy,preemptible", [
    ("flowprefill-operator", True), ("flowprefill", True), ("layered-preemptible", True),
    ("layered-4", False)])
def test_engine_blocking_of_an_urgent_arrival(policy, preemptible):
    """Engine blocking, measured as FlowPrefill means it (issue #30): an urgent request
    stamped at its nominal arrival, during a long prefill, on the virtual clock so the
    figure is the schedule's and not the host's. Its extra TTFT over running alone is at
    most two segments of the long prefill under a preemptible policy (with overlapped
    scheduling two plans are outstanding), and more than that under plain layered
    prefill, which finishes the batch's groups first."""
    alone, _ = _short_ttft(policy)
    for urgent_at in (0.002, 0.004, 0.006):
        ttft, long_steps = _short_ttft(policy, urgent_at)
        blocking, bound = ttft - alone, 2 * max(long_steps)
        if preemptible:
            assert blocking <= bound + 1e-9, (urgent_at, blocking, long_steps)
        elif urgent_at == 0.002:  # early in the batch: it waits for most of it
            assert blocking > bound, (blocking, long_steps)
