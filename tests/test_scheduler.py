"""Scheduler tests with a fake executor standing in for the model.

`FakeExecutor` checks every plan against a fake KV cache (slot -> the sequence that wrote
it and the position) and a per-chunk record of the layers it crossed, and "samples" token =
f(seq_id, position). Because the token depends only on the sequence and the position, every
policy and every preemption pattern must produce the same token streams. A slot's KV is
valid for any reader whose tokens up to that position equal its writer's, so sequences
that share cached prefix pages (prefix caching) are checked too.
"""

from collections import Counter

import pytest
from conftest import make_sched_cfg, output_ids
from hypothesis import event, given, settings
from hypothesis import strategies as st

from lp_jax.core.config import SchedulerConfig
from lp_jax.core.latency import FEATURES, LatencyModel, ModelDims
from lp_jax.core.metrics import RequestMetrics, percentile, slo_pass, summarize
from lp_jax.core.plan import PrefillChunk, StepPlan, StepResult
from lp_jax.core.policies import resolve_policy
from lp_jax.core.sampling_params import SamplingParams
from lp_jax.core.scheduler import Scheduler
from lp_jax.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from lp_jax.core.slo import SLO

VOCAB = 1000
POLICIES = ("orca", "chunked", "layered", "flowprefill")
RUNNING = SequenceStatus.RUNNING


def fake_token(seq_id, pos, vocab=VOCAB):
    return (seq_id * 7919 + pos * 104729 + 13) % vocab


make_cfg = make_sched_cfg  # vocabulary VOCAB


