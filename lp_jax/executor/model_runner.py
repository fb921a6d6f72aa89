"""The executor: turns a `StepPlan` into calls of the compiled step (step.py).

For a plan whose prefill chunks run through layers [a, b):

    call 1 (a > 0)  decode rows            units [0, 2a)    embed -> hidden_RD[decode]
    call 2          decode + prefill rows  units [2a, 2b)   the designated group: its
                                                            experts are read once for both
    call 3 (b < L)  decode rows            units [2b, 2L)   -> logits, sampling

Prefill rows enter call 2 embedded (a == 0) or from the carried hidden states of the
batch's previous group, and leave it into the carried buffer (b < L) or to sampling
(b == L). Orca and chunked plans are the case a = 0, b = L: one call. A decode-only plan
is one call of its decode rows through every layer.

Every call is one program of the family in step.py, chosen by its row count alone (under
data-parallel attention the rows of its fullest rank: `_rank_layout` places each
sequence's rows in its rank's slice, with rank-local page ids), so
the engine compiles one program per row bucket (`core.programs.step_buckets`): the count grows
with log(budget), not with the layer count, the group sizes, G, or a product of prefill
and decode buckets. `warmup()` compiles them all; the persistent compilation cache makes
restarts cheap. The KV pool and the hidden buffer are donated to every call.

`dispatch(plan, prev)` launches a step's calls without waiting and returns a
`StepHandle`; `handle.collect()` waits for it and returns the step's `StepResult`, which
the scheduler's `commit` alone applies to the sequences. Every program returns sampled tokens
in one fixed-size array; a decode whose last token is still a placeholder (its step was
planned before the step sampling that token was committed; see scheduler.py) reads it on
device from `prev`'s array, so step k+1 is planned and dispatched while step k runs.

A speculating decode (`plan.drafts`, lp_jax/spec) runs k + 1 rows, its last token and
its drafts, as one ragged sequence (the call is then not `decode_only`), and every row
is sampled; `collect` keeps the drafts that match the samples (spec/accept.py). The
scheduler keeps a plan's sampled rows within max_num_seqs, so these rows fit the same
programs and the decode rows of the hidden buffer.

Sampling options are per-row inputs of the same programs (`_fill_sampling`). Penalties
read token counts kept on device (step.py `counts`), one row per sequence slot: the
scheduler gives each admitted sequence a slot (`Sequence.slot`), which the plan carries,
and a penalized sequence's first chunk (position 0) resets its row. A verification
row's penalties count the drafts before it, and only committed tokens are counted
(step.py). The runner keeps no per-sequence state of its own. Log-probabilities are
always outputs of a sampling call, copied to the host only for steps where a row asked.
Prompt log-probabilities come from the call where a chunk's rows leave the last layer: each row
scores the next prompt token (`_score_targets`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lp_jax.core.plan import StepPlan, StepResult
from lp_jax.core.programs import bucket_for
from lp_jax.executor.plan_channel import StepCodec, host_array
from lp_jax.executor.step import (
    MAX_EOS_TOKEN_IDS,
    StepSpec,
    compiler_options,
    counts_sharding,
    empty_inputs,
    init_counts,
    make_step,
)
from lp_jax.models.backends import KernelBackends
from lp_jax.models.eagle3 import Eagle3Params
from lp_jax.models.kv_cache import init_kv_cache, kv_cache_axes, kv_cache_shape, packs_kv
from lp_jax.models.metadata import (
    build_decode_metadata,
    build_metadata,
    build_ranked_metadata,
)
from lp_jax.models.stacked import StackedCausalLM
from lp_jax.progress import Progress
from lp_jax.sharding import kv_head_replicas, named_sharding, replicated
from lp_jax.spec.accept import accept_sampled


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepHandle:
    """A dispatched step: its plan, the device arrays it will fill, and where each
    sampling sequence's token sits in `tokens_R`. `collect()` waits for them and returns
    the step's `StepResult`."""

    plan: StepPlan
    tokens_R: jax.Array | None
    counts: list  # experts activated, per call (device scalars)
    prefill_call: int | None  # the call that ran the prefill group (None without prefill)
    rows: dict[int, int]  # seq_id -> row of tokens_R (a speculating one's first row)
    dispatched_at: float  # perf_counter when its calls were launched
    step_id: int  # the runner's count of dispatched steps (the plan channel's id)
    # (logprob_R, top_logprob_RK, top_id_RK) device arrays and {seq_id: top count} when a
    # sampling row asked for log-probabilities; else None
    logprobs: tuple | None = None
    wants_logprobs: dict[int, int] | None = None
    # Prompt scoring: (prompt_logprob_N, prompt_top_logprob_NK, prompt_top_id_NK) of the
    # call that scored, and (seq, first scored position, first row, rows) per chunk.
    prompt_scores: tuple | None = None
    scored: list | None = None
    channel: object = None  # a multi-process leader's channel: it records the tokens
    # seq_id -> the drafts its rows after rows[seq_id] verify (speculating decodes only)
    drafts: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # An EAGLE-3 head's proposals: [R, k] device array (-1: none) and seq_id -> its row
    next_drafts_RK: jax.Array | None = None
    next_draft_rows: dict[int, int] = dataclasses.field(default_factory=dict)

    def collect(self) -> StepResult:
        """Waits for the step; its tokens, log-probabilities and expert counts. A
        speculating decode keeps its drafts while each equals the token sampled at the
        row before it, and then gets that row's token (lp_jax/spec/accept.py)."""
        tokens, tokens_R, accepted = {}, None, {}
        if self.tokens_R is not None:
            tokens_R = host_array(self.tokens_R)
            tokens = {sid: int(tokens_R[r]) for sid, r in self.rows.items()}
            for sid, d in self.drafts.items():
                r = self.rows[sid]
                a, tokens[sid] = accept_sampled(d, tokens_R[r : r + len(d) + 1].tolist())
                if a:
                    accepted[sid] = d[:a]
        drafts_RK = None if self.next_drafts_RK is None else host_array(self.next_drafts_RK)
        if self.channel is not None:
            self.channel.record_tokens(self.step_id, tokens_R, drafts_RK)
        lps, accepted_lps = self._logprobs(tokens, accepted)
        next_drafts = {}
        if drafts_RK is not None:
            for sid, b in self.next_draft_rows.items():
                row = drafts_RK[b].tolist()
                next_drafts[sid] = tuple(row[: row.index(-1)] if -1 in row else row)
        return StepResult(
            tokens=tokens, logprobs=lps, accepted=accepted, accepted_logprobs=accepted_lps,
            next_drafts=next_drafts,
            prompt_logprobs=self._prompt_logprobs(),
            experts_activated=tuple(int(host_array(c)) for c in self.counts),
            prefill_call=self.prefill_call, dispatched_at=self.dispatched_at,
            collected_at=time.perf_counter())

    def _logprobs(self, tokens: dict[int, int], accepted: dict[int, tuple[int, ...]]):
        """({seq_id: {token_id: logprob}}, {seq_id: one such dict per accepted draft})
        for the rows that asked: the token first, then the top `logprobs` alternatives,
        as vLLM's per-token dicts."""
        if self.logprobs is None:
            return {}, {}
        chosen_R, top_RK, ids_RK = (host_array(x) for x in self.logprobs)

        def at(r, tok, k):
            d = {tok: float(chosen_R[r])}
            for t, v in zip(ids_RK[r, :k].tolist(), top_RK[r, :k].tolist(), strict=True):
                d.setdefault(t, v)
            return d

        out, drafts = {}, {}
        for sid, k in self.wants_logprobs.items():
            r, acc = self.rows[sid], accepted.get(sid, ())
            out[sid] = at(r + len(acc), tokens[sid], k)
            if acc:
                drafts[sid] = tuple(at(r + j, t, k) for j, t in enumerate(acc))
        return out, drafts

    def _prompt_logprobs(self) -> tuple:
        """(seq_id, position, {token_id: logprob}) for each prompt position the step
        scored: that prompt token's log-probability given the tokens before it, then the
        top `prompt_logprobs` alternatives."""
        if self.prompt_scores is None:
            return ()
        chosen_N, top_NK, ids_NK = (host_array(x) for x in self.prompt_scores)
        out = []
        for seq, pos, row, n in self.scored:
            k = seq.sampling_params.prompt_logprobs
            for j in range(n):
                r, p = row + j, pos + j
                d = {seq.token_ids[p]: float(chosen_N[r])}
                for t, v in zip(ids_NK[r, :k].tolist(), top_NK[r, :k].tolist(), strict=True):
                    d.setdefault(t, v)
                out.append((seq.seq_id, p, d))
        return tuple(out)


