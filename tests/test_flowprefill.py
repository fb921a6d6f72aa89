"""FlowPrefill: SLO values, the latency estimator, slack-aware EDF, SLO-aware batching,
event-driven rounds, preemption with resume in place, and the engine end to end.

Scheduler tests drive the real Scheduler with test_scheduler's FakeExecutor (KV and
per-chunk operator units checked on every plan); the engine tests compare greedy tokens
of preempted and resumed prefills with uninterrupted ones on the tiny model.
"""

import json
import math

import numpy as np
import pytest
from conftest import make_sched_cfg as make_cfg
from conftest import output_ids
from test_scheduler import FakeExecutor, check_invariants, drive, req

from lp_jax.bench.open_loop import use_policy
from lp_jax.core.latency import FEATURES, LatencyModel, ModelDims, nnls_gram
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.scheduler import Scheduler
from lp_jax.core.slo import SLO, SLOTracker, parse_slo_classes, resolve_slo

L = 8


# ----------------------------------------------------------------- SLO values
def test_slo_values_and_classes():
    classes = parse_slo_classes('{"chat": {"ttft_ms": 250, "tbt_ms": 100}, '
                                '"summary": {"ttft_ms": 4000}}')
    assert classes["chat"] == SLO(0.25, 0.1, "chat")
    assert resolve_slo(classes, "summary") == SLO(4.0, None, "summary")
    assert resolve_slo(classes, "chat", ttft_ms=50) == SLO(0.05, 0.1, "chat")  # override
    assert resolve_slo(classes, None, tbt_ms=20) == SLO(None, 0.02, "custom")
    assert resolve_slo(classes) is None


@pytest.mark.parametrize("bad", [
    lambda c: resolve_slo(c, "nope"),
    lambda c: resolve_slo(c, None, ttft_ms=-1),
    lambda c: resolve_slo(c, None, ttft_ms=0),
    lambda c: resolve_slo(c, None, ttft_ms=math.nan),
    lambda c: resolve_slo(c, None, ttft_ms=math.inf),
    lambda c: resolve_slo(c, None, tbt_ms="5"),
    lambda c: resolve_slo(c, None, tbt_ms=True),
    lambda c: resolve_slo(c, None, ttft_ms=1e12),
    lambda c: parse_slo_classes({"x": {"ttft": 5}}),
    lambda c: parse_slo_classes({"x": {}}),
    lambda c: parse_slo_classes({"custom": {"ttft_ms": 5}}),
    lambda c: parse_slo_classes("[1, 2]"),
    lambda c: parse_slo_classes("{not json"),
    lambda c: parse_slo_classes("/no/such/file.json"),
])
def test_bad_slo_input_is_rejected(bad):
    with pytest.raises(ValueError):
        bad({"chat": SLO(0.25, None, "chat")})


def test_class_file_errors_name_the_entry(tmp_path):
    path = tmp_path / "classes.json"
    path.write_text(json.dumps({"chat": {"ttft_ms": -3}}))
    with pytest.raises(ValueError, match="chat.ttft_ms"):
        parse_slo_classes(str(path))


def test_slo_tracker_counts_per_class_and_kind():
    t = SLOTracker()
    t.record(SLO(1.0, 0.1, "chat"), 0.5, 0.05)
    t.record(SLO(1.0, 0.1, "chat"), 2.0, 0.05)
    t.record(SLO(None, 0.1), None, 0.5)  # no token: no TTFT objective, TBT missed
    t.record(None, 0.1, 0.1)  # best-effort: not counted
    d = t.as_dict()
    assert d["chat"]["ttft"] == {"attained": 1, "total": 2, "attainment": 0.5}
    assert d["chat"]["tbt"]["attained"] == 2 and d["custom"]["tbt"]["attained"] == 0
    assert "ttft" not in d["custom"]


# ---------------------------------------------------------- latency estimator
def _random_steps(model, rng, n=200):
    for _ in range(n):
        chunks = [(int(rng.integers(1, 400)), int(rng.integers(0, 400)))
                  for _ in range(int(rng.integers(0, 3)))]
        a = int(rng.integers(0, 2 * L))
        b = int(rng.integers(a + 1, 2 * L + 1))
        B = int(rng.integers(0 if chunks else 1, 12))
        yield model.features(chunks, a, b, B, B * int(rng.integers(1, 200)))


