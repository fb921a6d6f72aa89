"""Iteration-level scheduler: one core, pluggable prefill policies.

The `Scheduler` core owns all bookkeeping: the waiting queue (ordered by priority, arrival,
id), KV-page admission, decode growth, recompute preemption, aborts and `commit`. A `Policy`
(policies/) only decides the prefill part of each plan: orca (whole prompts), chunked
(Sarathi-Serve), layered (the paper's layered prefill), flowprefill (preemptible prefill
under slack-aware EDF), or a user's own class.

Protocol: `plan = schedule(now)`, the executor runs it, `commit(plan, result, now)`. Plans
are committed in the order they were made, and at most two are outstanding (overlapped
scheduling: the engine plans and dispatches step k+1 while the device runs step k).
A plan's effects split in two. Those its tokens do not decide (prefill progress, a
finished prefill joining the decodes, the layered batch moving to its next group) are
applied by `_advance`: at the next `schedule()` if that comes first, else at commit.
Each sequence the plan samples for then ends in a `PENDING_TOKEN` placeholder, which
`commit` fills with the sampled token before applying stop conditions. A sequence whose
pending token may finish it by length is held out of the next plan; one that stops on a
stop token has one wasted decode in it, whose token commit drops. A sequence with a
grammar (structured outputs) is held out too: the bitmask of its next token needs the
pending one, so it decodes every other step while others keep the device busy.

Every admitted request holds the pages for its whole prefill target; a decode that needs a
page and finds none preempts from the tail of the running decodes (lowest priority, latest
arrival), possibly itself. Pages of a sequence that finishes or is aborted while a planned
step may still write its KV are freed only when that step (or layered batch) completes.

Data-parallel attention (`data_parallel_size` d > 1): a sequence's pages sit on one of d
ranks, chosen at admission (dp_placement.py), and every rank runs the same rows a step.
A policy with `rank_budgets` (orca, chunked, layered) fills `prefill_budget()`, which
gives each rank max_num_batched_tokens of its own (budget.py): the ranks prefill side by
side, and one rank's long prompt leaves the others' budgets alone. A waiting request is
placed among the ranks its chunk may take budget on; with none, admission stops, as it
does when no rank has the pages.

Prefix caching (`enable_prefix_caching`, block_manager.py): admission takes the cached
prefix of a request's prefill target by reference and sets its computed tokens there, so
its first chunk starts at the first uncached token and the policies' budgets, and the
layered G, count only uncached tokens. `_advance` publishes pages only when a plan that
ends the stack has written them (a prefill chunk's last group, a decode's token): a
layered or FlowPrefill batch part-way through its layers, paused or preempted, publishes
nothing. A plan dispatched later reads them after the device has written them: steps run
in dispatch order. The samples of a request with n > 1 are n sequences: the later ones
are `held` outside the queue until the first has prefilled (`add(prefill_after=...)`),
then take its prompt's full pages from the cache and compute only the rest.

Speculative decoding (`speculative_config`, lp_jax/spec): a decode whose last token is
known gets up to k n-gram drafts, k + 1 verification rows that the policies' budgets
count, and pages for them taken only from free ones (drafts never preempt). Its commit
appends the accepted drafts and the token after them, one at a time through the stop
rules, and frees the pages only rejected drafts wrote (`BlockManager.truncate`): their
positions are past the sequence's length, never published, and rewritten later. The
next draft needs the committed token, so a speculating sequence sits out a plan
scheduled before its commit, as a grammar's does.
"""

from __future__ import annotations

import bisect
from collections import Counter

from lp_jax.core.block_manager import BlockManager
from lp_jax.core.budget import PrefillBudget
from lp_jax.core.config import SchedulerConfig
from lp_jax.core.dp_placement import RankedBlockManager
from lp_jax.core.latency import LatencyModel, ModelDims
from lp_jax.core.plan import StepPlan, StepResult
from lp_jax.core.policies.base import Policy
from lp_jax.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from lp_jax.spec.auto import AutoK
from lp_jax.spec.ngram import propose_ngram

_STAT_KEYS = (
    "iterations iterations_decode iterations_prefill iterations_hybrid iterations_idle "
    "prefill_tokens decode_tokens prefill_batches preemptions finished aborted "
    "scheduling_rounds prefill_pauses prefill_resumes paused_prefills_preempted "
    "prefix_cache_queries prefix_cache_hits spec_decode_num_drafts "
    "spec_decode_num_draft_tokens spec_decode_num_accepted_tokens"
).split()