@dataclasses.dataclass
class _Call:
    """One call's real rows, before padding to a bucket."""

    units: tuple[int, int]
    seqs: list  # (first position, new tokens, page ids) per sequence, row order
    tokens: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    prev_rows: np.ndarray
    decode_only: bool
    sample_rows: list[int] = dataclasses.field(default_factory=list)
    sampling: list = dataclasses.field(default_factory=list)  # (seq, position) per row
    count_reset: list = dataclasses.field(default_factory=list)  # count slots to zero
    count_slot: np.ndarray | None = None  # per row: count slot of its token, or -1
    count_output: np.ndarray | None = None  # per row: an output (not prompt) token
    score_target: np.ndarray | None = None  # per row: the prompt token it scores, or -1
    scored: list = dataclasses.field(default_factory=list)  # (seq, position, row, rows)
    objs: list = dataclasses.field(default_factory=list)  # the Sequence of each of `seqs`
    check: list = dataclasses.field(default_factory=list)  # per sampled row: next draft, -1
    draft_slots: list = dataclasses.field(default_factory=list)  # per seq: its draft slot


class ModelRunner:
    def __init__(self, model: StackedCausalLM, *, mesh, num_pages: int, page_size: int,
                 max_model_len: int, max_num_seqs: int, token_buckets: tuple[int, ...],
                 hidden_rows: int, backends: KernelBackends, seed: int = 0, channel=None,
                 draft=None, hidden_split: bool = False):
        """`token_buckets` and `hidden_rows`: the program family the scheduler config
        needs (lp_jax/core/programs.py). `channel`: a multi-process leader's
        LeaderChannel (plan_channel.py), which every dispatched step goes through.
        `draft`: (config, params, k) of a draft model whose k drafts every step proposes
        (`StepResult.next_drafts`): an EAGLE-3 head (Eagle3Config, Eagle3Params) or an MTP
        layer (MtpConfig, MtpParams). Its KV is a one-layer pool on the same logical
        pages; an EAGLE-3 head's aux states are a buffer beside the hidden one.
        `hidden_split`: under data-parallel attention, hidden_rows are one rank's, and the
        buffer holds a block of them on each rank (StepSpec.hidden_split)."""
        cfg = self.cfg = model.config
        if len(cfg.eos_token_ids) > MAX_EOS_TOKEN_IDS:
            raise ValueError(f"the model lists {len(cfg.eos_token_ids)} eos token ids; "
                             f"min_tokens' masks hold at most {MAX_EOS_TOKEN_IDS}")
        self.dtype = model.dtype
        self.L = cfg.num_hidden_layers
        self.seed = seed
        if hidden_rows < max_num_seqs:
            raise ValueError(f"hidden_rows {hidden_rows} < max_num_seqs {max_num_seqs}")
        self.spec = StepSpec(
            num_layers=self.L, hidden_size=cfg.hidden_size, page_size=page_size,
            pages_per_seq=math.ceil(max_model_len / page_size), max_num_seqs=max_num_seqs,
            hidden_rows=hidden_rows,
            buckets=tuple(token_buckets), vocab_size=cfg.vocab_size,
            draft_k=draft[2] if draft else 0, data_ranks=cfg.kv_ranks,
            hidden_split=hidden_split and cfg.kv_ranks > 1)
        self.num_pages = num_pages
        self.graphdef, self.state = nnx.split(model)
        backends = model.serving_backends(backends)
        packed = packs_kv(cfg, backends.attention)
        replicas = kv_head_replicas(cfg.num_key_value_heads, cfg.num_attention_heads, mesh)
        kv_shape = kv_cache_shape(cfg, num_pages, page_size, packed=packed, replicas=replicas)
        self.kv_pages = init_kv_cache(cfg, num_pages, page_size, model.dtype, packed=packed,
                                      replicas=replicas,
                                      sharding=named_sharding(kv_cache_axes(cfg), kv_shape, mesh))
        self._replicated = replicated(mesh)
        self._hidden_sharding = (NamedSharding(mesh, PartitionSpec("data"))
                                 if self.spec.hidden_split else self._replicated)
        self.hidden_RD = jax.device_put(
            np.zeros((self.spec.hidden_buffer_rows, cfg.hidden_size), model.dtype),
            self._hidden_sharding)
        self._no_prev_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32), self._replicated)
        on_vocab = counts_sharding(self.spec, cfg.vocab_size, mesh)
        self.counts = jax.device_put(init_counts(self.spec, cfg.vocab_size), on_vocab)
        self.draft_params = self.draft_state = None
        if draft:
            one = cfg.replace(num_hidden_layers=1, layer_types=(), kv_scales=())
            kv_1 = kv_cache_shape(one, num_pages, page_size, packed=packed, replicas=replicas)
            self.draft_params = draft[1]  # an MTP layer's: placed by the loader
            if isinstance(draft[1], Eagle3Params):  # the target's table stays where it is
                embed = draft[1].embed_VE
                self.draft_params = dataclasses.replace(jax.device_put(
                    dataclasses.replace(draft[1], embed_VE=None), self._replicated),
                    embed_VE=embed)
            self.draft_state = {
                "kv": init_kv_cache(one, num_pages, page_size,
                                    model.dtype, packed=packed, replicas=replicas,
                                    sharding=named_sharding(kv_cache_axes(one), kv_1, mesh))}
            if draft[0].aux_layer_ids:  # an EAGLE-3 head's aux states of carried rows
                self.draft_state["aux_RAD"] = jax.device_put(  # rows as the hidden buffer's
                    np.zeros((self.spec.hidden_buffer_rows, 3, cfg.hidden_size), model.dtype),
                    self._hidden_sharding)
        self._step = jax.jit(make_step(self.graphdef, self.spec, backends,
                                       replicated=self._replicated, counts_sharding=on_vocab,
                                       draft=draft[0] if draft else None),
                             donate_argnums=(1, 2, 4, 6) if draft else (1, 2, 4))
        self.programs: dict[int, jax.stages.Compiled] = {}
        # The engine's StructuredOutputs (lp_jax/structured), which fills the bitmask rows
        # of constrained samples; None: no request may carry a grammar.
        self.structured = None
        # The all-ones bitmask of each call size's B sampled rows, on device before serving
        # (a transfer while serving would count as a compile on a multi-process mesh).
        self._all_ones = {B: jax.device_put(np.full((B, self.spec.mask_words), -1, np.int32),
                                            self._replicated)
                          for B in {self.spec.seqs_for(N) for N in self.spec.buckets}}
        self.channel = channel
        self.codec = StepCodec(self.spec)
        self._step_ids = itertools.count()
        self.compile_seconds = 0.0
        # Padding, in row-layers: rows computed vs real rows, over all calls.
        self.row_layers = {"useful": 0.0, "padded": 0.0, "max_step_ratio": 1.0}

    def memory(self) -> dict[str, int]:
        """Bytes of the weights, the KV pool and the carried-hidden buffer (all devices);
        a draft model's weights and state, less the target's arrays it shares."""
        def nbytes(tree, but=()) -> int:
            return sum(x.nbytes for x in jax.tree.leaves(tree) if id(x) not in but)

        shared = {id(x) for x in jax.tree.leaves(self.state)}
        return {"weights": nbytes(self.state), "kv": nbytes(self.kv_pages),
                "hidden": nbytes(self.hidden_RD),
                **({"draft": nbytes(self.draft_params, shared) + nbytes(self.draft_state)}
                   if self.draft_state else {})}

    # ------------------------------------------------------------ programs
    def warmup(self, log=print):
        """Compiles every program, several at a time: XLA compiles outside the GIL, so
        start-up scales with the host's cores."""
        t0 = time.perf_counter()
        todo = [N for N in self.spec.buckets if N not in self.programs]
        progress, done = Progress(len(todo), "programs", log), {}
        try:
            with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
                futures = {pool.submit(self._compile, N): N for N in todo}
                for fut in as_completed(futures):
                    done[futures[fut]] = fut.result()
                    progress.advance()
        finally:
            progress.close()
        self.programs.update((N, done[N]) for N in todo)  # in bucket order
        self.compile_seconds += time.perf_counter() - t0
        if log:
            log(f"compiled {len(self.spec.buckets)} programs (row buckets "
                f"{list(self.spec.buckets)}) in {time.perf_counter() - t0:.1f} s")

    def _compile(self, N: int) -> jax.stages.Compiled:
        platform = self._replicated.mesh.devices.flat[0].platform
        draft = (self.draft_params, self.draft_state) if self.draft_state else ()
        return self._step.lower(self.state, self.kv_pages, self.hidden_RD,
                                empty_inputs(self.spec, N), self.counts, *draft).compile(
            compiler_options=compiler_options(platform))

    def _program(self, N: int):
        prog = self.programs.get(N)
        if prog is None:  # only without warm-up: the engine counts it as a serving compile
            t0 = time.perf_counter()
            prog = self.programs[N] = self._compile(N)
            self.compile_seconds += time.perf_counter() - t0
        return prog

    # ------------------------------------------------------------- calls
    def _plan_calls(self, plan: StepPlan, prev: StepHandle | None):
        """The plan as calls; returns (calls, index of the prefill-group call or None)."""
        L, R0 = self.L, self.spec.max_num_seqs
        decode = list(plan.decode)
        drafts = plan.drafts or ((),) * len(decode)
        # A speculating decode runs k + 1 rows (its last token, then its drafts), each
        # sampled: the ragged attention path, several query tokens for one sequence.
        one_row = not plan.drafts
        n_dec = len(decode) + sum(map(len, drafts))
        # The prefill span [a, b) in operator units (2L: the whole stack).
        a, b = (plan.unit_start, plan.unit_end) if plan.prefill else (0, 2 * L)
        before, after = bool(decode) and a > 0, bool(decode) and b < 2 * L
        dec_rows, chunk_rows = self._carried_rows(plan, drafts)
        none = np.full(n_dec, -1, np.int32)
        dec_tokens = np.zeros(n_dec, np.int32)
        dec_prev = none.copy()
        dec_seqs, dec_sampling, dec_check, r = [], [], [], 0
        for s, d in zip(decode, drafts, strict=True):
            dec_check += [*d, -1]
            if s.num_pending_tokens:
                dec_prev[r] = prev.rows[s.seq_id]
            else:
                dec_tokens[r : r + 1 + len(d)] = (s.last_token, *d)
            dec_seqs.append((s.num_tokens - 1, 1 + len(d), s.page_ids))
            dec_sampling += [(s, s.num_tokens + i, d[:i]) for i in range(1 + len(d))]
            r += 1 + len(d)
        calls = []
        if before:
            calls.append(_Call((0, a), dec_seqs, dec_tokens, none, dec_rows, dec_prev, one_row))
        # The prefill group (or the whole stack): decode rows first, then the chunks.
        pre_tokens, pre_seqs, sample_rows, sampling = [], [], [], []
        count_reset, count_slot, count_output = [], [np.full(n_dec, -1, np.int32)], []
        score_target, scored = [np.full(n_dec, -1, np.int32)], []
        offset = n_dec
        for c in plan.prefill:
            score_target.append(self._score_targets(c, offset) if b == 2 * L else
                                np.full(c.num_tokens, -1, np.int32))
            n_scored = int((score_target[-1] >= 0).sum())
            if n_scored:
                scored.append((c.seq, c.start + 1, offset, n_scored))
            pre_tokens.append(np.asarray(c.seq.token_ids[c.start : c.end], np.int32))
            # A penalized sequence's tokens are counted once, in its chunk's first group.
            slot = self._slot(c.seq) if a == 0 and c.seq.sampling_params.has_penalties else -1
            if slot >= 0 and c.start == 0:
                count_reset.append(slot)
            count_slot.append(np.full(c.num_tokens, slot, np.int32))
            count_output.append(np.arange(c.start, c.end) >= c.seq.num_prompt_tokens)
            pre_seqs.append((c.start, c.num_tokens, c.seq.page_ids))
            offset += c.num_tokens
            if c.samples and plan.is_last_group:
                sample_rows.append(offset - 1)
                sampling.append((c.seq, c.seq.num_tokens))
        n_pre = offset - n_dec
        pre_rows = R0 + np.concatenate(
            [np.zeros(0, np.int32)] + [np.arange(r, r + c.num_tokens, dtype=np.int32)
                                       for r, c in zip(chunk_rows, plan.prefill, strict=True)])
        pre_none = np.full(n_pre, -1, np.int32)
        # Decode rows come from call 1's output, or are embedded here; prefill rows are
        # embedded in the first group and carried in the hidden buffer after it.
        dec_in = (np.zeros(n_dec, np.int32), dec_rows, none) if before else (
            dec_tokens, none, dec_prev)
        pre_in = ((np.concatenate([np.zeros(0, np.int32), *pre_tokens]), pre_none) if a == 0
                  else (np.zeros(n_pre, np.int32), pre_rows))
        mixed = _Call(
            (a, b), dec_seqs + pre_seqs,
            tokens=np.concatenate([dec_in[0], pre_in[0]]),
            src=np.concatenate([dec_in[1], pre_in[1]]),
            dst=np.concatenate([dec_rows if after else none,
                                pre_rows if b < 2 * L else pre_none]),
            prev_rows=np.concatenate([dec_in[2], pre_none]),
            decode_only=not plan.prefill and one_row, count_reset=count_reset,
            count_slot=np.concatenate(count_slot),
            count_output=np.concatenate([np.zeros(n_dec, bool), *count_output]),
            score_target=np.concatenate(score_target), scored=scored)
        mixed.objs = decode + [c.seq for c in plan.prefill]
        if not after:
            mixed.sample_rows = list(range(n_dec)) + sample_rows
            mixed.sampling = dec_sampling + sampling
            mixed.check = dec_check + [-1] * len(sampling)
        calls.append(mixed)
        mixed_index = len(calls) - 1 if plan.prefill else None
        if after:
            calls.append(_Call((b, 2 * L), dec_seqs, np.zeros(n_dec, np.int32), dec_rows,
                               none, none, one_row, list(range(n_dec)), dec_sampling,
                               objs=decode, check=dec_check))
        return calls, mixed_index

    def _carried_rows(self, plan: StepPlan, drafts) -> tuple[np.ndarray, tuple[int, ...]]:
        """Hidden-buffer rows of the plan's decode rows (from 0) and of each chunk's first
        row (from max_num_seqs). One buffer: the decode order, and the plan's chunk rows.
        Split over data ranks (`spec.hidden_split`): rows of the sequence's own rank's
        block, each rank's decode rows and chunks packed in plan order; a batch's chunks
        are the same in each of its plans, so its rows are too."""
        n_dec = len(plan.decode) + sum(map(len, drafts))
        if not self.spec.hidden_split:
            return np.arange(n_dec, dtype=np.int32), plan.chunk_rows
        if plan.prefill_rows:
            raise RuntimeError("a plan with its own prefill_rows on a hidden buffer split "
                               "over data ranks")
        P_r = self.num_pages // self.spec.data_ranks
        used, dec_rows = [0] * self.spec.data_ranks, []
        for s, d in zip(plan.decode, drafts, strict=True):
            r = s.page_ids[0] // P_r
            dec_rows += range(used[r], used[r] + 1 + len(d))
            used[r] += 1 + len(d)
        used, chunk_rows = [0] * self.spec.data_ranks, []
        for c in plan.prefill:
            r = c.seq.page_ids[0] // P_r
            chunk_rows.append(used[r])
            used[r] += c.num_tokens
        return np.asarray(dec_rows, np.int32), tuple(chunk_rows)

    def _draft_inputs(self, call: _Call, d: dict, where: np.ndarray, N: int) -> None:
        """Fills inputs["draft"] (step._draft) for a call whose rows leave the last
        layer: each row's next token (at its program row, `where`), and where each
        sequence's sampled rows are, in its draft slot (`_draft_slots`), which it keeps
        in call.draft_slots for the handle."""
        sampled = {r: s for s, r in enumerate(call.sample_rows)}
        d["check_S"][: len(call.check)] = call.check
        call.draft_slots = self._draft_slots(call, N)
        row = 0
        for b, (first, n, pages), seq in zip(call.draft_slots, call.seqs, call.objs,
                                             strict=True):
            mine = [sampled[r] for r in range(row, row + n) if r in sampled]
            for j in range(n):
                s = sampled.get(row + j)
                p = first + j + 1  # a row's next token: sampled there, or the prompt's
                d["next_token_N"][where[row + j]] = (
                    -1 - s if s is not None else
                    seq.token_ids[p] if p < len(seq.token_ids) else 0)
            if mine:
                d["first_S_B"][b], d["rows_B"][b] = mine[0], len(mine)
            d["num_pages_B"][b] = len(pages)
            row += n

    def _draft_slots(self, call: _Call, N: int) -> list[int]:
        """Each of call.seqs' slot among a draft model's per-sequence arrays
        (StepSpec.draft_seqs_for): its place in the call on one rank; under data-parallel
        attention rank-major, r B_r + its place among rank r's sequences, the order of the
        ranked metadata (`_rank_layout`)."""
        if self.spec.data_ranks == 1:
            return list(range(len(call.seqs)))
        P_r, B_r = self.num_pages // self.spec.data_ranks, self.spec.rank_seqs_for(N)
        used, slots = [0] * self.spec.data_ranks, []
        for _, _, pages in call.seqs:
            r = pages[0] // P_r
            slots.append(r * B_r + used[r])
            used[r] += 1
        return slots

    @staticmethod
    def _score_targets(chunk, offset: int) -> np.ndarray:
        """Per row of a chunk that ends the stack: the next prompt token, which the row's
        logits score, for a request that asked for prompt log-probabilities; else -1.
        The rows scored are the chunk's first ones (positions p with p + 1 < prompt)."""
        seq = chunk.seq
        out = np.full(chunk.num_tokens, -1, np.int32)
        if seq.sampling_params.prompt_logprobs is None:
            return out
        end = min(chunk.end, seq.num_prompt_tokens - 1)
        if end > chunk.start:
            out[: end - chunk.start] = seq.token_ids[chunk.start + 1 : end + 1]
        return out

    def _rank_layout(self, call: _Call, N: int | None = None):
        """Data-parallel attention's layout of a call: (where, per rank): where[j] is
        call row j's row among the R N rows of bucket N (rank r's at [r N, (r + 1) N),
        each rank's rows in call order), and per rank its (first, n, page ids local to
        the rank) sequences. A sequence's rank is the one whose pages it holds
        (dp_placement: rank r owns the page ids [r P_r, (r + 1) P_r)). With N None,
        where is left empty: the per-rank rows pick the bucket."""
        R = self.spec.data_ranks
        P_r = self.num_pages // R
        where = np.zeros(len(call.tokens), np.int32)
        ranks, used, row = [[] for _ in range(R)], [0] * R, 0
        for first, n, pages in call.seqs:
            r = pages[0] // P_r
            if pages[-1] // P_r != r:
                raise RuntimeError(f"a sequence's pages {pages} span data ranks")
            if N is not None:
                where[row : row + n] = r * N + used[r] + np.arange(n)
            ranks[r].append((first, n, [p - r * P_r for p in pages]))
            used[r], row = used[r] + n, row + n
        return where, ranks

    def _rows_per_rank(self, call: _Call) -> int:
        """The rows a call runs on each rank: its fullest rank's (all of them on one)."""
        if self.spec.data_ranks == 1:
            return len(call.tokens)
        return max(sum(n for _, n, _ in seqs) for seqs in self._rank_layout(call)[1])

    def _inputs(self, call: _Call, N: int) -> dict:
        spec, n = self.spec, len(call.tokens)
        inputs = empty_inputs(spec, N)
        inputs["units"][:] = call.units
        inputs["decode_only"] = np.bool_(call.decode_only)
        B, S, C = spec.seqs_for(N), spec.page_size, spec.pages_per_seq
        where = np.arange(n)  # call row -> row of the program's inputs
        if spec.data_ranks > 1:  # each rank's rows in its slice, rank-local page ids
            where, ranks = self._rank_layout(call, N)
            inputs["meta"] = build_ranked_metadata(ranks, page_size=S, num_tokens=N,
                                                   num_seqs=spec.rank_seqs_for(N),
                                                   pages_per_seq=C)
            # The rows whose prompt scores the handle reads (collect).
            call.scored = [(seq, pos, int(where[row]), k) for seq, pos, row, k in call.scored]
        elif call.decode_only:
            inputs["meta"] = build_decode_metadata(
                [first for first, _, _ in call.seqs], [pages for _, _, pages in call.seqs],
                page_size=S, num_seqs=B, pages_per_seq=C, num_tokens=N)
        else:
            inputs["meta"] = build_metadata(call.seqs, page_size=S, num_tokens=N, num_seqs=B,
                                            pages_per_seq=C)
        for name, value in (("tokens_N", call.tokens), ("src_N", call.src), ("dst_N", call.dst),
                            ("prev_rows_N", call.prev_rows)):
            inputs[name][where] = value
        if call.count_slot is not None:
            inputs["count_slot_N"][where] = call.count_slot
            inputs["count_output_N"][where] = call.count_output
            inputs["count_reset_B"][: len(call.count_reset)] = call.count_reset
        if call.scored:
            inputs["do_score"] = np.bool_(True)
            inputs["score_target_N"][where] = call.score_target
        if "bitmask_SW" in inputs["sampling"]:  # None: all ones (run_calls)
            inputs["sampling"]["bitmask_SW"] = None
        if "draft" in inputs and call.units[1] == 2 * self.L:
            self._draft_inputs(call, inputs["draft"], where, N)
        if call.sample_rows:
            inputs["do_sample"] = np.bool_(True)
            inputs["do_logprobs"] = np.bool_(any(
                s.sampling_params.logprobs is not None for s, *_ in call.sampling))
            inputs["sample_rows_S"][: len(call.sample_rows)] = where[call.sample_rows]
            self._fill_sampling(inputs["sampling"], call.sampling)
        return inputs

    @staticmethod
    def _slot(seq) -> int:
        """seq's count slot: its slot among the admitted sequences (Sequence.slot)."""
        if seq.slot is None:
            raise RuntimeError(f"seq {seq.seq_id} runs with penalties but holds no slot")
        return seq.slot

    def _fill_sampling(self, out: dict, rows: list):
        eos = self.cfg.eos_token_ids
        constrained = []
        for i, (seq, pos, *prefix) in enumerate(rows):
            p = seq.sampling_params
            if p.has_penalties:  # a verification row counts the drafts before it
                out["count_slot"][i] = self._slot(seq)
                out["presence"][i], out["frequency"][i] = p.presence_penalty, p.frequency_penalty
                out["repetition"][i] = p.repetition_penalty
                if prefix and prefix[0]:
                    out["draft_prefix_SK"][i, : len(prefix[0])] = prefix[0]
            bias = list(p.logit_bias)
            if pos - seq.num_prompt_tokens < p.min_tokens:  # eos and stop ids masked
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
                bias += [(t, -np.inf) for t in sorted(stops)]
            if bias:
                ids, vals = zip(*bias, strict=True)
                out["bias_ids"][i, : len(ids)], out["bias"][i, : len(ids)] = ids, vals
            # top_k past the vocabulary is no limit at all (and may not fit int32).
            out["top_k"][i] = p.top_k if 0 < p.top_k < self.cfg.vocab_size else 0
            out["temperature"][i], out["top_p"][i] = p.temperature, p.top_p
            if p.structured_outputs is not None:  # prefix: drafts before a verification row
                constrained.append((seq, i, tuple(prefix[0]) if prefix else ()))
            # Unseeded requests draw from a stream fixed by the engine seed and request id.
            seed = (p.seed if p.seed is not None else hash((self.seed, seq.seq_id))) % 2**64
            out["seed_S2"][i] = seed >> 32, seed & 0xFFFFFFFF
            out["position"][i] = pos
        if "bitmask_SW" in out:
            out["bitmask_SW"] = self._bitmask(constrained, len(out["position"]))

    def _bitmask(self, constrained: list, B: int) -> np.ndarray | None:
        """The bitmask of a call's B sampled rows, from the constrained sequences'
        matchers; None (all ones, on device: run_calls) when no row has a grammar."""
        if not constrained:
            return None
        if self.structured is None:
            raise RuntimeError("a request with structured_outputs reached a runner "
                               "without a grammar engine")
        for seq, _, _ in constrained:
            if seq.num_pending_tokens:  # the scheduler holds these out (scheduler.py)
                raise RuntimeError(f"seq {seq.seq_id} has a grammar and a token still on "
                                   "device: its mask cannot be built")
        mask_BW = np.full((B, self.spec.mask_words), -1, np.int32)
        self.structured.fill([(seq.seq_id, i) for seq, i, pre in constrained if not pre],
                             mask_BW)
        after = [(seq.seq_id, i, pre) for seq, i, pre in constrained if pre]
        if after:
            self.structured.fill_after(after, mask_BW)
        return mask_BW


    # ------------------------------------------------------------ execute
    def dispatch(self, plan: StepPlan, prev: StepHandle | None = None) -> StepHandle:
        """Launches the plan's calls and returns without waiting for the device. `prev`:
        the dispatched, uncommitted step whose tokens this plan's placeholders stand for.
        A preemption needs nothing here: the scheduler owns the hidden buffer's prefill
        rows (plan.prefill_rows), so a preempted or aborted batch's rows are simply not
        read again, and it never preempts a batch an outstanding plan still runs.
        With a plan channel (a multi-process leader), the calls' inputs go to every
        follower first, and each runs the same calls (`run_calls`)."""
        t0 = time.perf_counter()
        calls, mixed = self._plan_calls(plan, prev)
        batch, useful, padded = [], 0.0, 0.0
        for call in calls:
            n = len(call.tokens)
            N = bucket_for(self._rows_per_rank(call), self.spec.buckets)
            batch.append((N, self._inputs(call, N)))
            layers = (call.units[1] - call.units[0]) / 2
            useful = useful + n * layers
            padded = padded + self.spec.rows_for(N) * layers
        prev_tokens = prev.tokens_R if prev is not None else None
        step_id = next(self._step_ids)
        if self.channel is not None:
            prev_id = prev.step_id if prev_tokens is not None else -1
            self.channel.send_step(step_id, self.codec.encode(step_id, prev_id, batch))
        counts, outs = self.run_calls(batch, prev_tokens)
        self._count_padding(useful, padded)
        # Sampled rows are the plan's sampling sequences in order: decodes (a speculating
        # one's k + 1 rows), then the chunks that end their prompts (_plan_calls).
        rows, drafts, r = {}, plan.drafts_by_seq, 0
        for s in plan.sampling_seqs:
            rows[s.seq_id] = r
            r += 1 + len(drafts.get(s.seq_id, ()))
        wants = {s.seq_id: s.sampling_params.logprobs for s in plan.sampling_seqs
                 if s.sampling_params.logprobs is not None}
        sample = next((o for (_, x), o in zip(batch, outs, strict=True) if x["do_sample"]), None)
        last = next((i for i, c in enumerate(calls) if c.units[1] == 2 * self.L), None)
        next_drafts_RK, draft_rows = None, {}
        if self.draft_state is not None and last is not None:
            next_drafts_RK = outs[last]["drafts_RK"]
            sampling_ids = {s.seq_id for s in plan.sampling_seqs}
            draft_rows = {q.seq_id: b for b, q in zip(calls[last].draft_slots,
                                                      calls[last].objs, strict=True)
                          if q.seq_id in sampling_ids}
        score = next((o for (_, x), o in zip(batch, outs, strict=True) if x["do_score"]), None)
        return StepHandle(
            plan=plan, tokens_R=None if sample is None else sample["tokens_R"], counts=counts,
            prefill_call=mixed, rows=rows, drafts=drafts, dispatched_at=t0, step_id=step_id,
            next_drafts_RK=next_drafts_RK, next_draft_rows=draft_rows,
            logprobs=(sample["logprob_R"], sample["top_logprob_RK"], sample["top_id_RK"])
            if wants and sample is not None else None,
            wants_logprobs=wants or None,
            prompt_scores=(score["prompt_logprob_N"], score["prompt_top_logprob_NK"],
                           score["prompt_top_id_NK"]) if score is not None else None,
            scored=calls[mixed].scored if score is not None else None, channel=self.channel)

    def run_calls(self, batch: list[tuple[int, dict]], prev_tokens_R: jax.Array | None):
        """Runs (bucket, inputs) calls in order; returns (experts activated per call, each
        call's outputs). The leader's dispatch and a follower's loop both end here, so
        every process runs the same programs on the same inputs."""
        counts, outs = [], []
        prev = self._no_prev_tokens if prev_tokens_R is None else prev_tokens_R
        for N, inputs in batch:
            inputs["prev_tokens_R"] = prev
            s = inputs["sampling"]
            if "bitmask_SW" in s and s["bitmask_SW"] is None:
                s["bitmask_SW"] = self._all_ones[len(s["position"])]
            draft = (self.draft_params, self.draft_state) if self.draft_state else ()
            self.kv_pages, self.hidden_RD, out = self._program(N)(
                self.state, self.kv_pages, self.hidden_RD, inputs, self.counts, *draft)
            self.counts = out["counts"]
            if draft:
                self.draft_state = out["draft_state"]
            counts.append(out["experts_activated"])
            outs.append(out)
        return counts, outs

    def _count_padding(self, useful: float, padded: float):
        r = self.row_layers
        r["useful"] += useful
        r["padded"] += padded
        if useful:
            r["max_step_ratio"] = max(r["max_step_ratio"], padded / useful)