def test_latency_model_recovers_a_linear_truth_and_round_trips(tmp_path):
    dims = ModelDims(L, 16, 4)
    truth = LatencyModel(dims, [2e-9, 1e-9, 3e-6, 5e-6, 2e-5, 1e-5, 1e-8, 2e-5, 3e-4, 1e-3])
    rng = np.random.default_rng(0)
    samples = [(x, truth.predict(x)) for x in _random_steps(truth, rng)]
    fitted = LatencyModel(dims).fit(samples)
    err = max(abs(fitted.predict(x) - y) / y for x, y in samples)
    assert err < 1e-3
    fitted.save(tmp_path / "lat.json")
    back = LatencyModel.load(tmp_path / "lat.json", dims)
    assert all(back.predict(x) == pytest.approx(fitted.predict(x)) for x, _ in samples[:10])
    with pytest.raises(ValueError, match="fitted for"):
        LatencyModel.load(tmp_path / "lat.json", ModelDims(L + 1, 16, 4))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot read"):
        LatencyModel.load(tmp_path / "bad.json")


def test_latency_model_learns_online_and_reports_its_error():
    """Observed steps refresh the model; after a change of speed, forgetting moves the
    predictions to the new truth, and the reported error shows the transition."""
    dims = ModelDims(L, 16, 4)
    rng = np.random.default_rng(1)
    truth = [1e-9, 0.0, 4e-6, 4e-6, 1e-5, 1e-5, 0.0, 1e-5, 2e-4, 1e-3]
    model = LatencyModel(dims, forgetting=0.95)
    for x in _random_steps(model, rng, 300):
        model._add([(x, sum(c * v for c, v in zip(truth, x, strict=True)))])
    xs = list(_random_steps(model, rng, 30))
    slow = [2 * c for c in truth]
    for x in list(_random_steps(model, rng, 300)):
        model._add([(x, sum(c * v for c, v in zip(slow, x, strict=True)))])
    for x in xs:
        want = sum(c * v for c, v in zip(slow, x, strict=True))
        assert model.predict(x) == pytest.approx(want, rel=0.05)
    assert model.error()["steps"] == 0  # _add is the raw update; observe() counts
    assert nnls_gram([[1.0, 0.0], [0.0, 1.0]], [1.0, -2.0]) == [1.0, 0.0]
    assert len(FEATURES) == len(model.coef_F)


def test_latency_features_count_expert_reloads():
    """Splitting a prompt into chunks reloads the experts per chunk; the expected-experts
    term sees it (a 512-token chunk is not an eighth of a 4096-token prompt)."""
    m = LatencyModel(ModelDims(L, 128, 8))
    whole = m.features([(4096, 0)], 0, 2 * L)
    chunks = sum(np.array(m.features([(512, 512 * i)], 0, 2 * L)) for i in range(8))
    assert chunks[4] > 4 * whole[4]  # experts
    assert chunks[3] == whole[3]  # MLP token work is the same


def test_latency_features_put_experts_on_mlp_halves_only():
    """An operator segment's experts are those of the MoE MLP halves (unit 2i + 1) it
    runs: an attention half alone loads none beyond the decodes' own, an MLP half alone
    loads the prefill's, and the halves of a span add up to the whole layer's."""
    m = LatencyModel(ModelDims(L, 128, 8))
    attn, mlp = (m.features([(256, 0)], u, u + 1)[4] for u in (2, 3))
    whole = m.features([(256, 0)], 2, 4)[4]
    assert attn == 0 and mlp > 0 and attn + mlp == whole
    # a span from an MLP half to the next attention half holds one MLP half
    assert m.features([(256, 0)], 3, 5)[4] == mlp


# ------------------------------------------------------------------- scheduler
def fp(**kw):
    base = dict(preemption_granularity="operator", max_num_batched_tokens=64)
    base.update(kw)
    return Scheduler(make_cfg("flowprefill", **base))


def slo_req(seq_id, n, ttft, *, arrival=0.0, max_tokens=2):
    r = req(seq_id, n, max_tokens, arrival=arrival)
    r.slo = None if ttft is None else SLO(ttft)
    return r


def step(sched, ex, now):
    plan = sched.schedule(now)
    sched.commit(plan, ex.run(plan), now + 1)
    check_invariants(sched)
    return plan


def first_plans(ex):
    """seq id -> index of the first plan it was prefilled in."""
    out = {}
    for i, p in enumerate(ex.plans):
        for c in p.prefill:
            out.setdefault(c.seq.seq_id, i)
    return out


