"""The policy interface: what goes into the prefill half of each plan.

The scheduler core (scheduler.py) owns the queues, KV-page admission, decodes,
preemption and commit; a policy decides only which prompt tokens each plan prefills,
and through which layers. A policy is a `Policy` subclass. It may be a built-in one
(orca.py, chunked.py, layered.py, flowprefill.py), or any class a user passes as
`LLM(scheduling=MyPolicy)`, `lp-serve --scheduling pkg.module:MyPolicy`, or the
simulator's `SimConfig(policy=...)` (docs/custom_policy.md is a complete example).

A policy sees the scheduler through `self.sched` and uses only these members:

    sched.config        the SchedulerConfig (core/config.py), read-only
    sched.waiting       requests not admitted, in queue order (priority, arrival, id)
    sched.prefilling    admitted requests whose prefill is not complete, in admission order
    sched.running       requests that decode
    sched.now           the time the current plan is made at
    sched.latency       the step-latency estimator (latency.py)
    sched.admit(seq, ranks=None)  admit a waiting request if a slot and its pages are free
                        (on one of `ranks`, data ranks, if given); None if not
    sched.admit_head(ranks=None)  admit(sched.waiting[0], ranks)
    sched.prefill_budget()    the plan's prefill tokens (core/budget.py): one count, or
                        one per data rank for a policy with `rank_budgets`
    sched.prefill_start(seq)  where seq's next chunk starts (its cached prefix counts as done)
    sched.new_batch_id()      an id for a new prefill batch
    sched.next_step_id  the step id of the plan being made
    sched.outstanding_plans   plans made and not committed yet (on the device), oldest first
    sched.count(name, n=1)    add to one of sched.stats()'s counters
    sched.max_decode_rows(seq)  rows seq's decode may run: 1, or 1 + k when it speculates

Declared options, read before the policy runs (class attributes and static methods;
the engine, `python -m lp_jax.aot` and the simulator size their programs from them, so
nothing outside a policy branches on its name):

    name                    the registry name (lp_jax.core.policies.POLICIES)
    default_budget(cfg)     max_num_batched_tokens when none is given
    check(cfg)              raise ValueError for a configuration it cannot run
    max_prefill_tokens(cfg) the most prompt tokens one plan carries (default: the budget)
    token_buckets(cfg)      the row buckets to compile, one program each (default:
                            programs.default_token_buckets up to `step_rows`)
    decodes_in_budget       True if decodes count against the budget (the step then needs
                            no rows beyond it); else a step holds the prefill plus every
                            decode (`step_rows`)
    hidden_slots(cfg)       prefill batches whose hidden states the executor keeps
                            between plans (`StepPlan.prefill_rows`)
    adaptive_groups         whether it takes layer_groups="adaptive"
    rank_budgets            under data-parallel attention, whether max_num_batched_tokens
                            is each rank's budget (the policy fills `sched.prefill_budget()`
                            rank by rank, so one bucket holds one rank's budget); else one
                            budget holds the whole plan, whichever ranks it lands on
    uses_latency            whether it reads the latency estimator (the simulator then
                            feeds it every simulated step)
    preemptible_policy      the class a `preemptible=True` config runs instead, or None

With prefix caching an admitted sequence's prefill starts at its first uncached token
(`seq.num_computed_tokens`), and budgets count only the tokens a chunk computes; before
admission, `sched.prefill_start` says where it would start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lp_jax.core.budget import PrefillBudget
from lp_jax.core.config import SchedulerConfig
from lp_jax.core.plan import PrefillChunk, StepPlan
from lp_jax.core.programs import default_token_buckets
from lp_jax.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PrefillPart:
    """The prefill half of a plan, as a policy decides it."""

    chunks: tuple[PrefillChunk, ...]
    batch_id: int | None
    unit_start: int = 0  # the prefill span in operator units (StepPlan)
    unit_end: int | None = None  # None: the whole stack
    group_index: int = 0
    num_groups: int = 1
    rows: tuple[int, ...] = ()  # hidden-buffer row of each chunk; (): packed from 0


class Policy:
    """Chooses prefill chunks; admission goes through `sched.admit` / `sched.admit_head`."""

    name: ClassVar[str] = ""
    decodes_in_budget: ClassVar[bool] = False
    adaptive_groups: ClassVar[bool] = False
    rank_budgets: ClassVar[bool] = False
    uses_latency: ClassVar[bool] = False
    preemptible_policy: ClassVar[type[Policy] | None] = None

    def __init__(self, sched) -> None:
        self.sched = sched

    # ----- declared options
    @staticmethod
    def default_budget(cfg: SchedulerConfig) -> int:
        """Default max_num_batched_tokens."""
        raise NotImplementedError

    @staticmethod
    def check(cfg: SchedulerConfig) -> None:
        """Policy-specific config checks (raise ValueError)."""

    @staticmethod
    def max_prefill_tokens(cfg: SchedulerConfig) -> int:
        """The most prompt tokens one plan carries."""
        return cfg.max_num_batched_tokens

    @staticmethod
    def hidden_slots(cfg: SchedulerConfig) -> int:
        """Prefill batches whose hidden states the executor keeps between plans, each in
        an area of max_num_batched_tokens rows (StepPlan.prefill_rows)."""
        return 0

    @classmethod
    def step_rows(cls, cfg: SchedulerConfig) -> int:
        """The rows of the largest call a plan makes on one data rank (the one device):
        the row buckets must reach it. A rank's prefill is at most the budget, its own
        under `rank_budgets`, else all of it may land on one rank."""
        decodes = 0 if cls.decodes_in_budget else cfg.max_decode_rows_per_rank
        return cls.max_prefill_tokens(cfg) + decodes

    @classmethod
    def token_buckets(cls, cfg: SchedulerConfig) -> tuple[int, ...]:
        """The row buckets the step is compiled for, one program each (programs.py)."""
        return default_token_buckets(cls.step_rows(cfg))

    # ----- one plan
    def schedule_prefill(self, num_decode: int, admit: bool) -> PrefillPart:
        """The prefill half of the next plan, next to `num_decode` decodes; `admit`: may
        it admit waiting requests (False right after a preemption)."""
        raise NotImplementedError

    def on_advance(self, plan: StepPlan) -> None:
        """Called once per plan, when the scheduler applies its token-independent
        effects (at the next schedule() or at its commit, whichever comes first)."""

    def in_flight(self) -> tuple[Sequence, ...]:
        """Sequences of a prefill batch that spans iterations and has not completed."""
        return ()

    def decodes_now(self) -> bool:
        """Whether the next plan runs the decodes (they wait otherwise)."""
        return True

    def notify(self, event: str, seq: Sequence) -> None:
        """A request event: "arrival", "abort", "finish", "preempt", or "free" (a
        finished request's pages came back); event-driven policies run a round on it."""

    def release_paused(self, busy: set[int]) -> list[Sequence]:
        """Under memory pressure: sequences of a paused prefill to preempt, if any. Those
        in `busy` still have an outstanding plan writing their KV."""
        return []

    def can_plan_ahead(self, pending: StepPlan) -> bool:
        """May the next plan be made before `pending` commits? Planning ahead decides
        without the requests that arrive while `pending` runs; a policy that admits
        every step only delays those by one step, so the default is yes."""
        return True

    # ----- helpers for subclasses
    def _uncached(self, seq: Sequence) -> int:
        """Prefill tokens `seq` still has to compute (its cached prefix excluded)."""
        return seq.prefill_target - self.sched.prefill_start(seq)

    def _admitted_chunk(self, seq: Sequence, budget: PrefillBudget,
                        whole: bool = False) -> PrefillChunk:
        """The first chunk of a just admitted sequence, from its first uncached token: as
        much as its rank's budget has left (`whole`: all of it), charged to the budget."""
        start = seq.num_computed_tokens
        n = seq.prefill_target - start
        if not whole:
            n = min(n, budget.left(seq))
        budget.take(seq, n)
        return PrefillChunk(seq, start, start + n)

    def _whole_stack(self, chunks: list[PrefillChunk]) -> PrefillPart:
        return PrefillPart(tuple(chunks), self.sched.new_batch_id() if chunks else None)

    def _continue_partials(self, budget: PrefillBudget) -> list[PrefillChunk]:
        """Next chunks of admitted, partially prefilled sequences, in admission order,
        each within what its rank's budget has left (charged to it)."""
        chunks = []
        for seq in self.sched.prefilling:
            if not budget.any_left():
                break
            start = seq.num_computed_tokens
            n = min(seq.prefill_target - start, budget.left(seq))
            if n:
                chunks.append(PrefillChunk(seq, start, start + n))
                budget.take(seq, n)
        return chunks
