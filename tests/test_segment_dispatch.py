"""FlowPrefill segments dispatched ahead (issue #30 finding 4; flowprefill.py "Lookahead"):
with `flowprefill_lookahead` k a plan carries a run of up to k of the running batch's
segments, and at most k + 1 are outstanding on the device. Host-only tests run the engine
on the fake executor (tests/fake_executor.py), blocking on the virtual clock; one test
compares greedy tokens on a shared engine's real programs."""

import pytest
from conftest import short_request_ttft
from fake_executor import FakeExecutor, fake_token

from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams
from lp_jax.bench.open_loop import use_policy
from lp_jax.core.slo import SLO
from lp_jax.engine.config import EngineConfig

L = 8  # the tiny model's layers
UNITS_PER_SEGMENT = {"operator": 1, "layer": 2}
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def fake_llm(granularity="operator", k=1, **kw) -> LLM:
    args = dict(model=str(ensure_tiny(preset="tiny")), max_num_seqs=4, max_model_len=256,
                log=None, executor=FakeExecutor, scheduling="flowprefill",
                preemption_granularity=granularity, max_num_batched_tokens=64,
                flowprefill_lookahead=k) | kw
    return LLM(**args)


def _segments(plan, granularity) -> int:
    return (plan.unit_end - plan.unit_start) // UNITS_PER_SEGMENT[granularity]


@pytest.mark.parametrize("granularity", ["operator", "layer"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_plan_carries_up_to_k_segments_and_at_most_k_plus_1_are_outstanding(
        granularity, overlap):
    """Each plan's span is whole segments, at most k of them; at every dispatch the
    outstanding plans hold at most k + 1 segments (k without overlap); the spans tile the
    stack once; k = 1 is one segment a plan, and k > 1 makes fewer plans than segments."""
    plans_by_k = {}
    for k in (1, 2, 4):
        llm = fake_llm(granularity, k, async_scheduling=overlap, prefill_only=True)
        eng = llm.engine
        dispatch, queued = eng.runner.dispatch, []

        def watched(plan, prev=None, eng=eng, dispatch=dispatch, queued=queued):
            queued.append(sum(_segments(p, granularity)
                              for p in eng.scheduler.outstanding_plans))
            return dispatch(plan, prev)

        eng.runner.dispatch = watched
        eng.add_request(list(range(1, 61)), ONE)
        while eng.has_unfinished():
            eng.step()
        plans = [p for p in eng.runner.plans if p.prefill]
        spans = [(p.unit_start, p.unit_end) for p in plans]
        assert spans[0][0] == 0 and spans[-1][1] == 2 * L
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert all(1 <= _segments(p, granularity) <= k for p in plans)
        assert all((p.unit_end - p.unit_start) % UNITS_PER_SEGMENT[granularity] == 0
                   for p in plans)
        assert max(queued) <= (k + 1 if overlap else k), queued
        plans_by_k[k] = len(plans)
    segments = 2 * L // UNITS_PER_SEGMENT[granularity]
    assert plans_by_k[1] == segments
    assert plans_by_k[4] < plans_by_k[2] < segments, plans_by_k


def test_decodes_still_ride_at_every_group_start():
    """Co-located: a request decodes while a 60-token prompt prefills in four layered
    groups under k = 4; no run crosses a group start, and each group start's plan carries
    the decode, as with one segment a plan."""
    starts = {}
    for k in (1, 4):
        llm = fake_llm("operator", k, layer_groups=4)
        eng = llm.engine
        dec = eng.add_request(list(range(300, 304)), SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True))
        while not eng.scheduler.running:
            eng.step()
        eng.add_request(list(range(1, 61)), ONE)
        while eng.has_unfinished():
            eng.step()
        plans = [p for p in eng.runner.plans if any(c.num_tokens > 4 for c in p.prefill)]
        groups = {4 * g for g in range(4)}  # units of 2-layer groups' starts
        assert all(not any(p.unit_start < u < p.unit_end for u in groups) for p in plans)
        starts[k] = [p.unit_start for p in plans if any(s.seq_id == dec for s in p.decode)]
        assert set(starts[k]) == groups, (k, starts[k])
    assert starts[1] == starts[4]


def _short_ttft(k, urgent_at=None, granularity="operator"):
    """A 5-token request's TTFT on the virtual clock, alone or arriving at `urgent_at`
    while a 60-token prompt prefills (tests/test_engine_fake.py's set-up); and the
    predicted time of each plan that carried the long prompt."""
    return short_request_ttft(fake_llm(granularity, k, virtual_clock=True), urgent_at)


def test_an_urgent_arrival_waits_at_most_k_plus_1_segments():
    """Blocking on the virtual clock (the urgent request's TTFT over its TTFT alone), for
    arrivals all through the long prefill: at most k + 1 of the long prompt's one-segment
    plans under a lookahead of k; and the lookahead costs waits (k = 4 blocks longer than
    k = 1 at some arrival, which a lookahead that was ignored would not)."""
    _, one_segment = _short_ttft(1, urgent_at=0.0)
    seg = max(one_segment)
    arrivals = [0.0005 * i for i in range(1, 21)]  # inside the long prefill
    blocked = {}
    for k in (1, 2, 4):
        alone, _ = _short_ttft(k)
        blocked[k] = [_short_ttft(k, t)[0] - alone for t in arrivals]
        assert max(blocked[k]) <= (k + 1) * seg + 1e-9, (k, blocked[k], seg)
    assert any(b4 > b1 + 1e-9 for b1, b4 in zip(blocked[1], blocked[4], strict=True))
    assert max(blocked[4]) > 2 * seg, (blocked[4], seg)  # beyond k = 1's bound


def test_an_abort_mid_lookahead_leaks_no_page_or_request():
    """The long prompt aborted while a run of its segments is outstanding: its pages
    come back once that plan completes, the other request still gets its own token, and
    nothing is left live."""
    llm = fake_llm("operator", 4, kv_pages=40)
    eng = llm.engine
    long_id = eng.add_request(list(range(1, 61)), ONE, slo=SLO(100.0))
    eng.step()  # the first run (four segments) is in flight
    outstanding = eng.scheduler.outstanding_plans
    assert outstanding and any(c.seq.seq_id == long_id for p in outstanding
                               for c in p.prefill)
    assert max(p.unit_end - p.unit_start for p in outstanding) > 1  # a run, not a segment
    other = eng.add_request(list(range(200, 230)), SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))
    assert eng.abort(long_id)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[long_id].finish_reason == "abort"
    assert done[other].token_ids == [fake_token(other, 30 + i, 512) for i in range(3)]
    s = llm.stats()
    assert s["free_pages"] == s["total_pages"] and s["aborted"] == 1
    assert not eng.scheduler.has_unfinished() and not eng.scheduler.outstanding_plans


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_bad_lookahead_is_refused(bad):
    with pytest.raises(ValueError, match="flowprefill_lookahead"):
        fake_llm("operator", bad)