@pytest.mark.parametrize("rules", ["reference", "lp_jax"])
def test_edf_orders_by_deadline_not_arrival(rules):
    sched = fp(max_num_batched_tokens=32, flowprefill_rules=rules)  # one 30-token prompt per batch
    reqs = [slo_req(0, 30, 90.0), slo_req(1, 30, 30.0), slo_req(2, 30, 60.0)]
    ex = drive(sched, reqs)
    first = first_plans(ex)
    assert first[1] < first[2] < first[0]


@pytest.mark.parametrize("rules", ["reference", "lp_jax"])
def test_infeasible_requests_are_demoted_not_dropped(rules):
    """Request 1's deadline is already past when it arrives: the feasible request 2
    (later deadline) goes first, and 1 still finishes."""
    sched = fp(max_num_batched_tokens=32, flowprefill_rules=rules)
    _learnt(sched, 0.01)  # a 30-token prompt: 4.8 s predicted
    blocker = slo_req(0, 30, None)
    late = slo_req(1, 30, 0.5, arrival=1)  # due at 1.5: infeasible from the start
    ok = slo_req(2, 30, 100.0, arrival=1)
    ex = drive(sched, [blocker, late, ok])
    first = first_plans(ex)
    assert first[2] < first[1]
    assert late.is_finished and late.finish_reason == "length"


def _learnt(sched, seconds_per_token_unit):
    """A latency model that believes each prefill token costs the same per unit."""
    m = sched.latency
    m.coef_F = [0.0] * len(FEATURES)
    m.coef_F[FEATURES.index("attn_t")] = seconds_per_token_unit
    m.coef_F[FEATURES.index("mlp_t")] = seconds_per_token_unit


@pytest.mark.parametrize("alpha, together", [(0.0, True), (0.5, False)])
def test_slo_aware_batching_keeps_every_member_slack(alpha, together):
    """Two 20-token prompts, each predicted 20 * 16 * 0.01 = 3.2 s alone, 6.4 s together.
    The first's TTFT SLO is 10 s: batching keeps its slack at 3.6 s, so it is allowed with
    alpha = 0 and refused with alpha = 0.5 (3.6 < 5). lp_jax's rule (the reference checks
    the head only: test_reference_checks_only_the_head)."""
    sched = fp(slo_alpha=alpha, flowprefill_rules="lp_jax")
    _learnt(sched, 0.01)
    a, b = slo_req(0, 20, 10.0), slo_req(1, 20, 50.0)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(0.0)
    ids = [c.seq.seq_id for c in plan.prefill]
    assert ids == ([0, 1] if together else [0])


# FlowPrefill's reference rules (HSIEHCHIACHI/FlowPrefill: Request.update_priority,
# EngineCore.slo_aware_batching) against lp_jax's earlier ones (flowprefill_rules="lp_jax").
def _batch_ids(sched, now):
    return [c.seq.seq_id for c in sched.schedule(now).prefill]


@pytest.mark.parametrize("rules, order", [("reference", [2, 1, 0]), ("lp_jax", [2, 0, 1])])
def test_infeasible_order_latest_deadline_first_under_the_reference(rules, order):
    """30-token prompts, 4.8 s predicted each: 0 (due at 1) and 1 (due at 2) are infeasible
    from the start, 2 (due at 100) is feasible and goes first under both rules. The
    reference's sign(slack) / deadline puts the infeasible ones latest deadline first;
    lp_jax orders them earliest deadline first."""
    sched = fp(max_num_batched_tokens=32, flowprefill_rules=rules)
    _learnt(sched, 0.01)
    ex = drive(sched, [slo_req(0, 30, 1.0), slo_req(1, 30, 2.0), slo_req(2, 30, 100.0)])
    first = first_plans(ex)
    assert sorted(first, key=first.get) == order


@pytest.mark.parametrize("rules", ["reference", "lp_jax"])
def test_head_over_the_bound_runs_alone(rules):
    """A head longer than the token budget is cut to it and nothing joins it."""
    sched = fp(max_num_batched_tokens=32, flowprefill_rules=rules)
    _learnt(sched, 1e-5)
    sched.add(slo_req(0, 40, 100.0))
    sched.add(slo_req(1, 4, 200.0))
    plan = sched.schedule(0.0)
    assert [(c.seq.seq_id, c.num_tokens) for c in plan.prefill] == [(0, 32)]


