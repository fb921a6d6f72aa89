"""Automatic prefix caching: page hashes, shared pages, eviction, the publication rule
under every policy, and the engine and server end to end on the tiny model (greedy
tokens with hits equal those computed from scratch)."""

import pytest
from conftest import make_sched_cfg as make_cfg
from conftest import make_seq as seq
from test_scheduler import FakeExecutor, check_invariants, drive

from lp_jax.core.block_manager import BlockManager, hash_page
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.scheduler import Scheduler
from lp_jax.core.slo import SLO

SYSTEM = [(7 * j + 3) % 1000 for j in range(64)]  # a shared "system prompt"


def cached_cfg(policy, **kw):
    return make_cfg(policy, enable_prefix_caching=True, **kw)


def step(sched, ex, now):
    plan = sched.schedule(float(now))
    sched.commit(plan, ex.run(plan), float(now) + 1)
    check_invariants(sched)
    return plan


def first_chunk(ex, seq_id):
    return next((c.start, c.end) for p in ex.plans for c in p.prefill if c.seq.seq_id == seq_id)


# ----- the block manager -----
def test_page_hashes_chain_over_the_whole_prefix():
    a, b = hash_page(b"p", [1, 2]), hash_page(b"q", [1, 2])
    assert a != b and a == hash_page(b"p", [1, 2]) and len(a) == 32
    assert hash_page(b"p", [1, 2], extra=b"lora-1") != a  # the slot for other KV inputs
    assert hash_page(b"p", [2, 1]) != a
    bm = BlockManager(16, 4, enable_caching=True)
    x, y = seq(0, [5, 6, 7, 8, 1, 2, 3, 4, 9]), seq(1, [0, 6, 7, 8, 1, 2, 3, 4, 9])
    bm.allocate(x, 9)
    bm.publish(x, 9)
    assert len(x.page_hashes) == 2 and bm.num_cached_pages == 2
    # page 1 holds the same tokens, but its parent differs: no hit anywhere
    assert bm.cached_prefix(y, 9) == 0
    assert bm.cached_prefix(seq(2, [5, 6, 7, 8, 1, 2, 3, 0, 0]), 9) == 4
    assert bm.cached_prefix(seq(3, x.token_ids), 9) == 8


def test_shared_pages_are_reference_counted():
    bm = BlockManager(8, 4, enable_caching=True)
    a, b, c = seq(0, range(10)), seq(1, range(10)), seq(2, range(8))
    assert bm.allocate(a, 10) == 0
    bm.publish(a, 10)  # pages 0 and 1 are full; page 2 (tokens 8, 9) is not
    # c's last page is cached too, but its last token must be computed: page 1 again
    assert bm.allocate(b, 10) == 8 and bm.allocate(c, 8) == 4
    assert b.page_ids[:2] == a.page_ids[:2] and c.page_ids[0] == a.page_ids[0]
    assert c.page_ids[1] not in a.page_ids
    assert bm.num_free_pages == 8 - 3 - 1 - 1
    bm.free(a)
    assert bm.num_free_pages == 3 + 1  # a's own last page; the shared ones are held
    with pytest.raises(RuntimeError, match="no pages"):
        bm.free(a)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_pages == 8 and bm.num_cached_pages == 2
    with pytest.raises(RuntimeError, match="does not hold"):
        b.page_ids = [0]
        bm.free(b)