def test_greedy_tokens_are_the_same_for_every_lookahead(engines):
    """Real numerics (the shared FlowPrefill engine's programs, layer granularity and
    operator): a run of segments in one call gives the tokens one-segment plans give,
    with a second request arriving mid-prefill and decodes riding at group starts."""
    llm = engines("flowprefill")
    eng = llm.engine
    own = eng.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[(7 * i + 3) % 500 for i in range(60)], [(5 * i + 1) % 500 for i in range(20)]]
    tokens, widest = {}, {}
    try:
        for granularity in ("layer", "operator"):
            for k in (1, 3):
                use_policy(eng, own.config, preemption_granularity=granularity,
                           flowprefill_lookahead=k)
                schedule = eng.scheduler.schedule
                spans = []

                def watched(now, schedule=schedule, spans=spans, g=granularity):
                    plan = schedule(now)
                    if plan.prefill:
                        spans.append(_segments(plan, g))
                    return plan

                eng.scheduler.schedule = watched
                ids = [eng.add_request(prompts[0], params)]
                eng.step()
                eng.step()
                ids.append(eng.add_request(prompts[1], params))
                out = {}
                while eng.has_unfinished():
                    for o in eng.step():
                        if o.finished:
                            out[o.request_id] = o.token_ids
                tokens[granularity, k] = [out[i] for i in ids]
                widest[granularity, k] = max(spans)
                free = eng.scheduler.block_manager.num_free_pages
                assert free == eng.scheduler.config.num_pages
    finally:
        eng.scheduler = own
    assert widest == {("layer", 1): 1, ("layer", 3): 3, ("operator", 1): 1,
                      ("operator", 3): 3}
    ref = tokens["layer", 1]
    assert all(len(t) == 4 for t in ref)
    assert {key: t for key, t in tokens.items() if t != ref} == {}


def test_the_engine_default_is_recorded():
    """The engine's default lookahead (chosen by launch/bench_segment_dispatch.py,
    BENCHMARKS.md) reaches the scheduler; the scheduler's own default stays 1."""
    from lp_jax.core.config import SchedulerConfig

    default = EngineConfig.__dataclass_fields__["flowprefill_lookahead"].default
    args = dict(model=str(ensure_tiny(preset="tiny")), max_num_seqs=4, max_model_len=256,
                log=None, executor=FakeExecutor, scheduling="flowprefill")
    assert LLM(**args).engine.scheduler.config.flowprefill_lookahead == default
    assert LLM(**args, flowprefill_lookahead=3).engine.scheduler.config \
        .flowprefill_lookahead == 3
    assert SchedulerConfig.__dataclass_fields__["flowprefill_lookahead"].default == 1


def test_simulator_pays_the_per_plan_overhead_once_per_run_of_segments():
    """The simulator drives the same policy: with a 2 ms overhead a plan, a lone
    operator-granular prefill takes 4x fewer plans under a lookahead of 4, and its
    TTFT drops by the overhead of the plans saved (each iteration's device time is the
    same sum of its segments' costs)."""
    from dataclasses import replace

    from lp_jax.core.slo import SLO
    from lp_jax.roofline import QWEN3_30B_A3B, get_hardware
    from lp_jax.sim import Request, SimConfig, Simulator

    base = SimConfig(shape=QWEN3_30B_A3B, hardware=get_hardware("h100"), policy="flowprefill",
                     preemption_granularity="operator", max_num_batched_tokens=2048,
                     segment_overhead_s=2e-3)
    runs = {k: Simulator(replace(base, flowprefill_lookahead=k)).run(
        [Request(0.0, 2000, 1, SLO(10.0))]) for k in (1, 4)}
    one, four = runs[1], runs[4]
    units = 2 * QWEN3_30B_A3B.num_layers
    assert one.iterations == units and four.iterations == -(-units // 4)
    saved = (one.iterations - four.iterations) * 2e-3
    assert one.metrics[0].ttft - four.metrics[0].ttft == pytest.approx(saved, rel=0.05)