def test_reference_urgent_head_runs_alone():
    """deadline - now < alpha x TTFT SLO (0.5 s < 1 s): the head runs alone although a
    1-token request would fit; with more time left the two are batched."""
    sched = fp(flowprefill_rules="reference")
    _learnt(sched, 1e-4)
    sched.add(slo_req(0, 1, 10.0))
    sched.add(slo_req(1, 1, 100.0))
    assert _batch_ids(sched, 9.5) == [0]
    sched = fp(flowprefill_rules="reference")
    _learnt(sched, 1e-4)
    sched.add(slo_req(0, 1, 10.0))
    sched.add(slo_req(1, 1, 100.0))
    assert _batch_ids(sched, 8.0) == [0, 1]


@pytest.mark.parametrize("rules, ids", [("reference", [0, 2]), ("lp_jax", [0])])
def test_reference_skips_candidates_over_the_bound(rules, ids):
    """Budget 64: 30 + 40 tokens exceed it, 30 + 20 do not. The reference skips request 1
    and adds request 2; lp_jax stops at the first candidate that does not fit whole."""
    sched = fp(flowprefill_rules=rules)
    _learnt(sched, 1e-5)
    for i, (n, slo) in enumerate([(30, 100.0), (40, 200.0), (20, 300.0)]):
        sched.add(slo_req(i, n, slo))
    assert _batch_ids(sched, 0.0) == ids


@pytest.mark.parametrize("rules", ["reference", "lp_jax"])
@pytest.mark.parametrize("alpha, together", [(0.0, True), (0.3, True), (0.4, False)])
def test_stop_margin_is_alpha_times_the_slo(rules, alpha, together):
    """Two 20-token prompts, 6.4 s predicted together; the head is due in 10 s, so 3.6 s
    are left with the batch: the margin alpha x 10 s stops the batch from alpha = 0.4 on
    (an alpha-seconds margin never would)."""
    sched = fp(slo_alpha=alpha, flowprefill_rules=rules)
    _learnt(sched, 0.01)
    sched.add(slo_req(0, 20, 10.0))
    sched.add(slo_req(1, 20, 50.0))
    assert _batch_ids(sched, 0.0) == ([0, 1] if together else [0])


@pytest.mark.parametrize("rules, ids", [("reference", [0, 1]), ("lp_jax", [0])])
def test_reference_checks_only_the_head(rules, ids):
    """At t = 88 with 6.4 s predicted for both: the head (arrived at 88, due at 99) keeps
    4.6 s >= 0.1 x 11 s; request 1 (arrived at 0, due at 100, feasible alone) would keep
    5.6 s < 0.1 x 100 s. The reference checks only the head and batches both; lp_jax
    checks every member and leaves request 1 out."""
    sched = fp(flowprefill_rules=rules)
    _learnt(sched, 0.01)
    sched.add(slo_req(0, 20, 11.0, arrival=88.0))
    sched.add(slo_req(1, 20, 100.0))
    assert _batch_ids(sched, 88.0) == ids


def test_default_budget_follows_the_rules():
    from lp_jax.core.policies import resolve_policy

    def budget(policy, **kw):
        return make_cfg(policy, **kw).max_num_batched_tokens

    assert budget("flowprefill") == 2048  # the reference code's token bound
    assert budget("flowprefill", flowprefill_rules="lp_jax") == 8192
    assert budget("layered", preemptible=True) == budget("layered") == 8192
    assert resolve_policy("flowprefill").default_budget(make_cfg(
        "flowprefill", max_num_batched_tokens=64)) == 2048
    with pytest.raises(ValueError, match="flowprefill_rules"):
        make_cfg("flowprefill", flowprefill_rules="paper")


@pytest.mark.parametrize("rules", ["reference", "lp_jax"])
def test_a_request_past_its_first_token_has_no_ttft_deadline(rules):
    """A decode preempted for recompute comes back with its TTFT deadline long past: it
    is not ranked as an infeasible prefill (its first token is out), but as best-effort."""
    sched = fp(flowprefill_rules=rules)
    _learnt(sched, 0.01)
    q = slo_req(0, 20, 1.0)
    assert q.deadline == 1.0
    q.token_times.append(0.8)  # produced its first token in time
    assert q.deadline == math.inf
    late = slo_req(1, 20, 1.0)  # a prefill that cannot make its deadline any more
    sched.add(q)
    sched.add(late)
    assert _batch_ids(sched, 50.0)[0] == 0