def test_free_cached_pages_are_hit_until_evicted_least_recently_freed_first():
    bm = BlockManager(4, 2, enable_caching=True)
    a, b = seq(0, [1, 1, 2, 2, 9]), seq(1, [3, 3, 4, 4, 9])
    for s in (a, b):
        bm.allocate(s, 4)
        bm.publish(s, 4)
    pages_a, pages_b = list(a.page_ids), list(b.page_ids)
    bm.free(a)
    bm.free(b)  # LRU order: a's tail, a's head, b's tail, b's head
    assert bm.num_free_pages == 4 and bm.num_cached_pages == 4
    assert bm.cached_prefix(seq(2, a.token_ids), 5) == 4
    fresh = seq(3, [0] * 3)
    bm.allocate(fresh, 3)  # two fresh pages: a's tail, then a's head are evicted
    assert fresh.page_ids == [pages_a[1], pages_a[0]] and bm.num_cached_pages == 2
    assert bm.cached_prefix(seq(4, a.token_ids), 5) == 0
    assert bm.cached_prefix(seq(5, b.token_ids), 5) == 4
    # a hit takes a free cached page out of the pool: b's pages cover 4 tokens, one more
    # page is needed and none is left after them
    assert not bm.can_allocate(seq(6, b.token_ids + [1, 1]), 6)
    hit = seq(7, b.token_ids)
    assert bm.allocate(hit, 4) == 2 and hit.page_ids[0] == pages_b[0]


def test_reset_only_when_no_page_is_held():
    bm = BlockManager(4, 2, enable_caching=True)
    a = seq(0, [1, 2, 3])
    bm.allocate(a, 3)
    bm.publish(a, 3)
    assert not bm.reset_prefix_cache() and bm.num_cached_pages == 1
    bm.free(a)
    assert bm.reset_prefix_cache() and bm.num_cached_pages == 0 and bm.num_free_pages == 4
    assert bm.cached_prefix(seq(1, [1, 2, 3]), 3) == 0


def test_caching_off_shares_nothing():
    bm = BlockManager(8, 2)
    a, b = seq(0, [1, 2, 3]), seq(1, [1, 2, 3])
    bm.allocate(a, 3)
    bm.publish(a, 3)
    assert bm.allocate(b, 3) == 0 and not set(a.page_ids) & set(b.page_ids)


# ----- the scheduler -----
@pytest.mark.parametrize("policy", ["orca", "chunked", "layered", "flowprefill"])
def test_a_shared_prefix_skips_its_prefill(policy):
    sched = Scheduler(cached_cfg(policy, page_size=16))
    first = seq(0, SYSTEM + [1, 2, 3], 3)
    second = seq(1, SYSTEM + [4, 5, 6, 7], 3, arrival_time=50)
    same = seq(2, SYSTEM + [1, 2, 3], 3, arrival_time=60)  # an equal prompt
    whole = seq(3, SYSTEM, 3, arrival_time=70)  # every page cached: the last is recomputed
    ex = drive(sched, [first, second, same, whole])
    assert first_chunk(ex, 0) == (0, 67)
    assert first_chunk(ex, 1) == (64, 68)
    assert first_chunk(ex, 2) == (64, 67)
    assert first_chunk(ex, 3) == (48, 64)
    assert [s.num_cached_tokens for s in (first, second, same, whole)] == [0, 64, 64, 48]
    st = sched.stats()
    assert st["prefix_cache_queries"] == 67 + 68 + 67 + 64
    assert st["prefix_cache_hits"] == 64 + 64 + 48
    assert st["prefill_tokens"] == 67 + 4 + 3 + 16


def test_decode_pages_are_published_once_written():
    sched = Scheduler(cached_cfg("chunked", page_size=4))
    a = seq(0, range(6), 10)
    ex = drive(sched, [a])
    # a's KV covers its 6 prompt tokens and 9 of its 10 outputs: 3 full pages
    assert sched.block_manager.num_cached_pages == 3
    b = seq(1, a.token_ids[:13] + [999], 2)
    ex = drive(sched, [b], ex=ex)
    assert first_chunk(ex, 1) == (12, 14)


def test_layered_publishes_a_batch_only_after_its_last_group():
    sched = Scheduler(cached_cfg("layered", layer_groups=4, page_size=16))
    ex = FakeExecutor(sched)
    sched.add(seq(0, SYSTEM + [1], 2))
    late = seq(1, SYSTEM + [2], 2, arrival_time=1)
    bm = sched.block_manager
    for g in range(4):
        plan = step(sched, ex, g)
        assert plan.group_index == g
        if g == 1:
            sched.add(late)
        # the batch's pages are written group by group: none may be hit meanwhile
        assert bm.num_cached_pages == (4 if g == 3 else 0)
        if g >= 1:
            assert sched.prefill_start(late) == (64 if g == 3 else 0)
    plan = step(sched, ex, 4)
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(1, 64, 65)]
    drive(sched, ex=ex)


