"""A prefill token budget per data rank (lp_jax/core/budget.py): under data-parallel
attention orca, chunked and layered give each rank max_num_batched_tokens of its own, so
the ranks prefill side by side, one rank's long prompt leaves the others' budgets alone,
and a row bucket holds one rank's budget. Scheduler only (no engine), milliseconds each;
the engines of tests/test_data_parallel.py and tests/test_dp_families.py serve the same
plans and check their tokens."""

import pytest

from lp_jax.core.plan import StepResult
from lp_jax.core.policies import ChunkedPolicy
from lp_jax.core.programs import hidden_rows
from lp_jax.core.scheduler import Scheduler
from lp_jax.spec.config import SpeculativeConfig
from tests.conftest import make_sched_cfg, make_seq

BUDGET = 16


def _sched(policy, dp=2, **kw):
    return Scheduler(make_sched_cfg(policy, data_parallel_size=dp,
                                    max_num_batched_tokens=BUDGET, **kw))


def _rows(sched, plan):
    """(prefill tokens, rows) of each rank in a plan."""
    d = sched.config.data_parallel_size
    pre, rows = [0] * d, [0] * d
    for seq in plan.decode:
        rows[sched.block_manager.rank_of(seq)] += 1
    for c in plan.prefill:
        r = sched.block_manager.rank_of(c.seq)
        pre[r] += c.num_tokens
        rows[r] += c.num_tokens
    return pre, rows


def _commit(sched, plan, now):
    return sched.commit(plan, StepResult(tokens={s.seq_id: 7 for s in plan.sampling_seqs}), now)


@pytest.mark.parametrize("policy", ["chunked", "layered", "orca"])
def test_two_ranks_prefill_in_the_same_step_each_up_to_its_own_budget(policy):
    """Two waiting prompts of 12 tokens, a budget of 16: one budget for both ranks would
    take the first prompt and 4 tokens of the second; a budget a rank prefills both
    whole, one on each rank, in the first step."""
    sched = _sched(policy)
    a, b = make_seq(0, 12), make_seq(1, list(range(20, 32)))
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(0.0)
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(0, 0, 12), (1, 0, 12)]
    assert sorted(sched.block_manager.rank_of(s) for s in (a, b)) == [0, 1]
    assert _rows(sched, plan)[0] == [12, 12]


def test_a_policy_without_rank_budgets_keeps_one_budget_for_the_plan():
    """A policy that does not declare rank_budgets (FlowPrefill, a user's) fills one
    budget for all ranks, and placement stays free: the prompts still spread by load."""
    one = type("ChunkedOneBudget", (ChunkedPolicy,), {"rank_budgets": False})
    sched = _sched(one)
    assert not sched.config.rank_budgets
    a, b = make_seq(0, 12), make_seq(1, list(range(20, 32)))
    sched.add(a)
    sched.add(b)
    plan = sched.schedule(0.0)
    assert [(c.seq.seq_id, c.num_tokens) for c in plan.prefill] == [(0, 12), (1, 4)]
    assert sorted(sched.block_manager.rank_of(s) for s in (a, b)) == [0, 1]


@pytest.mark.parametrize("policy", ["chunked", "layered"])
def test_a_long_prompt_does_not_take_the_other_ranks_budget(policy):
    """A 100-token prompt, then three of 4: the long one takes rank 0's 16 tokens and
    the short ones go, whole, to rank 1's budget in the same step (one budget would have
    given the long prompt all 16 and left them waiting). Chunked continues the long
    prompt on rank 0 at 16 a step while rank 1's decodes count against rank 1 only."""
    sched = _sched(policy)
    long = make_seq(0, 100, max_tokens=2)
    short = [make_seq(i, list(range(10 * i, 10 * i + 4)), max_tokens=2) for i in (1, 2, 3)]
    for s in [long, *short]:
        sched.add(s)
    plan = sched.schedule(0.0)
    assert [(c.seq.seq_id, c.num_tokens) for c in plan.prefill] == [
        (0, 16), (1, 4), (2, 4), (3, 4)]
    assert sched.block_manager.rank_of(long) == 0
    assert {sched.block_manager.rank_of(s) for s in short} == {1}
    _commit(sched, plan, 1.0)
    if policy == "chunked":
        plan = sched.schedule(1.0)
        assert [s.seq_id for s in plan.decode] == [1, 2, 3]  # rank 1: 3 of its 16 rows
        assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(0, 16, 32)]


def test_layer_groups_follow_the_busiest_ranks_tokens():
    """Layered under DP: G (the paper's ceil(tokens / 512)) comes from the busiest rank's
    prefill tokens, what an SPMD step's prefill costs, not from the sum over ranks."""
    sched = Scheduler(make_sched_cfg("layered", data_parallel_size=2,
                                     max_num_batched_tokens=1024))
    for i in range(2):
        sched.add(make_seq(i, 600))
    plan = sched.schedule(0.0)
    assert _rows(sched, plan)[0] == [600, 600]
    assert plan.num_groups == 2  # 600 tokens a rank; 1,200 would give 3