def test_rounds_run_only_on_events():
    sched = fp()
    ex = FakeExecutor(sched)
    sched.add(slo_req(0, 40, None))
    step(sched, ex, 0.0)
    rounds = sched.stats()["scheduling_rounds"]
    for t in range(1, 10):  # segments of the same batch: no event, no round
        step(sched, ex, float(t))
    assert sched.stats()["scheduling_rounds"] == rounds
    sched.add(slo_req(1, 4, None, arrival=10.0))  # an arrival: one round
    step(sched, ex, 10.0)
    assert sched.stats()["scheduling_rounds"] == rounds + 1
    step(sched, ex, 11.0)
    assert sched.stats()["scheduling_rounds"] == rounds + 1


@pytest.mark.parametrize("granularity", ["operator", "layer", "group"])
def test_urgent_request_preempts_and_the_long_one_resumes_in_place(granularity):
    sched = fp(preemption_granularity=granularity, layer_groups=4)
    ex = FakeExecutor(sched)
    long_ = slo_req(0, 60, 1000.0)
    sched.add(long_)
    p0 = step(sched, ex, 0.0)
    seg = p0.unit_end - p0.unit_start
    assert seg == {"operator": 1, "layer": 2, "group": 4}[granularity]
    urgent = slo_req(1, 4, 5.0, arrival=1.0)
    sched.add(urgent)
    p1 = step(sched, ex, 1.0)  # the next segment boundary: the urgent batch starts
    assert [c.seq.seq_id for c in p1.prefill] == [1] and p1.unit_start == 0
    assert set(p1.prefill_rows).isdisjoint(range(p0.prefill_rows[0], 60))  # own rows
    while any(c.seq.seq_id == 1 for c in ex.plans[-1].prefill) and not urgent.num_output_tokens:
        step(sched, ex, 2.0)
    resumed = step(sched, ex, 3.0)
    while resumed.prefill and resumed.prefill[0].seq is not long_:
        resumed = step(sched, ex, 3.0)
    # The long prompt goes on from the unit where it stopped, with the same rows.
    assert resumed.unit_start == p0.unit_end and resumed.prefill_rows == p0.prefill_rows
    s = sched.stats()
    assert s["prefill_pauses"] == 1 and s["prefill_resumes"] == 1
    drive(sched, ex=ex)  # everything finishes, every chunk crossed each unit once
    assert output_ids(long_) and output_ids(urgent)


def test_preemptible_layered_pauses_at_group_boundaries():
    sched = Scheduler(make_cfg("layered", preemptible=True, max_num_batched_tokens=64,
                               layer_groups=4))
    ex = FakeExecutor(sched)
    sched.add(slo_req(0, 60, 1000.0))
    p0 = step(sched, ex, 0.0)
    assert (p0.layer_start, p0.layer_end, p0.num_groups) == (0, 2, 4)
    sched.add(slo_req(1, 4, 5.0, arrival=1.0))
    p1 = step(sched, ex, 1.0)
    assert [c.seq.seq_id for c in p1.prefill] == [1]
    assert sched.stats()["prefill_pauses"] == 1
    drive(sched, ex=ex)


def test_no_paused_area_means_no_preemption():
    sched = fp(max_paused_prefills=0)
    ex = FakeExecutor(sched)
    sched.add(slo_req(0, 60, 1000.0))
    step(sched, ex, 0.0)
    sched.add(slo_req(1, 4, 5.0, arrival=1.0))
    p1 = step(sched, ex, 1.0)
    assert [c.seq.seq_id for c in p1.prefill] == [0]  # the long batch keeps its area
    drive(sched, ex=ex)


def test_abort_of_a_paused_prefill_frees_its_pages_at_once():
    sched = fp()
    ex = FakeExecutor(sched)
    long_ = slo_req(0, 60, 1000.0)
    sched.add(long_)
    step(sched, ex, 0.0)
    sched.add(slo_req(1, 4, 5.0, arrival=1.0))
    step(sched, ex, 1.0)  # long_ is paused
    held = len(long_.page_ids)
    free = sched.block_manager.num_free_pages
    assert sched.abort(0) is long_
    assert sched.block_manager.num_free_pages == free + held  # not held as a zombie
    check_invariants(sched)
    drive(sched, ex=ex)
    assert sched.block_manager.num_free_pages == sched.config.num_pages