@pytest.mark.parametrize("policy", ["flowprefill", "layered-preemptible"])
def test_a_paused_batch_publishes_nothing(policy):
    """An urgent request with the same prefix preempts a batch mid-layers: it must not
    hit the batch's half-written pages, and computes them itself."""
    kw = (dict(preemptible=True, layer_groups=4) if policy == "layered-preemptible"
          else dict(preemption_granularity="layer"))
    sched = Scheduler(cached_cfg(policy.split("-")[0], page_size=16, **kw))
    ex = FakeExecutor(sched)
    slow = seq(0, SYSTEM + [1], 2)
    urgent = seq(1, SYSTEM + [2], 2, arrival_time=1, slo=SLO(ttft_s=3.0))
    sched.add(slow)
    step(sched, ex, 0)
    sched.add(urgent)
    plan = step(sched, ex, 1)
    assert [c.seq.seq_id for c in plan.prefill] == [1]  # the batch of `slow` is paused
    assert first_chunk(ex, 1) == (0, 65) and sched.stats()["prefill_pauses"] == 1
    assert sched.block_manager.num_cached_pages == 0
    drive(sched, ex=ex)
    assert urgent.num_cached_tokens == 0 and slow.num_cached_tokens == 0
    later = seq(2, SYSTEM + [3], 2, arrival_time=0)
    drive(sched, [later], ex=ex)
    assert first_chunk(ex, 2) == (64, 65)


def test_a_preempted_paused_batch_publishes_nothing():
    # Layer segments, a layered group per layer: decodes run in every plan.
    sched = Scheduler(cached_cfg("flowprefill", page_size=16, num_pages=9, max_num_seqs=4,
                                 preemption_granularity="layer", layer_groups=8))
    decode = seq(0, [5] * 46, 40)  # 3 pages; a 4th at its 3rd output
    slow = seq(1, SYSTEM + [1], 2, arrival_time=8)  # 5 pages, paused by `urgent`
    urgent = seq(2, [9] * 15, 2, arrival_time=9, slo=SLO(ttft_s=1.0))  # the last page
    ex = drive(sched, [decode, slow, urgent])
    assert sched.stats()["paused_prefills_preempted"] == 1
    starts = [c.start for p in ex.plans for c in p.prefill if c.seq is slow and p.is_first_group]
    # Paused at its first layer and preempted: none of its pages was published, so it is
    # recomputed in full. Preempted again as a decode, once its prefill had published
    # them, it recomputes from its first evicted page.
    assert starts == [0, 0, 48] and slow.num_preemptions == 2
    assert sched.block_manager.num_free_pages == sched.config.num_pages


@pytest.mark.parametrize("policy", ["chunked", "layered"])
def test_aborts_and_preemption_with_shared_pages_free_everything(policy):
    sched = Scheduler(cached_cfg(policy, page_size=4, num_pages=24, layer_groups=2,
                                 max_num_seqs=4))
    ex = FakeExecutor(sched)
    owner = seq(0, SYSTEM[:40], 2)
    drive(sched, [owner], ex=ex)
    reqs = [seq(i, SYSTEM[:40] + [i] * 3, 30, arrival_time=0) for i in (1, 2, 3)]
    for r in reqs:
        sched.add(r)
    step(sched, ex, 0)
    step(sched, ex, 1)
    sched.abort(1)
    ex = drive(sched, ex=ex)  # 10 shared + 2 x 8 own pages do not fit 24: preemptions
    assert sched.stats()["preemptions"] > 0 and reqs[0].finish_reason == "abort"
    assert all(r.num_cached_tokens == 40 for r in reqs[1:])
    bm = sched.block_manager
    assert bm.num_free_pages == 24 and not bm._holders
    assert sched.reset_prefix_cache() and bm.num_cached_pages == 0