def req(seq_id, prompt_len, max_tokens=4, *, arrival=0.0, priority=0, **sp):
    prompt = [(seq_id * 31 + i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, **sp)
    return Sequence(seq_id, prompt, params, priority=priority, arrival_time=arrival)


class FakeExecutor:
    def __init__(self, sched, token_fn=fake_token):
        self.sched = sched
        self.token_fn = token_fn
        self.kv = {}  # slot -> (writer Sequence, position)
        self.prefix = {}  # seq_id -> running hash of its tokens [0, pos], per pos
        self.layers = {}  # (batch_id, seq_id, start, end) -> operator units crossed, in order
        self.rows = {}  # batch_id -> (hidden rows it holds, its seq ids) until it ends
        self.plans = []
        self.preempted = {}  # step_id -> seq ids preempted while that plan was made
        self._seen = {}  # seq_id -> (Sequence, its preemption count when last seen)

    def _slot(self, seq, pos):
        """The KV slot the model writes for `pos` (metadata.py's page * S + offset)."""
        S = self.sched.block_manager.page_size
        assert 0 <= pos < len(seq.page_ids) * S, (seq, pos)
        return seq.page_ids[pos // S] * S + pos % S

    def _prefix_hash(self, seq, pos):
        """A hash of seq's tokens [0, pos] (None if one is not a real token yet)."""
        hs = self.prefix.setdefault(seq.seq_id, [])
        while len(hs) <= pos:
            i = len(hs)
            if i >= len(seq.token_ids) or seq.token_ids[i] == PENDING_TOKEN:
                return None
            hs.append(hash((hs[-1] if hs else None, seq.token_ids[i])))
        return hs[pos]

    def _check_kv(self, seq, upto):
        for pos in range(upto):
            writer, at = self.kv.get(self._slot(seq, pos), (None, None))
            assert at == pos and (writer is seq or self._prefix_hash(writer, pos)
                                  == self._prefix_hash(seq, pos) is not None), (seq, pos)

    def run(self, plan):
        num_layers = self.sched.config.num_layers
        self.plans.append(plan)
        # Sequences preempted since the last plan ran, seen through their preemption
        # counts (a plan states no preemptions: the executor keeps no state that needs it)
        preempted = tuple(sorted(sid for sid, (s, n) in self._seen.items()
                                 if s.num_preemptions > n))
        for s in [*plan.decode, *(c.seq for c in plan.prefill),
                  *(s for s, _ in self._seen.values())]:
            self._seen[s.seq_id] = (s, s.num_preemptions)
        self.preempted[plan.step_id] = preempted
        assert not set(preempted) & {c.seq.seq_id for c in plan.prefill}
        if preempted:  # recompute preemption: the sequence's KV is gone, but for the
            cached = self.sched.block_manager._hash_of  # pages the prefix cache keeps
            S = self.sched.block_manager.page_size
            self.kv = {k: v for k, v in self.kv.items()
                       if v[0].seq_id not in preempted or k // S in cached}
        for seq in plan.decode:
            # (planned over an uncommitted plan, its last token is still a placeholder)
            assert seq.status is RUNNING and seq.num_computed_tokens == seq.num_tokens - 1
            self._check_kv(seq, seq.num_tokens - 1)
            self.kv[self._slot(seq, seq.num_tokens - 1)] = (seq, seq.num_tokens - 1)
        if plan.prefill and not (plan.is_first_group and plan.is_last_group):
            self._check_rows(plan)  # a batch that spans plans carries hidden rows
        for c in plan.prefill:
            key = (plan.prefill_batch_id, c.seq.seq_id, c.start, c.end)
            if plan.is_first_group:
                assert key not in self.layers
                assert c.start == c.seq.num_computed_tokens
                self._check_kv(c.seq, c.start)
                self.layers[key] = []
            assert self.layers[key][-1:] in ([], [plan.unit_start - 1])  # resumes in place
            self.layers[key].extend(range(plan.unit_start, plan.unit_end))
            if plan.is_last_group:
                assert self.layers[key] == list(range(2 * num_layers))  # each unit once
                for pos in range(c.start, c.end):
                    self.kv[self._slot(c.seq, pos)] = (c.seq, pos)
        return StepResult({
            s.seq_id: self.token_fn(s.seq_id, s.num_tokens)
            for s in plan.sampling_seqs
            if not s.is_finished
        })

    def _check_rows(self, plan):
        """A batch's chunks keep their hidden rows from group to group, and no two live
        batches (running or paused) share a row."""
        rows = {r + k for r, c in zip(plan.chunk_rows, plan.prefill, strict=True)
                for k in range(c.num_tokens)}
        assert len(rows) == plan.num_prefill_tokens
        cap = self.sched.config.max_num_batched_tokens * max(
            1, self.sched.policy.hidden_slots(self.sched.config))
        assert max(rows) < cap
        bid = plan.prefill_batch_id
        if plan.is_first_group:
            # A batch is live (running or paused) while a member is still where it was.
            live = {(s.seq_id, s.num_preemptions, s.num_computed_tokens)
                    for s in self.sched.prefilling}
            for other, (held, members) in list(self.rows.items()):
                if not members & live:  # ended by aborts or preemption
                    del self.rows[other]
                else:
                    assert not held & rows, (bid, other)
            self.rows[bid] = (rows, {(c.seq.seq_id, c.seq.num_preemptions, c.start)
                                     for c in plan.prefill})
        else:
            assert rows <= self.rows[bid][0]
        if plan.is_last_group:
            self.rows.pop(bid, None)


def check_invariants(sched):
    bm, cfg = sched.block_manager, sched.config
    holders = sched.running + sched.prefilling + sched._zombies
    for s in holders:
        assert len(set(s.page_ids)) == len(s.page_ids), "a page is listed twice"
    refs = Counter(p for s in holders for p in s.page_ids)
    assert bm.num_free_pages + len(refs) == cfg.num_pages, "a page leaked"
    assert {p: len(h) for p, h in bm._holders.items()} == dict(refs), "a reference count"
    for p, n in refs.items():  # only published pages are shared
        assert n == 1 or p in bm._hash_of, f"page {p} is shared but not cached"
    assert len(bm._hash_of) == len(bm._page_of) == bm.num_cached_pages
    assert len(sched.running) + len(sched.prefilling) <= cfg.max_num_seqs
    keys = [s.sort_key for s in sched.waiting]
    assert keys == sorted(keys)
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.page_ids
    for s in sched.running:
        assert s.status is RUNNING and s.num_computed_tokens == s.num_tokens - 1
        assert len(s.page_ids) >= bm.pages_for(s.num_tokens - 1)
    for s in sched.prefilling:
        assert s.status is RUNNING and s.num_computed_tokens < s.prefill_target
        assert len(s.page_ids) == bm.pages_for(s.prefill_target)
    for s in sched._zombies:
        assert s.is_finished
    # every admitted sequence holds its own slot, and only those do (Sequence.slot)
    slots = [s.slot for s in sched.running + sched.prefilling]
    assert len(set(slots)) == len(slots) and all(0 <= x < cfg.max_num_seqs for x in slots)
    assert all(s.slot is None for s in sched.waiting + sched._zombies)


def drive(sched, requests=(), *, ex=None, before=None, during=None, max_steps=20_000,
          overlap=False):
    """schedule / execute / commit until done; step i is scheduled at time i.

    overlap: as the engine overlaps steps, each plan stays uncommitted while the next
    one is scheduled and run, and is committed after it (ex.overlapped counts these).
    """
    ex = ex or FakeExecutor(sched)
    pending = sorted(requests, key=lambda s: (s.arrival_time, s.seq_id))
    step, inflight, ex.overlapped = 0, None, 0
    while pending or sched.has_unfinished() or inflight:
        while pending and pending[0].arrival_time <= step:
            sched.add(pending.pop(0))
        if before:
            before(step, sched)
        if inflight is not None and not sched.can_plan_ahead():
            sched.commit(*inflight, float(step))  # as the engine: a commit-only step
            inflight = None
            check_invariants(sched)
            step += 1
            continue
        running_before = [(s, s.num_preemptions) for s in sched.running]
        plan = sched.schedule(float(step))
        victims = [s for s, n in running_before if s.num_preemptions > n]
        if victims:  # victims come from the tail of the running decodes
            assert min((v.sort_key for v in victims), default=(99, 0.0, 0)) > max(
                (s.sort_key for s in plan.decode), default=(-1, 0.0, -1)
            )
        sampled = ex.run(plan)
        if during:
            during(step, sched, plan)
        if inflight is not None:
            sched.commit(*inflight, float(step))
            ex.overlapped += 1
            inflight = None
        if overlap and plan.phase != "idle":
            inflight = (plan, sampled)
        else:
            sched.commit(plan, sampled, float(step + 1))
        check_invariants(sched)
        step += 1
        assert step < max_steps, (f"no progress: waiting {sched.waiting}, prefilling "
                                  f"{sched.prefilling}, running {sched.running}, last plans "
                                  f"{ex.plans[-2:]}, stats {sched.stats()}")
    assert sched.block_manager.num_free_pages == sched.config.num_pages
    for key, units in ex.layers.items():
        if not _dropped(sched, ex, key):
            assert units == list(range(2 * sched.config.num_layers)), key
    return ex


def _dropped(sched, ex, key):
    """A chunk a preemptible policy dropped: its sequence was aborted or preempted (and
    recomputed) before the chunk's batch ended."""
    if sched.config.policy_class.__name__ != "FlowPrefillPolicy":
        return False
    seq = next(c.seq for p in ex.plans for c in p.prefill if c.seq.seq_id == key[1])
    return seq.finish_reason == "abort" or seq.num_preemptions > 0


def drive_overlapped(sched, requests=(), **kw):
    return drive(sched, requests, overlap=True, **kw)


def expected_output(seq, max_model_len, eos=None, token_fn=fake_token):
    sp, out = seq.sampling_params, []
    while True:
        t = token_fn(seq.seq_id, seq.num_prompt_tokens + len(out))
        out.append(t)
        if t in sp.stop_token_ids or (not sp.ignore_eos and t == eos):
            return out
        if len(out) >= sp.max_tokens or seq.num_prompt_tokens + len(out) >= max_model_len:
            return out


def chunk_view(plan):
    return [(c.seq.seq_id, c.start, c.end) for c in plan.prefill]


def step_once(sched, now, ex):
    plan = sched.schedule(now)
    sched.commit(plan, ex.run(plan), now + 1)
    return plan


# ----- plan shapes -----
def test_idle_plan():
    sched = Scheduler(make_cfg("layered"))
    plan = sched.schedule(0.0)
    assert plan.phase == "idle" and plan.prefill_batch_id is None
    assert (plan.layer_start, plan.layer_end, plan.num_groups) == (0, 8, 1)
    assert sched.commit(plan, StepResult(), 1.0) == []
    assert sched.stats()["iterations_idle"] == 1 and not sched.has_unfinished()


def test_orca_whole_prompts_prefill_first():
    sched = Scheduler(make_cfg("orca", max_num_batched_tokens=350))
    assert sched.config.max_num_batched_tokens == 350
    for r in (req(0, 100), req(1, 200), req(2, 300)):
        sched.add(r)
    ex = FakeExecutor(sched)
    p0 = step_once(sched, 0.0, ex)
    assert chunk_view(p0) == [(0, 0, 100), (1, 0, 200)] and p0.phase == "prefill"
    assert all(c.samples for c in p0.prefill) and p0.prefill_batch_id is not None
    assert (p0.layer_start, p0.layer_end, p0.group_index, p0.num_groups) == (0, 8, 0, 1)
    assert p0.is_first_group and p0.is_last_group
    p1 = step_once(sched, 1.0, ex)
    assert [s.seq_id for s in p1.decode] == [0, 1] and chunk_view(p1) == [(2, 0, 300)]
    assert p1.phase == "hybrid" and p1.num_prefill_tokens == 300 and p1.num_decode_tokens == 2


def test_orca_admits_one_prompt_larger_than_the_budget():
    sched = Scheduler(make_cfg("orca", max_num_batched_tokens=50))
    sched.add(req(0, 100))
    sched.add(req(1, 10))
    ex = FakeExecutor(sched)
    assert chunk_view(step_once(sched, 0.0, ex)) == [(0, 0, 100)]
    assert chunk_view(step_once(sched, 1.0, ex)) == [(1, 0, 10)]


def test_policy_default_budgets():
    assert make_cfg("orca").max_num_batched_tokens == 4096  # max_model_len
    assert make_cfg("chunked").max_num_batched_tokens == 512
    assert make_cfg("layered").max_num_batched_tokens == 8192


def test_chunked_budget_accounting():
    sched = Scheduler(make_cfg("chunked", max_num_batched_tokens=64, max_num_seqs=4))
    sched.add(req(0, 100, 20))
    sched.add(req(1, 50, 20))
    ex = FakeExecutor(sched)
    p0 = step_once(sched, 0, ex)
    assert chunk_view(p0) == [(0, 0, 64)] and not p0.decode
    assert not p0.prefill[0].samples
    p1 = step_once(sched, 1, ex)  # the partial prefill first, then a new request
    assert chunk_view(p1) == [(0, 64, 100), (1, 0, 28)] and not p1.decode
    assert [c.samples for c in p1.prefill] == [True, False]
    p2 = step_once(sched, 2, ex)  # one decode token takes one token of the budget
    assert [s.seq_id for s in p2.decode] == [0] and chunk_view(p2) == [(1, 28, 50)]
    p3 = step_once(sched, 3, ex)
    assert [s.seq_id for s in p3.decode] == [0, 1] and not p3.prefill
    assert all(p.layer_start == 0 and p.layer_end == 8 for p in (p0, p1, p2, p3))


def test_chunked_never_exceeds_the_budget():
    sched = Scheduler(make_cfg("chunked", max_num_batched_tokens=32, max_num_seqs=8))
    reqs = [req(i, 5 + 13 * i, 10, arrival=i) for i in range(8)]
    ex = drive(sched, reqs)
    assert all(p.num_prefill_tokens + p.num_decode_tokens <= 32 for p in ex.plans)
    assert any(p.num_prefill_tokens + p.num_decode_tokens == 32 for p in ex.plans)


def test_layered_8192_prompt_runs_16_groups_with_decodes_every_iteration():
    cfg = make_cfg("layered", num_layers=48, page_size=16, num_pages=1024, max_model_len=16384)
    sched = Scheduler(cfg)
    ex = FakeExecutor(sched)
    sched.add(req(0, 16, 40))
    p0 = step_once(sched, 0, ex)
    assert chunk_view(p0) == [(0, 0, 16)] and p0.num_groups == 1
    long = req(1, 8192, 2, arrival=1)
    sched.add(long)
    plans = []
    for step in range(1, 17):
        assert long.num_output_tokens == 0  # no token before the last group
        plans.append(step_once(sched, step, ex))
    assert long.num_output_tokens == 1 and long.token_times == [17.0]
    assert {p.prefill_batch_id for p in plans} == {plans[0].prefill_batch_id}
    covered = []
    for g, p in enumerate(plans):
        assert chunk_view(p) == [(1, 0, 8192)] and p.prefill[0].samples
        assert (p.group_index, p.num_groups) == (g, 16)
        assert (p.layer_start, p.layer_end) == (3 * g, 3 * g + 3)
        assert [s.seq_id for s in p.decode] == [0] and p.phase == "hybrid"
        assert p.is_first_group == (g == 0) and p.is_last_group == (g == 15)
        assert sched.running[0].seq_id == 0 or g == 15
        covered.extend(range(p.layer_start, p.layer_end))
    assert covered == list(range(48))
    assert [s.seq_id for s in step_once(sched, 17, ex).decode] == [0, 1]
    assert long.metrics().ttft == 16.0


def test_layered_arrivals_wait_for_the_next_batch():
    sched = Scheduler(make_cfg("layered"))
    reqs = [req(0, 2048, 8), req(1, 10, 3, arrival=1)]  # 2048 tokens: G = 4
    ex = drive(sched, reqs)
    first = [chunk_view(p) for p in ex.plans[:4]]
    assert first == [[(0, 0, 2048)]] * 4
    assert [p.group_index for p in ex.plans[:4]] == [0, 1, 2, 3]
    assert chunk_view(ex.plans[4]) == [(1, 0, 10)] and ex.plans[4].num_groups == 1
    assert [s.seq_id for s in ex.plans[4].decode] == [0]


def test_layered_prompt_longer_than_budget_takes_several_batches():
    sched = Scheduler(make_cfg("layered", max_num_batched_tokens=1024))
    reqs = [req(0, 2500, 3), req(1, 100, 3)]
    ex = drive(sched, reqs)
    views = [(chunk_view(p), p.group_index, p.num_groups) for p in ex.plans[:6]]
    assert views == [
        ([(0, 0, 1024)], 0, 2),
        ([(0, 0, 1024)], 1, 2),
        ([(0, 1024, 2048)], 0, 2),
        ([(0, 1024, 2048)], 1, 2),
        # the rest of the long prompt leads the next batch; the budget left admits req 1
        ([(0, 2048, 2500), (1, 0, 100)], 0, 2),
        ([(0, 2048, 2500), (1, 0, 100)], 1, 2),
    ]
    assert [c.samples for p in ex.plans[:6] for c in p.prefill] == [False] * 4 + [True] * 4
    assert len({p.prefill_batch_id for p in ex.plans[:6]}) == 3
    assert [s.seq_id for s in ex.plans[6].decode] == [0, 1]
    assert sched.stats()["prefill_batches"] == 3 and sched.stats()["prefill_tokens"] == 2600


def test_layered_batches_several_requests_in_queue_order():
    sched = Scheduler(make_cfg("layered", max_model_len=8192, num_layers=48))
    reqs = [req(0, 300, 2), req(1, 300, 2), req(2, 300, 2), req(3, 8000, 2), req(4, 5, 2)]
    ex = drive(sched, reqs)
    assert chunk_view(ex.plans[0]) == [(0, 0, 300), (1, 0, 300), (2, 0, 300)]
    assert ex.plans[0].num_groups == 2  # 900 tokens
    assert chunk_view(ex.plans[2]) == [(3, 0, 8000), (4, 0, 5)]  # 8005 <= 8192 tokens
    assert ex.plans[2].num_groups == 16


def test_layered_group_modes_and_caps():
    cfg = make_cfg("layered", num_layers=7, layer_groups="pow2", max_layer_groups=4)
    sched = Scheduler(cfg)
    ex = drive(sched, [req(0, 3000, 2)])  # pow2 gives 8, capped at 4; 7 layers -> 2,2,2,1
    ranges = [(p.layer_start, p.layer_end) for p in ex.plans[:4]]
    assert ranges == [(0, 2), (2, 4), (4, 6), (6, 7)]
    sched = Scheduler(make_cfg("layered", num_layers=7, layer_groups=3))
    ex = drive(sched, [req(0, 5, 2)])
    assert [(p.layer_start, p.layer_end) for p in ex.plans[:3]] == [(0, 3), (3, 5), (5, 7)]


def test_layered_respects_max_num_seqs():
    sched = Scheduler(make_cfg("layered", max_num_seqs=2))
    ex = drive(sched, [req(i, 10, 3) for i in range(3)])
    assert chunk_view(ex.plans[0]) == [(0, 0, 10), (1, 0, 10)]


# ----- token streams -----
def mixed_workload():
    lens = [1, 7, 700, 64, 3, 513, 129, 20, 1500, 2]
    return [
        req(i, n, 1 + (i * 7) % 23, arrival=(i * 3) % 11, priority=i % 3)
        for i, n in enumerate(lens)
    ]


def outputs(reqs):
    return {r.seq_id: output_ids(r) for r in reqs}


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "orca"},
        {"policy": "orca", "max_num_batched_tokens": 100},
        {"policy": "chunked", "max_num_batched_tokens": 16},
        {"policy": "chunked"},
        {"policy": "layered"},
        {"policy": "layered", "max_num_batched_tokens": 256, "layer_groups": "pow2"},
        {"policy": "layered", "max_num_batched_tokens": 100, "layer_groups": 3},
    ],
)
def test_every_policy_produces_the_same_tokens(kw):
    reqs = mixed_workload()
    drive(Scheduler(make_cfg(**kw)), reqs)
    for r in reqs:
        assert r.status is SequenceStatus.FINISHED_LENGTH
        assert output_ids(r) == expected_output(r, 4096)
        assert r.num_preemptions == 0