def test_memory_pressure_preempts_a_paused_prefill_before_decodes():
    """Pages run out while a prefill is paused: its pages go back (recompute later), the
    running decodes keep theirs, and everything still finishes with the right tokens."""
    sched = fp(num_pages=26, page_size=4, max_num_batched_tokens=64, layer_groups=8)
    ex = FakeExecutor(sched)
    dec = slo_req(0, 8, None, max_tokens=60)  # grows a page every 4 tokens
    sched.add(dec)
    for t in range(40):  # 16 prefill segments, then decodes: 32 tokens, 8 pages
        step(sched, ex, float(t))
    long_ = slo_req(1, 60, 1000.0, arrival=40.0)  # 15 pages
    sched.add(long_)
    step(sched, ex, 40.0)
    sched.add(slo_req(2, 8, 1.0, arrival=41.0))  # 2 pages; pauses long_ for 16 segments
    for t in range(41, 400):
        step(sched, ex, float(t))
        if sched.stats()["paused_prefills_preempted"]:
            break
    assert sched.stats()["paused_prefills_preempted"] == 1 and long_.num_preemptions == 1
    assert dec.num_preemptions == 0
    drive(sched, ex=ex)
    assert output_ids(long_) and dec.num_output_tokens == 60


# ---------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engine(engines):
    from lp_jax import LLM

    # the run's flowprefill-128 shapes (8 sequences, a 128-token budget), own SLO classes.
    # "chat" has the earliest deadline of these tests' requests, and is feasible on any
    # host (a 50 ms one was not on a loaded one: infeasible requests are demoted, so the
    # preemption these tests assert never came).
    engine = LLM(**engines.kwargs("flowprefill-128"),
                 slo_classes={"chat": {"ttft_ms": 5000}}).engine
    engine.base_config = engine.scheduler.config
    return engine


def _use_policy(engine, **changes):
    """A fresh scheduler, the engine's own config with `changes`, on the same compiled
    programs (the executor is policy-agnostic; hidden row areas are the same size)."""
    use_policy(engine, engine.base_config, **changes)