def test_a_full_ranks_budget_sends_the_next_prompt_to_a_rank_with_budget_left():
    """Placement (prefix affinity, then load) is kept among the ranks with budget left:
    rank 1 holds a long decode, so by load every new prompt would go to idle rank 0; once
    rank 0's budget is spent this step, the next prompt goes to rank 1 instead of
    waiting (or taking no tokens)."""
    sched = _sched("layered")
    y, x = make_seq(0, 4, max_tokens=1), make_seq(1, 40, max_tokens=50)
    sched.add(y)  # rank 0, so that x goes to rank 1 and y then leaves
    sched.add(x)
    now = 0.0
    while x.num_output_tokens == 0:
        _commit(sched, sched.schedule(now), now)
        now += 1.0
    assert y.is_finished and sched.block_manager.rank_of(x) == 1
    a, b = make_seq(10, 16), make_seq(11, list(range(50, 58)))
    sched.add(a)
    sched.add(b)
    assert sched.block_manager.place(b, 8) == 0  # by load alone
    plan = sched.schedule(now)
    assert [(c.seq.seq_id, c.num_tokens) for c in plan.prefill] == [(10, 16), (11, 8)]
    assert [sched.block_manager.rank_of(s) for s in (a, b)] == [0, 1]


@pytest.mark.parametrize("policy", ["chunked", "layered", "orca"])
def test_every_plan_fits_a_ranks_bucket_and_nothing_leaks(policy):
    """Mixed prompts (3 to 40 tokens) arriving two at a time on DP 2, to completion: no rank's
    prefill passes its budget (orca: one whole prompt opens a rank alone), no rank's rows
    pass the policy's step_rows (the largest bucket), every request finishes, and every
    page and sequence slot comes back."""
    sched = _sched(policy, max_num_seqs=6)
    cls, cfg = sched.config.policy_class, sched.config
    lengths = [40, 3, 17, 9, 25, 5, 12, 33, 7, 20]
    seqs = [make_seq(i, list(range(i * 50 + 1, i * 50 + 1 + n)), max_tokens=3 + i % 4)
            for i, n in enumerate(lengths)]
    now, both = 0.0, 0
    while sched.has_unfinished() or seqs:
        if int(now) % 3 == 0:
            for s in seqs[:2]:
                sched.add(s)
            del seqs[:2]
        plan = sched.schedule(now)
        pre, rows = _rows(sched, plan)
        assert max(rows) <= cls.step_rows(cfg)
        for r, n in enumerate(pre):
            whole = [c for c in plan.prefill if sched.block_manager.rank_of(c.seq) == r]
            assert n <= BUDGET or (policy == "orca" and len(whole) == 1)
        both += sum(n > 0 for n in pre) == 2
        _commit(sched, plan, now)
        now += 1.0
    assert both > 0  # some steps prefilled on both ranks
    assert sched.block_manager.num_free_pages == cfg.num_pages
    assert sched.block_manager.balance()["seqs"] == [0, 0]
    assert sorted(sched._free_seq_slots) == list(range(6))
    assert sched.stats()["finished"] == len(lengths)


def test_the_programs_hold_one_ranks_budget():
    """A bucket holds one rank's budget beside its own decodes (ceil(max_num_seqs / d),
    or max_num_seqs with speculation, whose verification rows are capped over all ranks);
    layered's carried-hidden buffer has a block of one budget on each rank. FlowPrefill
    keeps one budget for the plan, which may all land on one rank; a chunked budget must
    hold a rank's decodes only."""
    layered = make_sched_cfg("layered", data_parallel_size=4, max_num_batched_tokens=64,
                             max_num_seqs=8)
    assert layered.rank_budgets and layered.policy.step_rows(layered) == 64 + 2
    assert hidden_rows(layered) == 8 + 64  # a rank's block
    spec = make_sched_cfg("layered", data_parallel_size=4, max_num_batched_tokens=64,
                          max_num_seqs=8, speculative_config=SpeculativeConfig(
                              method="ngram", num_speculative_tokens=2))
    assert spec.policy.step_rows(spec) == 64 + 8
    flow = make_sched_cfg("flowprefill", data_parallel_size=4, max_num_batched_tokens=64,
                          max_num_seqs=8)
    assert not flow.rank_budgets and hidden_rows(flow) == 8 + 64 * (1 + flow.max_paused_prefills)
    one = make_sched_cfg("layered", max_num_batched_tokens=64, max_num_seqs=8)
    assert one.policy.step_rows(one) == 64 + 8 and hidden_rows(one) == 8 + 64
    make_sched_cfg("chunked", data_parallel_size=4, max_num_batched_tokens=2, max_num_seqs=8)
    with pytest.raises(ValueError, match="a data rank's decodes"):
        make_sched_cfg("chunked", data_parallel_size=4, max_num_batched_tokens=1,
                       max_num_seqs=8)