def test_layered_groups_and_budget_count_only_uncached_tokens():
    long_system = [(5 * j + 1) % 1000 for j in range(2032)]  # 127 pages
    sched = Scheduler(cached_cfg("layered", page_size=16, max_model_len=4096))
    ex = drive(sched, [seq(0, long_system + [1], 2)])
    assert ex.plans[0].num_groups == 4  # 2033 tokens: G = 4 ("paper")
    ex = drive(sched, [seq(1, long_system + [2, 3], 2)], ex=ex)
    hit = next(p for p in ex.plans if p.prefill and p.prefill[0].seq.seq_id == 1)
    assert (hit.prefill[0].start, hit.num_groups) == (2032, 1)  # 2 tokens: one group
    # a budget of 64 takes three requests whose prompts are over 1,000 tokens long
    sched = Scheduler(cached_cfg("layered", page_size=16, max_model_len=4096,
                                 max_num_batched_tokens=64))
    ex = drive(sched, [seq(0, long_system[:1024] + [1], 2)])
    ex = drive(sched, [seq(i, long_system[:1024] + [i] * 20, 2) for i in (1, 2, 3)], ex=ex)
    batch = next(p for p in ex.plans if any(c.seq.seq_id == 1 for c in p.prefill))
    assert [(c.seq.seq_id, c.start, c.end) for c in batch.prefill] == [
        (1, 1024, 1044), (2, 1024, 1044), (3, 1024, 1044)]


# ----- the engine and the server, on the tiny model -----
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
POLICIES = ("orca", "chunked", "layered", "flowprefill")  # the run's shared engines


def engine_prompts():
    import numpy as np

    rng = np.random.default_rng(0)
    system = rng.integers(0, 509, 48).tolist()  # three pages
    prompts = [system + rng.integers(0, 509, n).tolist() for n in (50, 5)]
    return prompts + [prompts[1], system]  # an equal prompt, and the system prompt alone


@pytest.mark.parametrize("name", POLICIES)
def test_engine_tokens_with_hits_equal_those_computed_cold(name, engines):
    llm = engines(name)
    eng = llm.engine
    prompts = engine_prompts()
    cold = []
    for p in prompts:  # each alone on an empty cache: nothing hits
        assert eng.reset_prefix_cache()
        cold.append(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids)
    assert eng.reset_prefix_cache()
    before = llm.stats()
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)
    after = llm.stats()
    assert [o.token_ids for o in first + rest] == cold
    # three pages of the system prompt; the last page of a prompt that hits in full is
    # computed again (its last token must be)
    assert [o.num_cached_tokens for o in first + rest] == [0, 48, 48, 32]
    delta = {k: after[k] - before[k] for k in
             ("prefix_cache_queries", "prefix_cache_hits", "prefill_tokens")}
    total = sum(map(len, prompts))
    assert delta == {"prefix_cache_queries": total, "prefix_cache_hits": 128,
                     "prefill_tokens": total - 128}
    assert after["compilations_after_warmup"] == 0
    assert after["free_pages"] == after["total_pages"]