def _run(engine, adds):
    """adds: {step index: [(prompt, slo)]}; returns {prompt index: output ids}."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids, out, i, k = {}, {}, 0, 0
    while adds or engine.has_unfinished():
        for prompt, slo in adds.pop(i, []):
            ids[engine.add_request(prompt, params, slo=slo)] = k
            k += 1
        for o in engine.step():
            if o.finished:
                out[ids[o.request_id]] = o.token_ids
        i += 1
    return out


@pytest.mark.parametrize("policy", [dict(preemption_granularity="operator"),
                                    dict(preemption_granularity="layer"),
                                    dict(preemption_granularity="group", layer_groups=4),
                                    dict(policy="layered", preemptible=True, layer_groups=4)])
def test_engine_preempt_and_resume_give_identical_tokens(engine, policy):
    rng = np.random.default_rng(0)
    long_p, short_p = rng.integers(0, 500, 120).tolist(), rng.integers(0, 500, 9).tolist()
    _use_policy(engine, **policy)
    solo = _run(engine, {0: [(long_p, None)]})[0], _run(engine, {0: [(short_p, None)]})[0]
    before = engine.scheduler.stats()["prefill_pauses"]
    got = _run(engine, {0: [(long_p, {"ttft_slo_ms": 1e6})], 1: [(short_p, "chat")]})
    assert engine.scheduler.stats()["prefill_pauses"] > before  # it was preempted
    assert (got[0], got[1]) == solo
    assert engine.stats()["compilations_after_warmup"] == 0
    s = engine.stats()
    assert s["free_pages"] == s["total_pages"]
    assert s["slo_attainment"]["chat"]["ttft"]["total"] >= 1


def test_engine_abort_paused_prefill_and_bad_slo(engine):
    _use_policy(engine, preemption_granularity="operator")
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rid = engine.add_request(rng.integers(0, 500, 120).tolist(), params)
    engine.step()
    engine.add_request(rng.integers(0, 500, 5).tolist(), params, slo="chat")
    engine.step()
    engine.step()
    assert engine.scheduler.stats()["prefill_pauses"] >= 1
    for bad in ("nope", {"ttft_slo_ms": -5}, {"ttft": 5}, 3.5):
        with pytest.raises(ValueError):
            engine.add_request([1, 2, 3], params, slo=bad)
    assert engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s["free_pages"] == s["total_pages"]
    assert s["latency_model"]["steps"] > 0


def test_offline_slos_and_profiling_write_a_loadable_model(engine, tmp_path):
    """LLM.generate(slos=...) per prompt; profile_engine (the profiling command's core)
    fits the estimator from measured steps, and the saved file loads for this model."""
    from lp_jax.engine.profile_latency import profile_engine
    from lp_jax.llm import LLM

    _use_policy(engine, preemption_granularity="layer", max_num_batched_tokens=128)
    llm = object.__new__(LLM)
    llm.engine = engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params,
                        slos=["chat", {"ttft_slo_ms": 1e5, "tbt_slo_ms": 1e5}])
    assert all(len(o.token_ids) == 2 for o in outs)
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[1]], sampling_params=params, slos=["nope"])
    with pytest.raises(ValueError, match="slos for"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=params, slos=[None, None])
    model = profile_engine(engine, output_tokens=2)
    assert model.error()["steps"] > 20 and any(c > 0 for c in model.to_dict()["coef"])
    model.save(tmp_path / "lat.json")
    dims = ModelDims.from_config(engine.model_config)
    assert LatencyModel.load(tmp_path / "lat.json", dims).dims == dims


# ------------------------------------------------------------ adaptive layered
def _adaptive(tbt, margin=0.1, **kw):
    coef = [0.0] * len(FEATURES)
    for name, v in (("decode_rows", 1e-3), ("attn_t", 1e-3), ("mlp_t", 1e-3), ("step", 2e-3)):
        coef[FEATURES.index(name)] = v
    cfg = make_cfg("layered", layer_groups="adaptive", tbt_slo_s=tbt, adaptive_margin=margin,
                   max_num_batched_tokens=256, **kw)
    return Scheduler(cfg, LatencyModel(ModelDims(L), coef))


def test_adaptive_spans_respect_the_tbt_budget():
    """Deterministic run with the estimator as the truth: every step that carries decodes
    and more than one prefill layer is predicted within tbt x (1 - margin); spans shrink
    as the SLO tightens, and with no decodes the prompt crosses the stack at once."""
    spans = {}
    for tbt in (None, 0.5, 0.2):
        sched = _adaptive(tbt)
        limit = None if tbt is None else tbt * 0.9
        reqs = [slo_req(i, 8, None, max_tokens=30) for i in range(4)]
        reqs += [slo_req(4 + i, 100, None, arrival=3 + 2 * i) for i in range(3)]
        ex = drive(sched, reqs)
        sizes = []
        for p in ex.plans:
            if not p.prefill:
                continue
            sizes.append(p.layer_end - p.layer_start)
            if not p.decode:
                assert p.layer_start == 0 and p.layer_end == L  # nothing to protect
            elif limit is not None and p.layer_end - p.layer_start > 1:
                assert sched.latency.predict_plan(p) <= limit + 1e-12
        spans[tbt] = sizes
    assert max(spans[None]) == L and min(spans[None]) == L
    assert sum(spans[0.2]) / len(spans[0.2]) < sum(spans[0.5]) / len(spans[0.5]) < L
    # Measured against a truth it does not start from: prefill rows cost 30% more than the
    # estimator believes. Refitted by a short profile of the truth (prefill-only spans and
    # decode-only steps, as profile_latency does on the engine) and learning from each
    # measured step (5% jitter), every step with decodes and more than one prefill layer
    # (one layer is the policy's floor) meets the 0.75 s TBT SLO; the same check fails the
    # estimator that keeps its belief.
    coef = [0.0] * len(FEATURES)
    for name, v in (("decode_rows", 1e-3), ("attn_t", 1.3e-3), ("mlp_t", 1.3e-3),
                    ("step", 2e-3)):
        coef[FEATURES.index(name)] = v
    truth, rng = LatencyModel(ModelDims(L), coef), np.random.default_rng(0)

    def jitter() -> float:
        return float(np.exp(0.05 * rng.standard_normal()))

    worst = {}
    for learns in (True, False):
        sched, measured = _adaptive(0.75), []
        if learns:
            lat = sched.latency
            xs = [lat.features([(n, 0)], 0, 2 * u) for n in (8, 32, 100) for u in (1, 2, 4, L)]
            xs += [lat.features([], 0, 0, b, 16 * b) for b in (1, 2, 4, 8)]
            lat.fit([(x, truth.predict(x) * jitter()) for x in xs], "profile of the truth")

        def during(_, sched, plan, learns=learns, measured=measured):
            if plan.phase == "idle":
                return
            t = truth.predict_plan(plan) * jitter()
            if plan.decode and plan.layer_end - plan.layer_start > 1:
                measured.append(t)
            if learns:
                sched.observe(plan, t)

        reqs = [slo_req(i, 8, None, max_tokens=30) for i in range(4)]
        reqs += [slo_req(4 + i, 100, None, arrival=3 + 2 * i) for i in range(3)]
        drive(sched, reqs, during=during)
        assert measured  # spans of two or more layers ran beside the decodes
        worst[learns] = max(measured)
    assert worst[True] <= 0.75 < worst[False]


def test_adaptive_takes_the_tightest_running_tbt_slo():
    sched = _adaptive(None)
    r = slo_req(0, 4, None, max_tokens=20)
    r.slo = SLO(None, 0.2)
    sched.add(r)
    ex = FakeExecutor(sched)
    for t in range(3):
        step(sched, ex, float(t))
    assert sched.policy.tbt_target() == 0.2
    sched.add(slo_req(1, 100, None, arrival=3.0))
    p = step(sched, ex, 3.0)
    assert p.decode and p.layer_end - p.layer_start < L
    drive(sched, ex=ex)


def test_adaptive_config_is_checked():
    with pytest.raises(ValueError, match="adaptive"):
        make_cfg("chunked", layer_groups="adaptive")
    with pytest.raises(ValueError, match="tbt_slo_s"):
        make_cfg("layered", layer_groups="adaptive", tbt_slo_s=-1.0)
    with pytest.raises(ValueError, match="adaptive_margin"):
        make_cfg("layered", layer_groups="adaptive", adaptive_margin=1.0)


def test_engine_adaptive_matches_chunked_tokens(engine):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 500, n).tolist() for n in (100, 7, 60, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run():
        for i, p in enumerate(prompts):
            engine.add_request(p, params, arrival_time=float(i))
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
        return [out[k] for k in sorted(out)]

    _use_policy(engine, policy="chunked", max_num_batched_tokens=64)
    want = run()
    _use_policy(engine, policy="layered", layer_groups="adaptive", tbt_slo_s=1e-3,
                max_num_batched_tokens=128)
    spans, schedule = set(), engine.scheduler.schedule

    def record(now):
        plan = schedule(now)
        if plan.prefill:
            spans.add(plan.layer_end - plan.layer_start)
        return plan

    engine.scheduler.schedule = record
    programs = engine.stats()["programs"]
    got = run()
    assert got == want
    # Spans of several sizes ran on the warm programs: adaptive adds no program.
    assert len(spans) > 1, spans
    assert engine.stats()["compilations_after_warmup"] == 0
    assert engine.stats()["programs"] == programs


def test_contention_guard_learns_the_slowdown_of_mixed_steps():
    """Truth: solo steps are linear; a step with prefill beside decodes is 1.5x the sum of
    its solo parts. The linear part learns from solo steps only; the guard learns 1.5."""
    from types import SimpleNamespace as NS

    dims = ModelDims(L)
    truth = LatencyModel(dims, [0.0, 0.0, 1e-4, 1e-4, 0.0, 1e-3, 0.0, 0.0, 0.0, 1e-3])
    model = LatencyModel(dims, forgetting=1.0)
    rng = np.random.default_rng(0)

    def plan(T, B):
        chunks = (NS(num_tokens=T, start=0),) if T else ()
        return NS(prefill=chunks, decode=tuple(NS(num_tokens=10) for _ in range(B)),
                  drafts=(), num_decode_rows=B, unit_start=0, unit_end=2 * L,
                  num_prefill_tokens=T)

    for _ in range(60):  # solo steps of both kinds, then mixed ones
        for T, B in ((int(rng.integers(1, 300)), 0), (0, int(rng.integers(1, 16)))):
            model.observe(plan(T, B), truth.predict_plan(plan(T, B)))
    for _ in range(200):
        T, B = int(rng.integers(16, 64)), int(rng.integers(4, 8))
        model.observe(plan(T, B), 1.5 * truth.predict_plan(plan(T, B)))
    mixed, solo = plan(40, 5), plan(40, 0)
    assert model.predict_plan(mixed) == pytest.approx(1.5 * truth.predict_plan(mixed), rel=0.02)
    assert model.predict_plan(solo) == pytest.approx(truth.predict_plan(solo), rel=0.02)
    assert model.error()["contention_cells"] >= 1