class Scheduler:
    def __init__(self, config: SchedulerConfig, latency: LatencyModel | None = None,
                 spec_auto: AutoK | None = None) -> None:
        self.config = config
        sc = config.speculative_config
        if sc is not None and sc.is_auto and spec_auto is None:
            raise ValueError('num_speculative_tokens "auto" needs a cost model (an AutoK: the '
                             "engine builds one from lp_jax/roofline/spec_pays.py)")
        # Chooses each plan's k under "auto" (lp_jax/spec/auto.py); None: k is fixed.
        self.spec_auto = spec_auto if sc is not None and sc.is_auto else None
        # What a step costs, as far as the policy knows (FlowPrefill's slack); refreshed
        # from measured steps through observe().
        self.latency = latency or LatencyModel(ModelDims(config.num_layers))
        d = config.data_parallel_size
        self.block_manager = BlockManager(
            config.num_pages, config.page_size, enable_caching=config.enable_prefix_caching,
        ) if d == 1 else RankedBlockManager(
            config.num_pages, config.page_size, d, max_seqs_per_rank=config.max_seqs_per_rank,
            enable_caching=config.enable_prefix_caching)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.prefilling: list[Sequence] = []  # admitted, prefill not complete
        self.running: list[Sequence] = []  # decoding
        self._zombies: list[Sequence] = []  # aborted, pages held until their step completes
        self._live: dict[int, Sequence] = {}
        # (leader, seq): seq, a later sample of the leader's prompt, joins `waiting` once
        # the leader has prefilled, so that it takes the prompt's pages from the cache.
        self.held: list[tuple[Sequence, Sequence]] = []
        self._eos = frozenset(t for t in (config.eos_token_id, *config.extra_eos_token_ids)
                              if t is not None)
        self._pending: list[StepPlan] = []  # scheduled, not committed; oldest first
        self._next_step = 0
        self._next_batch = 0
        self._now = 0.0
        self._stats: Counter[str] = Counter()
        # Sequence slots (Sequence.slot): one per admitted sequence, lowest first.
        self._free_seq_slots = list(range(config.max_num_seqs - 1, -1, -1))
        # The decodes of the plan being made and their drafts (prefill_budget).
        self._plan_decodes: tuple[list[Sequence], list[tuple[int, ...]]] = ([], [])
        self.policy: Policy = config.policy_class(self)

    # ----- requests -----
    def add(self, seq: Sequence, prefill_after: Sequence | None = None) -> None:
        """Queue a fresh request; raises ValueError, changing nothing, if it can never run.
        `prefill_after`: a request with the same prompt (an earlier sample of it; the
        engine checks the prompts match); with prefix caching, seq waits outside the queue
        until that one has prefilled."""
        cfg = self.config
        if not isinstance(seq, Sequence):
            raise ValueError(f"expected a Sequence, got {type(seq).__name__}")
        if isinstance(seq.seq_id, bool) or not isinstance(seq.seq_id, int):
            raise ValueError(f"seq_id must be an int, got {seq.seq_id!r}")
        if seq.seq_id in self._live or any(z.seq_id == seq.seq_id for z in self._zombies):
            raise ValueError(f"seq_id {seq.seq_id} is already in the scheduler")
        if isinstance(seq.priority, bool) or not isinstance(seq.priority, int):
            raise ValueError(f"priority must be an int, got {seq.priority!r}")
        if (
            seq.status is not SequenceStatus.WAITING
            or seq.num_output_tokens
            or seq.num_computed_tokens
            or seq.page_ids
        ):
            raise ValueError(f"seq {seq.seq_id} is not a fresh request: {seq}")
        n = seq.num_prompt_tokens
        if n == 0:
            raise ValueError(f"seq {seq.seq_id} has an empty prompt")
        if n > cfg.max_model_len:
            raise ValueError(
                f"seq {seq.seq_id}: prompt of {n} tokens > max_model_len {cfg.max_model_len}"
            )
        bad = [t for t in seq.token_ids if not _is_token(t, cfg.vocab_size)]
        if bad:
            raise ValueError(f"seq {seq.seq_id}: token ids {bad[:5]} outside [0, {cfg.vocab_size})")
        bad = [t for t in seq.sampling_params.stop_token_ids if t >= cfg.vocab_size]
        if bad:
            raise ValueError(
                f"seq {seq.seq_id}: stop_token_ids {bad} >= vocab_size {cfg.vocab_size}"
            )
        bad = [t for t, _ in seq.sampling_params.logit_bias if t >= cfg.vocab_size]
        if bad:
            raise ValueError(
                f"seq {seq.seq_id}: logit_bias ids {bad[:5]} >= vocab_size {cfg.vocab_size}"
            )
        # The most KV it can ever hold: every token but the last, with outputs cut at
        # max_model_len (a prompt of exactly max_model_len still yields one token).
        final = min(n + seq.sampling_params.max_tokens, max(cfg.max_model_len, n + 1))
        need = self.block_manager.pages_for(final - 1)
        room = cfg.num_pages // cfg.data_parallel_size  # a sequence's pages are on one rank
        if need > room:
            pool = "the pool" if room == cfg.num_pages else "a data-parallel rank's pool"
            raise ValueError(
                f"seq {seq.seq_id} may need {need} KV pages ({final - 1} tokens), "
                f"{pool} has only {room}"
            )
        self._live[seq.seq_id] = seq
        leader = prefill_after
        if (leader is not None and self.block_manager.enable_caching
                and not self._prefilled(leader)):
            self.held.append((leader, seq))
            return
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_key)
        self.policy.notify("arrival", seq)

    @staticmethod
    def _prefilled(seq: Sequence) -> bool:
        """Its prompt's pages are published (or never will be)."""
        return seq.is_finished or seq.num_output_tokens > 0

    def _release_held(self) -> None:
        """Queues the held samples whose leader has prefilled."""
        ready = [(lead, s) for lead, s in self.held if self._prefilled(lead)]
        for pair in ready:
            self.held.remove(pair)
            self._enqueue(pair[1])

    def abort(self, seq_id: int, now: float | None = None) -> Sequence | None:
        """Finish a request as aborted; None if it is unknown or already finished."""
        seq = self._live.pop(seq_id, None)
        if seq is None:
            return None
        was_held = any(s is seq for _, s in self.held)
        self.held = [(lead, s) for lead, s in self.held if s is not seq]
        for queue in (self.waiting, self.running, self.prefilling):
            if seq in queue:
                queue.remove(seq)
                break
        if not was_held:  # the policy never saw a held sample arrive
            self.policy.notify("abort", seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        seq.finish_time = now
        self._free_slot(seq)
        if seq.num_pending_tokens:  # its token is dropped at commit
            del seq.token_ids[-1]
            seq.num_pending_tokens = 0
        self._release(seq)
        self._stats["aborted"] += 1
        return seq

    def get(self, seq_id: int) -> Sequence | None:
        """The live (unfinished) sequence with this id, or None."""
        return self._live.get(seq_id)

    def has_unfinished(self) -> bool:
        """True while any request is live or any page is still held for an aborted one."""
        return bool(self._live or self._zombies)

    def stats(self) -> dict[str, int]:
        """Counters: iterations (per phase too), tokens, batches, preemptions, finishes;
        prefix_cache_queries / _hits: tokens looked up in the cache at admissions and
        found there; prefill_tokens counts only the tokens computed; then any counter a
        policy added through `count`."""
        return {k: self._stats[k] for k in (*_STAT_KEYS, *sorted(self._stats.keys()
                                                                 - set(_STAT_KEYS)))}

    # ----- what a policy sees (policies/base.py lists it)
    @property
    def now(self) -> float:
        """The time the current plan is made at (schedule's `now`)."""
        return self._now

    @property
    def next_step_id(self) -> int:
        """The step id of the plan being made (of the next one, between plans)."""
        return self._next_step

    @property
    def outstanding_plans(self) -> tuple[StepPlan, ...]:
        """Plans scheduled and not yet committed (still on the device), oldest first;
        the plan being made is not among them."""
        return tuple(self._pending)

    def max_decode_rows(self, seq: Sequence) -> int:
        """Rows a decode of seq may run: 1, or 1 + k verification rows when it speculates."""
        sc = self.config.speculative_config
        return 1 + sc.max_tokens if self._speculates(seq) else 1

    def count(self, name: str, n: int = 1) -> None:
        """Adds n to the counter `name` of stats()."""
        self._stats[name] += n

    # ----- one iteration -----
    def can_plan_ahead(self) -> bool:
        """Whether schedule() may run now, before the outstanding plan commits, without
        changing what the policy would decide (see Policy.can_plan_ahead)."""
        if not self._pending:
            return True
        return len(self._pending) == 1 and self.policy.can_plan_ahead(self._pending[0])

    def schedule(self, now: float) -> StepPlan:
        held: set[int] = set()
        if self._pending:
            if len(self._pending) > 1:
                raise RuntimeError(f"commit plan {self._pending[0].step_id} before scheduling "
                                   "another (at most two plans are outstanding)")
            held = self._advance(self._pending[0])
        if self.held:
            self._release_held()
        self._now = now
        decode, preempted = (self._schedule_decodes(held) if self.policy.decodes_now()
                             else ([], []))
        drafts = self._draft(decode)
        self._plan_decodes = (decode, drafts)
        # After a preemption, admit nothing this iteration unless nothing else would run.
        part = self.policy.schedule_prefill(len(decode) + sum(map(len, drafts)),
                                            admit=not (preempted and decode))
        if any(drafts):
            self._fit_drafts(decode, drafts, part)
        plan = StepPlan(
            step_id=self._next_step,
            num_layers=self.config.num_layers,
            decode=tuple(decode),
            prefill=part.chunks,
            prefill_batch_id=part.batch_id,
            group_index=part.group_index,
            num_groups=part.num_groups,
            unit_start=part.unit_start,
            unit_end=part.unit_end,
            prefill_rows=part.rows,
            drafts=drafts if any(drafts) else (),
        )
        self._next_step += 1
        self._pending.append(plan)
        return plan

    def commit(self, plan: StepPlan, result: StepResult, now: float) -> list[Sequence]:
        """Apply what the executor returned for `plan` (its sampled tokens, and the
        log-probabilities asked for) to the sequences; returns those that finished. The
        only place a step's results enter the sequences."""
        if not self._pending or plan is not self._pending[0]:
            raise RuntimeError("commit expects the oldest plan schedule() returned")
        if not isinstance(result, StepResult):
            raise TypeError(f"commit takes a StepResult, got {type(result).__name__}")
        sampled = result.tokens
        expect = {s.seq_id: s for s in plan.sampling_seqs}
        extra = (set(sampled) | set(result.logprobs) | set(result.accepted)) - set(expect)
        if extra:
            raise ValueError(f"tokens for seqs {sorted(extra)} that do not sample in this plan")
        drafts = plan.drafts_by_seq
        scored = {c.seq.seq_id: c.seq for c in plan.prefill}
        for sid, pos, lp in result.prompt_logprobs:
            seq = scored.get(sid)
            if seq is None or seq.prompt_logprobs is None or not 0 < pos < seq.num_prompt_tokens:
                raise ValueError(f"prompt log-probabilities for seq {sid} at {pos}: not a "
                                 "position this plan scores")
            seq.prompt_logprobs[pos] = lp
        for sid, seq in expect.items():
            if seq.is_finished:
                continue  # aborted after schedule(); its token, if any, is dropped
            tok = sampled.get(sid)
            if tok is None:
                raise ValueError(f"no sampled token for seq {sid}")
            if not _is_token(tok, self.config.vocab_size):
                raise ValueError(
                    f"seq {sid}: sampled token {tok!r} outside [0, {self.config.vocab_size})"
                )
            acc = tuple(result.accepted.get(sid, ()))
            if acc != drafts.get(sid, ())[:len(acc)]:
                raise ValueError(f"seq {sid}: accepted {acc} is not a prefix of its drafts")
        if len(self._pending) == 1:  # else the newer plan's schedule() advanced it
            self._advance(plan)
        self._pending.pop(0)
        finished: list[Sequence] = []
        for seq in plan.sampling_seqs:
            if not seq.is_finished:
                self._append_run(result, seq, drafts.get(seq.seq_id, ()), now, finished)
        if plan.is_last_group:
            self._stats["prefill_tokens"] += plan.num_prefill_tokens
            self._stats["prefill_batches"] += bool(plan.prefill)
        busy = self._busy_ids()
        for seq in [z for z in self._zombies if z.seq_id not in busy]:
            self._zombies.remove(seq)
            self.block_manager.free(seq)
            self.policy.notify("free", seq)  # its pages may admit a waiting request
        self._stats["iterations"] += 1
        self._stats[f"iterations_{plan.phase}"] += 1
        self._stats["decode_tokens"] += plan.num_decode_tokens
        return finished

    def observe(self, plan: StepPlan, seconds: float, experts: float | None = None) -> None:
        """The executor's measured time for a committed plan (and the experts it
        activated, if counted): refreshes the latency model online."""
        self.latency.observe(plan, seconds, experts)

    # ----- helpers shared by the policies -----
    def prefill_budget(self) -> PrefillBudget:
        """The prefill tokens the plan being made may take (budget.py):
        max_num_batched_tokens, less the plan's decode rows for a policy whose decodes
        count against it; under rank budgets (`config.rank_budgets`) that on each data
        rank, less the rank's own decode rows."""
        cfg, bm = self.config, self.block_manager
        ranks = cfg.data_parallel_size if cfg.rank_budgets else 1
        left_R = [cfg.max_num_batched_tokens] * ranks
        if self.policy.decodes_in_budget:
            for seq, d in zip(*self._plan_decodes, strict=True):
                left_R[bm.rank_of(seq) if ranks > 1 else 0] -= 1 + len(d)
        if ranks == 1:
            return PrefillBudget(left_R, lambda seq: 0,
                                 lambda seq, r: seq.prefill_target - self.prefill_start(seq))
        return PrefillBudget(left_R, bm.rank_of, lambda seq, r: seq.prefill_target - bm.cached_on(
            seq, seq.prefill_target, r))

    def admit_head(self, ranks: tuple[int, ...] | None = None) -> Sequence | None:
        """Admit the head of the waiting queue if a sequence slot and its pages are free
        (on one of `ranks`: see admit)."""
        return self.admit(self.waiting[0], ranks) if self.waiting else None

    def admit(self, seq: Sequence, ranks: tuple[int, ...] | None = None) -> Sequence | None:
        """Admit a waiting sequence if a sequence slot and its pages are free; its cached
        prefix counts as computed, so its prefill starts after it. `ranks`: the budget's
        ranks with room for it (PrefillBudget.ranks): under rank budgets the data ranks
        it may be placed on; with one budget, (0,) or none; None: any."""
        if ranks is not None and not ranks:
            return None
        if len(self.running) + len(self.prefilling) >= self.config.max_num_seqs:
            return None
        bm = self.block_manager
        # One budget for every rank (its one count is "rank 0"): placement is free.
        where = {"ranks": ranks} if ranks is not None and self.config.rank_budgets else {}
        if seq.num_pending_tokens or not bm.can_allocate(seq, seq.prefill_target, **where):
            return None
        self.waiting.remove(seq)
        cached = bm.allocate(seq, seq.prefill_target, **where)
        seq.num_computed_tokens = cached
        if bm.enable_caching and seq.reads_prefix_cache:
            self._stats["prefix_cache_queries"] += seq.prefill_target
            self._stats["prefix_cache_hits"] += cached
        seq.status = SequenceStatus.RUNNING
        seq.slot = self._free_seq_slots.pop()
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self._now
            seq.num_cached_tokens = cached
        self.prefilling.append(seq)
        return seq

    def prefill_start(self, seq: Sequence) -> int:
        """Where seq's next prefill chunk starts: its computed tokens once admitted; for a
        waiting sequence, the cached prefix an admission now would take."""
        if seq.status is SequenceStatus.WAITING:
            return self.block_manager.cached_prefix(seq, seq.prefill_target)
        return seq.num_computed_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page; only while no request holds a page (as vLLM)."""
        return self.block_manager.reset_prefix_cache()

    def new_batch_id(self) -> int:
        self._next_batch += 1
        return self._next_batch - 1

    # ----- internals -----
    def _advance(self, plan: StepPlan) -> set[int]:
        """Applies what `plan` does regardless of its tokens, once, before its commit.

        Decodes now hold KV for all their tokens; a last-group plan's chunks are
        prefilled, and the sequences whose prompt they finish join the decodes; the
        full pages either wrote are published to the prefix cache; the policy moves on.
        Every sequence the plan samples for gets a placeholder for the token. Returns the
        ids of those the token may finish by length, and of those with a grammar (their
        next mask needs the token): they sit out a plan scheduled before the commit.
        """
        sampling = []
        publish = self.block_manager.publish  # the plan's KV is in every layer now
        for seq in plan.decode:
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens
                publish(seq, seq.num_tokens)
                sampling.append(seq)
        if plan.is_last_group:
            for chunk in plan.prefill:
                seq = chunk.seq
                if seq.is_finished:
                    continue
                seq.num_computed_tokens = chunk.end
                publish(seq, chunk.end)
                if chunk.samples:
                    self.prefilling.remove(seq)
                    self.running.append(seq)
                    sampling.append(seq)
        self.policy.on_advance(plan)
        held = set()
        for seq in sampling:
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending_tokens = 1
            if (seq.num_output_tokens >= seq.sampling_params.max_tokens
                    or seq.num_tokens >= self.config.max_model_len
                    or seq.sampling_params.structured_outputs is not None
                    or (self._speculates(seq) and self._drafting())):
                held.add(seq.seq_id)
        return held

    def _speculates(self, seq: Sequence) -> bool:
        """Whether seq's decodes get drafts: every decode, when the engine speculates. The
        step verifies a draft by sampling its row like any other (lp_jax/spec/accept.py),
        under the grammar's mask and the penalty counts after the drafts before it."""
        return self.config.speculative_config is not None

    def _drafting(self) -> bool:
        """Whether the next plan may draft: always with a fixed k; under "auto" while the
        last plan chose k > 0, so with speculation off decodes overlap as without it."""
        return self.spec_auto is None or self.spec_auto.last_k > 0

    def _fit_drafts(self, decode: list[Sequence], drafts: list[tuple[int, ...]],
                    part) -> None:
        """Drops drafts, last decodes first, until the plan samples at most max_num_seqs
        rows (decodes, their drafts, prompts it completes): the step's sampled rows and
        its carried decode rows are max_num_seqs long, so verification rows fit the
        programs there are and add none. Their pages go back."""
        done = (sum(c.samples for c in part.chunks)
                if part.unit_end in (None, 2 * self.config.num_layers) else 0)
        over = len(decode) + sum(map(len, drafts)) + done - self.config.max_num_seqs
        for i in range(len(decode) - 1, -1, -1):
            if over <= 0:
                break
            if drafts[i]:
                cut = min(over, len(drafts[i]))
                drafts[i] = drafts[i][:len(drafts[i]) - cut]
                over -= cut
                self.block_manager.truncate(decode[i], len(drafts[i]))

    def _draft(self, decode: list[Sequence]) -> list[tuple[int, ...]]:
        """Each decode's drafts: up to k n-gram tokens, or the k an EAGLE-3 head
        proposed in the step that made its last token (`Sequence.draft_tokens`), fewer
        where max_tokens or max_model_len leaves room for less, none where their pages
        are not free."""
        sc = self.config.speculative_config
        k_plan = sc.num_speculative_tokens if sc is not None else 0
        if self.spec_auto is not None:
            k_plan = self.spec_auto.choose(len(decode), self.config.max_num_seqs)
        out = []
        for seq in decode:
            d: list[int] = []
            if self._speculates(seq) and not seq.num_pending_tokens:
                k = min(k_plan,
                        seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                        self.config.max_model_len - seq.num_tokens - 1)
                if k > 0 and sc.drafts_on_device:  # the last step proposed them
                    d = list(seq.draft_tokens[:k])
                elif k > 0:
                    d = propose_ngram(seq.token_ids, k, sc.prompt_lookup_min,
                                      sc.prompt_lookup_max)
                if d and self.block_manager.can_append(seq, len(d)):
                    self.block_manager.append_slot(seq, len(d))
                else:
                    d = []
            out.append(tuple(d))
        return out

    def _schedule_decodes(self, held: set[int]) -> tuple[list[Sequence], list[Sequence]]:
        """Give every running decode not `held` room for one more token, preempting from
        the tail."""
        queue = sorted((s for s in self.running if s.seq_id not in held), key=_key)
        decode: list[Sequence] = []
        preempted: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_append(seq):
                paused = self.policy.release_paused(self._busy_ids())
                if paused:  # a paused prefill goes first: it is not running
                    for victim in paused:
                        self._preempt(victim)
                    preempted += paused
                    continue
                victim = self._victim(queue, seq)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                decode.append(seq)
        return decode, preempted

    def _victim(self, queue: list[Sequence], seq: Sequence) -> Sequence:
        """Pops the decode to preempt for seq's page: the queue's tail, or under
        data-parallel attention the tail among the sequences on seq's rank (another rank's
        pages would not help); seq itself when there is none."""
        same_rank = getattr(self.block_manager, "same_rank", None)
        for j in range(len(queue) - 1, -1, -1):
            if same_rank is None or same_rank(queue[j], seq):
                return queue.pop(j)
        return seq

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style: drop the KV, keep the outputs, prefill everything again later."""
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.block_manager.free(seq)
        self._free_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.draft_tokens = ()
        seq.prefill_target = seq.num_tokens
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_key)
        self._stats["preemptions"] += 1
        self.policy.notify("preempt", seq)

    def _append_run(self, result: StepResult, seq: Sequence, drafts: tuple[int, ...],
                    now: float, finished: list[Sequence]) -> None:
        """Appends seq's accepted drafts and its sampled token, each through the stop
        rules (the rest is dropped once one stops it), then gives back the pages only
        rejected `drafts` wrote, and counts them."""
        sid = seq.seq_id
        seq.draft_tokens = result.next_drafts.get(sid, ())
        accepted = tuple(result.accepted.get(sid, ()))
        lps = (*result.accepted_logprobs.get(sid, ()), result.logprobs.get(sid))
        for i, tok in enumerate((*accepted, result.tokens[sid])):
            if i:  # the next token's placeholder
                seq.token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens = 1
                seq.num_computed_tokens += 1  # the accepted draft's KV was written
            if i < len(lps) and lps[i] is not None and seq.logprobs is not None:
                seq.logprobs.append(lps[i])
            self._append_token(seq, tok, now, finished)
            if seq.is_finished:
                break
        if drafts:
            if not seq.is_finished:
                self.block_manager.truncate(seq)
            self._stats["spec_decode_num_drafts"] += 1
            self._stats["spec_decode_num_draft_tokens"] += len(drafts)
            self._stats["spec_decode_num_accepted_tokens"] += len(accepted)
            if self.spec_auto is not None:
                self.spec_auto.observe(len(drafts), len(accepted))
            for i in range(len(accepted)):
                self._stats[f"spec_decode_num_accepted_tokens_pos_{i}"] += 1

    def _append_token(self, seq: Sequence, tok: int, now: float, finished: list[Sequence]) -> None:
        """Fills the placeholder `_advance` left for the token, then applies stop rules."""
        seq.token_ids[-1] = tok
        seq.num_pending_tokens = 0
        seq.token_times.append(now)
        sp = seq.sampling_params
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self._eos):
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        else:
            return
        # A preempted decode whose token arrives after its preemption waits in `waiting`.
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = status
        seq.finish_time = now
        self._free_slot(seq)
        self._release(seq)
        del self._live[seq.seq_id]
        self._stats["finished"] += 1
        finished.append(seq)
        self.policy.notify("finish", seq)

    def _free_slot(self, seq: Sequence) -> None:
        """Gives back an admitted sequence's slot. A dispatched step may still write its
        state there; the next owner's first step resets it after that, in device order."""
        if seq.slot is not None:
            self._free_seq_slots.append(seq.slot)
            seq.slot = None

    def _release(self, seq: Sequence) -> None:
        """Free a finished sequence's pages, or hold them while a planned step writes them."""
        if not seq.page_ids:
            return
        if seq.seq_id in self._busy_ids():
            self._zombies.append(seq)
        else:
            self.block_manager.free(seq)

    def _busy_ids(self) -> set[int]:
        """Sequences whose KV a planned, uncommitted step may still be writing."""
        ids = {s.seq_id for s in self.policy.in_flight()}
        for plan in self._pending:
            ids.update(s.seq_id for s in plan.decode)
            ids.update(c.seq.seq_id for c in plan.prefill)
        return ids


def _key(seq: Sequence) -> tuple[int, float, int]:
    return seq.sort_key


def _is_token(t: object, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