def test_server_reports_cached_tokens_and_resets_the_cache(engines):
    import json
    import time
    import urllib.error
    import urllib.request

    import openai

    from lp_jax.server import OpenAIServer, ServerThread
    from lp_jax.server.prometheus import parse_text

    eng = engines("chunked").engine
    st = ServerThread(OpenAIServer(eng, served_model_names=["tiny"])).start()
    try:
        def post_reset():
            req = urllib.request.Request(f"{st.url}/reset_prefix_cache", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as err:
                assert json.loads(err.read())["error"]["code"] == "busy"
                return err.code

        def wait_idle():
            deadline = time.monotonic() + 30
            while st.engine_call(lambda e: e.has_unfinished()):
                assert time.monotonic() < deadline
                time.sleep(0.02)

        client = openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0)
        prompt = engine_prompts()[0]
        kw = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        assert post_reset() == 200
        cold = client.completions.create(**kw)
        warm = client.completions.create(**kw)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens == 96  # (98 - 1) // 16 pages
        assert warm.choices[0].text == cold.choices[0].text
        msgs = [{"role": "system", "content": "You are a terse assistant. " * 4},
                {"role": "user", "content": "Hello"}]
        usage = []
        for _ in range(2):
            chunks = list(client.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=2, stream=True,
                stream_options={"include_usage": True}))
            usage.append(chunks[-1].usage)
        assert usage[0].prompt_tokens_details.cached_tokens == 0
        assert usage[1].prompt_tokens_details.cached_tokens == \
            (usage[1].prompt_tokens - 1) // 16 * 16 > 0
        text = urllib.request.urlopen(f"{st.url}/metrics", timeout=30).read().decode()
        m = parse_text(text)
        assert m['lp:prefix_cache_hits_total{model_name="tiny"}'] >= 96
        assert m['lp:prefix_cache_queries_total{model_name="tiny"}'] >= 2 * len(prompt)
        # while a request holds pages the cache is not reset (409, as vLLM); then it is
        busy = SamplingParams(max_tokens=60, ignore_eos=True)
        st.engine_call(lambda e: e.add_request(prompt, busy))
        assert post_reset() == 409
        wait_idle()
        assert post_reset() == 200
        assert client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        st.stop()


def test_on_by_default_and_the_serve_flag():
    from lp_jax.engine.config import EngineConfig
    from lp_jax.serve import build_parser, engine_config

    assert EngineConfig().enable_prefix_caching
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching=1)
    parse = build_parser().parse_args
    assert engine_config(parse([])).enable_prefix_caching
    assert not engine_config(parse(["--no-enable-prefix-caching"])).enable_prefix_caching


# ----- lp-bench's multi-turn chat workload -----
def test_multi_turn_workload_resends_the_history():
    from lp_jax.bench.workload import build_multi_turn_workload

    specs = build_multi_turn_workload(num_conversations=3, turns=3, rate=10.0, seed=1,
                                      system_len=20, user_len=5, output_len=4, turn_gap=1.0,
                                      max_prompt_len=40)
    assert [s.arrival for s in specs] == sorted(s.arrival for s in specs)
    assert all(len(s.prompt) == s.prompt_len for s in specs)
    assert sorted(s.prompt_len for s in specs) == [25] * 3 + [34] * 3  # turn 3 is 43 > 40
    by_len = {}
    for s in specs:
        by_len.setdefault(s.prompt_len, []).append(s)
    systems = {tuple(s.prompt[:20]) for s in specs}
    assert len(systems) == 1  # one system prompt for every conversation
    for second in by_len[34]:  # turn 2 starts with turn 1's prompt, after it
        first = [f for f in by_len[25] if f.prompt == second.prompt[:25]]
        assert len(first) == 1 and second.arrival == pytest.approx(first[0].arrival + 1.0)
    text = build_multi_turn_workload(num_conversations=1, turns=2, rate=1.0, user_len=3,
                                     output_len=2, prompt_kind="text")
    assert text[1].prompt.startswith(text[0].prompt + " ")


def test_lp_bench_multi_turn(mock_server):
    from lp_jax.bench.__main__ import run_cli

    results = run_cli([
        "--base-url", mock_server.url, "--workload", "multi-turn", "--turns", "3",
        "--system-len", "16", "--prompt-len", "4", "--output-len", "3", "--num-requests", "6",
        "--turn-gap", "0.05", "--request-rate", "50", "--no-progress"])
    recs = results["runs"][0]["records"]
    assert len(recs) == 6 and all(r.ok and r.completion_tokens == 3 for r in recs)
    assert sorted(r.prompt_len for r in recs) == [20, 20, 27, 27, 34, 34]