def test_metrics_and_stats_of_a_run():
    reqs = [req(0, 10, 5), req(1, 20, 3, arrival=2)]
    sched = Scheduler(make_cfg("chunked"))
    drive(sched, reqs)
    m = reqs[0].metrics()
    assert (m.ttft, m.itls, m.e2e, m.max_itl) == (1.0, [1.0] * 4, 5.0, 1.0)
    assert reqs[1].first_scheduled_time == 2.0 and reqs[1].finish_time == 5.0
    st_ = sched.stats()
    assert st_["iterations"] == sum(
        st_[f"iterations_{p}"] for p in ("decode", "prefill", "hybrid", "idle")
    )
    assert st_["prefill_tokens"] == 30 and st_["decode_tokens"] == (5 - 1) + (3 - 1)
    assert st_["finished"] == 2 and st_["preemptions"] == 0 and st_["aborted"] == 0


# ----- stop conditions -----
@pytest.mark.parametrize("extra_eos", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_stop_conditions(policy, extra_eos):
    """extra_eos: 7 ends completions as one of the extra eos ids (generation_config.json's
    list), beside another main eos id."""
    eos, stop = 7, 3

    def token_fn(seq_id, pos):  # eos at output 2 of seq 0, stop token at output 1 of seq 2
        if seq_id in (0, 1) and pos == 5 + 2:
            return eos
        if seq_id in (2, 3) and pos == 5 + 1:
            return stop
        return 1

    reqs = [
        req(0, 5, 10),
        req(1, 5, 10, ignore_eos=True),
        req(2, 5, 10, stop_token_ids=[stop]),
        req(3, 5, 10, stop_token_ids=[stop], ignore_eos=True),
        req(4, 5, 6),
        req(5, 5, 1),
    ]
    ids = dict(eos_token_id=11, extra_eos_token_ids=(eos,)) if extra_eos else dict(
        eos_token_id=eos)
    sched = Scheduler(make_cfg(policy, **ids))
    drive(sched, reqs, ex=FakeExecutor(sched, token_fn))
    got = {r.seq_id: (output_ids(r), r.finish_reason) for r in reqs}
    assert got == {
        0: ([1, 1, eos], "stop"),
        1: ([1, 1, eos] + [1] * 7, "length"),
        2: ([1, stop], "stop"),
        3: ([1, stop], "stop"),  # ignore_eos does not disable stop_token_ids
        4: ([1] * 6, "length"),
        5: ([1], "length"),
    }
    assert reqs[0].status is SequenceStatus.FINISHED_STOPPED and reqs[0].is_finished


@pytest.mark.parametrize("policy", POLICIES)
def test_max_model_len_truncates_outputs(policy):
    sched = Scheduler(make_cfg(policy, max_model_len=32))
    reqs = [req(0, 30, 10), req(1, 32, 10), req(2, 31, 1)]
    drive(sched, reqs)
    assert [r.num_tokens for r in reqs] == [32, 33, 32]  # a full-length prompt yields one token
    assert all(r.finish_reason == "length" for r in reqs)


# ----- priorities -----
@pytest.mark.parametrize("policy", POLICIES)
def test_waiting_queue_order_is_priority_arrival_id(policy):
    sched = Scheduler(make_cfg(policy, max_num_seqs=1))
    for sid, prio, arr in [(0, 1, 0.0), (1, 0, 2.0), (2, 0, 1.0), (3, 1, 0.0), (4, 0, 1.0)]:
        sched.add(req(sid, 4, 2, priority=prio, arrival=arr))
    assert [s.seq_id for s in sched.waiting] == [2, 4, 1, 0, 3]
    ex = drive(sched)
    admitted = [c.seq.seq_id for p in ex.plans for c in p.prefill if c.start == 0]
    assert list(dict.fromkeys(admitted)) == [2, 4, 1, 0, 3]


def test_higher_priority_arrival_overtakes_the_queue():
    sched = Scheduler(make_cfg("orca", max_num_seqs=1))
    reqs = [req(0, 4, 3), req(1, 4, 3, arrival=1, priority=5), req(2, 4, 3, arrival=2)]
    ex = drive(sched, reqs)
    admitted = [c.seq.seq_id for p in ex.plans for c in p.prefill]
    assert admitted == [0, 2, 1]


# ----- preemption -----
@pytest.mark.parametrize("policy", POLICIES)
def test_overlapped_scheduling_gives_the_same_tokens(policy):
    reqs = mixed_workload()
    ex = drive_overlapped(Scheduler(make_cfg(policy)), reqs)
    assert ex.overlapped > 10
    for r in reqs:
        assert output_ids(r) == expected_output(r, 4096)
        assert len(r.token_times) == r.num_output_tokens


def test_overlapped_speculation_stops_at_length_and_drops_tokens_after_a_stop():
    # seq 0 stops on a stop token at its 3rd output; seq 1 ends by max_tokens
    stop = fake_token(0, 5 + 2)
    reqs = [req(0, 5, 10, stop_token_ids=[stop]), req(1, 5, 4)]
    sched = Scheduler(make_cfg("chunked", max_model_len=64))
    ex = drive_overlapped(sched, reqs)
    assert reqs[0].finish_reason == "stop" and output_ids(reqs[0])[-1] == stop
    assert reqs[0].num_output_tokens == 3 and reqs[1].num_output_tokens == 4
    decodes = [[s.seq_id for s in p.decode] for p in ex.plans]
    # seq 0 ran one wasted decode after its stop token; seq 1 none after its last token
    assert sum(0 in d for d in decodes) == 3 and sum(1 in d for d in decodes) == 3
    assert PENDING_TOKEN not in reqs[0].token_ids + reqs[1].token_ids


def test_at_most_two_plans_outstanding_and_the_newer_continues_the_older():
    sched = Scheduler(make_cfg("chunked", max_num_batched_tokens=16))
    sched.add(req(0, 20, 3))
    ex = FakeExecutor(sched)
    first = sched.schedule(0.0)  # prefill chunk [0, 16)
    sampled = ex.run(first)
    second = sched.schedule(1.0)  # planned before `first` commits: the next chunk
    with pytest.raises(RuntimeError, match="at most two"):
        sched.schedule(2.0)
    assert chunk_view(first) == [(0, 0, 16)] and chunk_view(second) == [(0, 16, 20)]
    sched.commit(first, sampled, 1.0)
    ex.run(second)
    third = sched.schedule(2.0)  # `second` finished the prompt: its token is pending
    seq = sched.running[0]
    assert [s.seq_id for s in third.decode] == [0] and seq.num_pending_tokens == 1


def test_layered_does_not_plan_ahead_when_the_next_plan_may_form_a_batch():
    sched = Scheduler(make_cfg("layered", layer_groups=2))
    sched.add(req(0, 40, 3))
    ex = FakeExecutor(sched)
    g0 = sched.schedule(0.0)  # group 0 of 2
    ex.run(g0)
    assert sched.can_plan_ahead()  # group 1 follows whatever arrives
    sched.add(req(1, 8, 3))
    assert sched.can_plan_ahead()
    g1 = sched.schedule(1.0)
    sched.commit(g0, StepResult(), 1.0)
    sampled = ex.run(g1)
    # g1 ends the batch and seq 1 waits: the next plan forms a batch, which a request
    # arriving while g1 runs must be able to join
    assert not sched.can_plan_ahead()
    sched.commit(g1, sampled, 2.0)
    assert sched.can_plan_ahead()  # nothing outstanding
    # paper groups: a batch of <= 512 tokens is one group, and missing it costs one step
    sched = Scheduler(make_cfg("layered", layer_groups="paper"))
    sched.add(req(0, 40, 3))
    sampled = FakeExecutor(sched).run(sched.schedule(0.0))  # a one-group batch, in flight
    sched.add(req(1, 500, 3))
    assert sched.can_plan_ahead()
    sched.add(req(2, 100, 3))  # 600 waiting tokens: the next batch would be two groups
    assert not sched.can_plan_ahead()


def max_kv_pages(r, max_model_len, page_size):
    """Pages for every token the request can hold KV for (all but its last)."""
    n = r.num_prompt_tokens
    final = min(n + r.sampling_params.max_tokens, max(max_model_len, n + 1))
    return -(-(final - 1) // page_size)


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "orca"},
        {"policy": "chunked", "max_num_batched_tokens": 16},
        {"policy": "layered", "layer_groups": 4},
        {"policy": "layered", "max_num_batched_tokens": 24, "layer_groups": "paper"},
    ],
)
def test_preemption_under_a_tiny_pool_keeps_outputs(kw):
    def workload():
        return [req(i, 3 + 5 * i, 30, arrival=i // 2, priority=i % 2) for i in range(6)]

    free = workload()
    drive(Scheduler(make_cfg(page_size=2, **kw)), free)
    tight = workload()
    pages = max(max_kv_pages(r, 4096, 2) for r in tight)
    sched = Scheduler(make_cfg(page_size=2, num_pages=pages, **kw))
    ex = drive(sched, tight)
    assert outputs(tight) == outputs(free)
    overlapped = workload()
    ex_o = drive_overlapped(Scheduler(make_cfg(page_size=2, num_pages=pages, **kw)), overlapped)
    assert outputs(overlapped) == outputs(free) and ex_o.overlapped > 0
    assert any(ex_o.preempted.values())
    assert sched.stats()["preemptions"] > 0
    assert any(ex.preempted.values())
    assert sum(r.num_preemptions for r in tight) == sched.stats()["preemptions"]
    resumed = [c for p in ex.plans for c in p.prefill if c.seq.num_preemptions and c.start == 0]
    assert any(c.seq.prefill_target > c.seq.num_prompt_tokens for c in resumed)
    for r in tight:  # a preempted request's token times keep the earlier tokens
        assert r.metrics().num_tokens == r.num_output_tokens == 30


def test_decode_that_is_the_tail_preempts_itself_never_the_layered_batch():
    cfg = make_cfg("layered", num_layers=8, layer_groups=8, page_size=4, num_pages=5)
    sched = Scheduler(cfg)
    d = req(0, 4, 12)  # up to 15 tokens of KV: 4 pages; prefill in steps 0-7
    q = req(1, 12, 1, arrival=1)  # 3 pages, held by the batch of steps 8-15
    ex = drive(sched, [d, q])
    # step 12: d (9 tokens) needs its third page, none is free, and d is the only decode
    p = next(p for p in ex.plans if ex.preempted[p.step_id])
    assert p.step_id == 12 and ex.preempted[12] == (0,) and not p.decode
    assert chunk_view(p) == [(1, 0, 12)] and p.group_index == 4  # the batch goes on
    resume = next(p for p in ex.plans if p.step_id > 12 and p.prefill and p.prefill[0].seq is d)
    assert chunk_view(resume) == [(0, 0, 9)] and resume.step_id == 16
    assert output_ids(d) == expected_output(d, 4096) and d.num_preemptions == 1
    assert q.num_preemptions == 0


def test_lower_priority_decode_is_preempted_first():
    cfg = make_cfg("orca", page_size=2, num_pages=8)
    sched = Scheduler(cfg)
    hi, lo = req(0, 2, 12, priority=0), req(1, 2, 12, priority=1, arrival=-1.0)
    ex = drive(sched, [lo, hi])
    victims = [sid for ids in ex.preempted.values() for sid in ids]
    assert victims and set(victims) == {1}
    assert hi.num_preemptions == 0 and lo.num_preemptions >= 1
    assert output_ids(hi) == expected_output(hi, 4096)
    assert output_ids(lo) == expected_output(lo, 4096)


# ----- aborts -----
def test_abort_waiting_and_unknown():
    sched = Scheduler(make_cfg("orca", max_num_seqs=1))
    a, b = req(0, 8), req(1, 8)
    sched.add(a)
    sched.add(b)
    ex = FakeExecutor(sched)
    step_once(sched, 0, ex)
    assert sched.abort(1, now=1.0) is b and b.finish_reason == "abort" and b.finish_time == 1.0
    assert b not in sched.waiting and sched.abort(1) is None and sched.abort(99) is None
    drive(sched, ex=ex)
    assert a.finish_reason == "length" and not output_ids(b)
    assert sched.stats()["aborted"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_decode_between_steps_frees_at_once(policy):
    sched = Scheduler(make_cfg(policy))
    a = req(0, 8, 20)
    sched.add(a)
    ex = FakeExecutor(sched)
    step_once(sched, 0, ex)
    step_once(sched, 1, ex)
    assert sched.block_manager.num_free_pages < 4096
    assert sched.abort(0) is a and a.status is SequenceStatus.FINISHED_ABORTED
    assert sched.block_manager.num_free_pages == 4096 and not sched.has_unfinished()
    assert a.num_output_tokens == 2
    assert sched.abort(0) is None  # already finished


def test_abort_partial_chunked_prefill():
    sched = Scheduler(make_cfg("chunked", max_num_batched_tokens=16))
    a = req(0, 40, 5)
    sched.add(a)
    step_once(sched, 0, FakeExecutor(sched))
    assert a in sched.prefilling and a.num_computed_tokens == 16
    sched.abort(0)
    assert sched.block_manager.num_free_pages == 4096 and not sched.prefilling
    assert not output_ids(a)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("send_token", [True, False])
def test_abort_during_a_step_frees_after_commit(policy, send_token):
    sched = Scheduler(make_cfg(policy))
    a, b = req(0, 8, 20), req(1, 8, 20)
    sched.add(a)
    sched.add(b)
    ex = FakeExecutor(sched)
    step_once(sched, 0, ex)
    plan = sched.schedule(1.0)
    sampled = ex.run(plan)
    sched.abort(0)
    assert sched.block_manager.num_free_pages == 4096 - 6  # a's pages are still being written
    if not send_token:
        del sampled.tokens[0]
    finished = sched.commit(plan, sampled, 2.0)
    assert finished == [] and a.num_output_tokens == 1 and b.num_output_tokens == 2
    assert sched.block_manager.num_free_pages == 4096 - 3
    drive(sched, ex=ex)


def test_abort_inside_an_in_flight_layered_batch():
    sched = Scheduler(make_cfg("layered", layer_groups=4))
    a, b, c = req(0, 40, 5), req(1, 40, 5), req(2, 4, 5, arrival=1)
    ex = FakeExecutor(sched)
    sched.add(a)
    sched.add(b)
    step_once(sched, 0, ex)  # group 0 of the batch {a, b}
    sched.add(c)
    assert sched.abort(0) is a and a.is_finished
    assert sched.block_manager.num_free_pages == 4096 - 20  # the executor may still write a's KV
    for step in (1, 2):
        plan = step_once(sched, step, ex)
        assert chunk_view(plan) == [(0, 0, 40), (1, 0, 40)]
    assert sched.block_manager.num_free_pages == 4096 - 20
    last = step_once(sched, 3, ex)
    assert last.is_last_group and output_ids(a) == [] and b.num_output_tokens == 1
    assert sched.block_manager.num_free_pages == 4096 - 10  # a's pages are back, b's remain
    assert chunk_view(step_once(sched, 4, ex)) == [(2, 0, 4)]  # c waited for the next batch
    drive(sched, ex=ex)
    assert output_ids(b) == expected_output(b, 4096)


def test_abort_whole_in_flight_batch_still_frees_everything():
    sched = Scheduler(make_cfg("layered", layer_groups=4))
    ex = FakeExecutor(sched)
    sched.add(req(0, 40, 5))
    step_once(sched, 0, ex)
    sched.abort(0)
    assert sched.has_unfinished()  # pages are held until the batch completes
    ex = drive(sched, ex=ex)
    assert len(ex.plans) == 4 and not sched.has_unfinished()


# ----- bad input -----
def snapshot(sched):
    return (
        [s.seq_id for s in sched.waiting],
        [s.seq_id for s in sched.running],
        [s.seq_id for s in sched.prefilling],
        sched.block_manager.num_free_pages,
        sched.stats(),
        sched.has_unfinished(),
    )


def bad_requests():
    started = req(9, 4)
    started.status = RUNNING
    with_pages = req(10, 4)
    with_pages.page_ids = [0]
    with_output = req(11, 4)
    with_output.token_ids.append(1)
    return [
        (Sequence(20, []), "empty prompt"),
        (req(21, 65), "max_model_len"),
        (Sequence(22, [1, VOCAB]), "outside"),
        (Sequence(23, [1, -1]), "outside"),
        (Sequence(24, [1, 2.0]), "outside"),
        (Sequence(25, [1, True]), "outside"),
        (req(26, 4, stop_token_ids=[VOCAB]), "stop_token_ids"),
        (req(27, 40, 1), "KV pages"),  # the prompt alone needs 10 pages, the pool has 8
        (req(28, 20, 40), "KV pages"),  # fits, but its outputs may not
        (req(0, 4), "already"),  # a live id
        (started, "fresh"),
        (with_pages, "fresh"),
        (with_output, "fresh"),
        (Sequence("x", [1]), "seq_id"),
        (Sequence(29, [1], priority=0.5), "priority"),
        ([1, 2, 3], "Sequence"),
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_requests_raise_without_changing_state(policy):
    sched = Scheduler(make_cfg(policy, max_model_len=64, num_pages=8, max_num_seqs=1))
    sched.add(req(0, 4, 8))
    sched.add(req(1, 4, 8))
    ex = FakeExecutor(sched)
    step_once(sched, 0, ex)
    before = snapshot(sched)
    for bad, match in bad_requests():
        with pytest.raises(ValueError, match=match):
            sched.add(bad)
        assert snapshot(sched) == before
    sched.add(req(2, 20, 10))  # 29 tokens of KV: exactly the 8 pages
    drive(sched, ex=ex)


def test_commit_and_schedule_misuse():
    sched = Scheduler(make_cfg("chunked"))
    sched.add(req(0, 8, 3))
    plan = sched.schedule(0.0)
    other = StepPlan(step_id=plan.step_id, num_layers=8)
    with pytest.raises(RuntimeError, match="oldest plan"):
        sched.commit(other, StepResult(), 1.0)
    for sampled, match in [
        ({}, "no sampled token"),
        ({0: 1, 5: 1}, "do not sample"),
        ({0: VOCAB}, "outside"),
        ({0: -1}, "outside"),
        ({0: True}, "outside"),
        ({0: 1.0}, "outside"),
    ]:
        with pytest.raises(ValueError, match=match):
            sched.commit(plan, StepResult(sampled), 1.0)
        assert sched.running == [] and plan.prefill[0].seq.num_computed_tokens == 0
    with pytest.raises(TypeError, match="StepResult"):
        sched.commit(plan, {0: 5}, 1.0)
    with pytest.raises(ValueError, match="prompt log-probabilities"):
        sched.commit(plan, StepResult({0: 5}, prompt_logprobs=((0, 1, {1: 0.0}),)), 1.0)
    sched.commit(plan, StepResult({0: 5}), 1.0)
    assert output_ids(sched.running[0]) == [5]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"policy": "fifo"}, "policy"),
        ({"policy": "chunked", "max_num_batched_tokens": 8}, "max_num_seqs"),
        ({"policy": "orca", "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"policy": "layered", "layer_groups": "auto"}, "layer_groups"),
        ({"policy": "layered", "layer_groups": 0}, "layer_groups"),
        ({"policy": "layered", "num_layers": 0}, "num_layers"),
        ({"policy": "layered", "page_size": 0}, "page_size"),
        ({"policy": "layered", "vocab_size": 1.5}, "vocab_size"),
        ({"policy": "layered", "eos_token_id": VOCAB}, "eos_token_id"),
        ({"policy": "layered", "extra_eos_token_ids": (VOCAB,)}, "extra_eos_token_ids"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(**kw)


def test_plan_objects_validate():
    s = req(0, 10)
    with pytest.raises(ValueError):
        PrefillChunk(s, 4, 4)
    with pytest.raises(ValueError):
        PrefillChunk(s, 0, 11)
    chunk = PrefillChunk(s, 0, 10)
    assert chunk.samples and chunk.num_tokens == 10
    with pytest.raises(ValueError, match="prefill_batch_id"):
        StepPlan(step_id=0, num_layers=4, prefill=(chunk,))
    with pytest.raises(ValueError, match="unit range"):
        StepPlan(step_id=0, num_layers=4, prefill=(chunk,), prefill_batch_id=0, unit_end=10)
    with pytest.raises(ValueError, match="all layers"):
        StepPlan(step_id=0, num_layers=4, prefill=(chunk,), prefill_batch_id=0, unit_end=4)
    with pytest.raises(ValueError, match="twice"):
        StepPlan(step_id=0, num_layers=4, decode=(s,), prefill=(chunk,), prefill_batch_id=0)
    plan = StepPlan(
        step_id=0, num_layers=4, prefill=(chunk,), prefill_batch_id=0,
        unit_start=4, unit_end=8, group_index=1, num_groups=2,
    )  # fmt: skip
    assert plan.is_last_group and not plan.is_first_group and plan.sampling_seqs == (s,)


def test_scheduler_core_does_not_import_jax():
    """The core must stay pure Python so a simulator can reuse it without an accelerator."""
    import subprocess
    import sys

    code = (
        "import sys, lp_jax.core.scheduler, lp_jax.core.metrics\n"
        "bad = sorted({'jax', 'jaxlib', 'numpy', 'flax'} & set(sys.modules))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----- metrics -----
def test_request_metrics():
    m = RequestMetrics(1.0, token_times=(3.0, 4.0, 6.0, 6.5))
    assert m.first_token_time == 3.0 and m.ttft == 2.0 and m.e2e == 5.5
    assert m.itls == [1.0, 2.0, 0.5] and m.max_itl == 2.0 and m.num_tokens == 4
    assert slo_pass(m, 2.0, 2.0) and not slo_pass(m, 1.9, 2.0) and not slo_pass(m, 2.0, 1.9)
    one = RequestMetrics(0.0, 1.0, (1.0,))
    assert one.itls == [] and one.max_itl == 0.0 and slo_pass(one, 1.0, 0.0)
    none = RequestMetrics(0.0)
    assert none.ttft is None and none.e2e is None and not slo_pass(none, 1e9, 1e9)
    for bad in [
        dict(arrival_time=0.0, token_times=(2.0, 1.0)),
        dict(arrival_time=0.0, first_token_time=1.0, token_times=(2.0,)),
        dict(arrival_time=0.0, first_token_time=1.0),
        dict(arrival_time=5.0, token_times=(2.0,)),
    ]:
        with pytest.raises(ValueError):
            RequestMetrics(**bad)


def test_summarize():
    ms = [RequestMetrics(0.0, token_times=(float(i), float(i) + i)) for i in range(1, 101)]
    s = summarize(ms + [RequestMetrics(0.0)], ttft_slo=50.0, tbt_slo=100.0)
    assert s["num_requests"] == 101 and s["num_with_tokens"] == 100
    assert s["ttft_mean"] == pytest.approx(50.5)
    assert s["ttft_p50"] == pytest.approx(50.5) and s["ttft_p99"] == pytest.approx(99.01)
    assert s["max_itl_p90"] == pytest.approx(90.1) and s["e2e_p50"] == pytest.approx(101.0)
    assert s["slo_attainment"] == pytest.approx(50 / 101)
    assert "slo_attainment" not in summarize(ms)
    assert percentile([3.0], 99) == 3.0 and percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


# ----- random workloads -----
@st.composite
def workloads(draw, policy):
    max_num_seqs = draw(st.integers(1, 6))
    cfg = dict(
        policy=policy,
        num_layers=draw(st.integers(1, 8)),
        page_size=draw(st.sampled_from([1, 2, 4, 16])),
        max_model_len=draw(st.integers(8, 96)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 80)),
        layer_groups=draw(st.sampled_from(["paper", "pow2", 2, 3, 5, 8])),
        max_layer_groups=draw(st.integers(1, 16)),
        eos_token_id=draw(st.one_of(st.none(), st.integers(0, 31))),
        vocab_size=32,  # small, so eos and stop tokens do occur
        enable_prefix_caching=draw(st.booleans()),
    )
    preemptive = policy == "flowprefill" or (policy == "layered" and draw(st.booleans()))
    if policy == "layered" and not preemptive and draw(st.booleans()):
        cfg.update(layer_groups="adaptive", tbt_slo_s=draw(st.sampled_from([None, 0.2, 1.0])),
                   adaptive_margin=draw(st.sampled_from([0.0, 0.5])))
    if preemptive:
        cfg.update(preemptible=policy == "layered",
                   preemption_granularity=draw(st.sampled_from(["operator", "layer", "group"])),
                   max_paused_prefills=draw(st.integers(0, 2)),
                   slo_alpha=draw(st.sampled_from([0.0, 0.1, 0.5])))
    reqs = []
    # Prompts open with one of two shared "system prompts" (or none), so that prefix
    # caching hits, in full sometimes (an equal prompt), and part-way through pages.
    systems = [[(7 * k + j * j) % 32 for j in range(cfg["max_model_len"])] for k in (1, 2)]
    for i in range(draw(st.integers(1, 10))):
        plen = draw(st.integers(1, cfg["max_model_len"]))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 20)),
            stop_token_ids=draw(st.lists(st.integers(0, 31), max_size=2)),
            ignore_eos=draw(st.booleans()),
        )
        shared = draw(st.integers(0, plen)) if draw(st.booleans()) else 0
        system = systems[draw(st.integers(0, 1))]
        prompt = system[:shared] + [(i + j) % 32 for j in range(plen - shared)]
        arrival = draw(st.integers(0, 12))
        priority = draw(st.integers(0, 2))
        slo = None
        if preemptive and draw(st.booleans()):  # tight deadlines force preemptions
            slo = SLO(draw(st.sampled_from([0.5, 2.0, 8.0, 50.0])))
        reqs.append(Sequence(i, prompt, params, priority=priority, arrival_time=arrival,
                             slo=slo))
    need = max(max_kv_pages(r, cfg["max_model_len"], cfg["page_size"]) for r in reqs)
    cfg["num_pages"] = need + draw(st.sampled_from([0, 0, 1, 2, 4, 16]))  # mostly tight
    abort = st.tuples(st.integers(0, 20), st.integers(0, len(reqs) - 1), st.booleans())
    aborts = draw(st.lists(abort, max_size=4))  # (step, seq_id, during the step)
    return SchedulerConfig(**cfg | {"policy": resolve_policy(policy)}), reqs, aborts


@pytest.mark.parametrize("driver", [drive, drive_overlapped])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_workloads(policy, driver, data):
    """Random arrivals, lengths, pools and aborts: no page leak, every request finishes with
    the policy-independent token stream, every chunk crosses every layer exactly once;
    with plans scheduled one step ahead of their commit too."""
    cfg, reqs, aborts = data.draw(workloads(policy))
    # A latency model with real costs, so adaptive spans and slack vary: 1 ms per decode
    # row-layer, 2 ms per prefill token-unit, 5 ms per step.
    coef = [0.0] * len(FEATURES)
    for name, v in (("decode_rows", 1e-3), ("attn_t", 2e-3), ("mlp_t", 2e-3), ("step", 5e-3)):
        coef[FEATURES.index(name)] = v
    sched = Scheduler(cfg, LatencyModel(ModelDims(cfg.num_layers), coef))
    token_fn = lambda sid, pos: fake_token(sid, pos, 32)
    aborted = set()

    def hook(mid):
        def fire(step, sched, plan=None):
            for at, sid, during in aborts:
                if at == step and during == mid and sched.abort(sid) is not None:
                    aborted.add(sid)

        return fire

    ex = FakeExecutor(sched, token_fn)
    driver(sched, reqs, ex=ex, before=hook(False), during=hook(True))
    for r in reqs:
        want = expected_output(r, cfg.max_model_len, cfg.eos_token_id, token_fn)
        assert r.is_finished
        if r.seq_id in aborted:
            assert r.finish_reason == "abort" and want[: r.num_output_tokens] == output_ids(r)
        else:
            assert output_ids(r) == want
            stopped = r.status is SequenceStatus.FINISHED_STOPPED
            assert r.finish_reason == ("stop" if stopped else "length")
            assert len(r.token_times) == r.num_output_tokens
    # every completed chunk crossed every unit exactly once (also checked step by step)
    assert all(v == list(range(2 * cfg.num_layers)) for k, v in ex.layers.items()
               if not _dropped(sched, ex, k))
    st_ = sched.stats()
    assert st_["finished"] + st_["aborted"] == len(reqs)
    event(f"preempted={bool(st_['preemptions'])}")
    event(f"aborted={bool(aborted)}")
    event(f"multi-group batches={any(p.num_groups > 1 for p in ex.plans)}")
    event(f"adaptive={cfg.layer_groups == 'adaptive'}")
    event(f"overlapped={ex.overlapped > 0}")
    event(f"prefix cache hits={st_['prefix_cache_hits'] > 0}")
    bm = sched.block_manager
    assert bm.num_free_pages == cfg.num_pages and not bm._holders and not bm._published
    if cfg.enable_prefix_caching:
        assert st_["prefix_cache_hits"] <= st_["prefix_cache_queries"]
        assert st_["prefix_cache_hits"] % cfg.page_size == 0
    else:
        assert st_["prefix_cache_queries"] == st_["prefix_cache_hits"] == 0
