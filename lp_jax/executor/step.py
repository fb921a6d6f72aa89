"""The device step: one pure function, compiled once per row bucket.

A *call* runs N rows (a ragged token batch, padded to a bucket) through operator units
[lo, hi) of the stack (unit 2i: layer i's attention half, 2i + 1: its MLP half). The
bounds are runtime scalars, and so is every choice of what the ends do:

    rows in : embed token_N          (src_N < 0)        a decode token, a first group's prompt
              or hidden_RD[src_N]    (src_N >= 0)       hidden states carried on device
    layers  : units [lo, hi), one loop body for every layer (weights indexed in place)
    rows out: hidden_RD[dst_N] = x   (dst_N >= 0)       kept for a later call
    logits  : sample_rows_S -> tokens_R, when do_sample (lax.cond; skipped otherwise)

so the program set is one program per row bucket, whatever the policy, the layer count,
the group sizes or the number of groups. The executor (model_runner.py) turns a plan into
one to three calls of these programs: decode rows through [0, a), decode and prefill rows
together through the prefill group [a, b) (so the group reads its experts once for both),
decode rows through [b, L). `hidden_RD` is a persistent device buffer, donated like the
KV pool: rows [0, max_num_seqs) carry the decode rows between the calls of one step, rows
[max_num_seqs, ...) a layered prefill batch's hidden states between its groups.

`counts` (optional, donated like the KV pool) is the sampler's per-sequence token state:
`output_XV` int32 counts of each slot's output tokens and `prompt_XV` its prompt tokens,
for the penalties. The step resets the slots of sequences that start a prefill, counts
the prefill rows' tokens (`count_slot_N`, in a chunk's first-group call) and then each
sampled token, so the newest token, which under overlapped scheduling exists only on
device, is counted where it is made, and every process updates the same state.
A speculating decode's verification row j reads its slot's counts plus drafts 0..j-1
(`sampling["draft_prefix_SK"]`), and its token is counted only if those drafts stand.

Prompt log-probabilities (`do_score`, runtime): rows with `score_target_N >= 0` are
scored against that token (the next prompt token) after the last layer, in slices of
SCORE_ROWS rows, so the logits never exist as one [prompt, vocabulary] array; slices
without a scored row are skipped. Outputs `prompt_logprob_N` and the top MAX_LOGPROBS
`prompt_top_logprob_NK` / `prompt_top_id_NK`.

Structured outputs: `sampling["bitmask_SW"]`, one int32 row of ceil(V/32) words per
sampled row (lp_jax/structured), masks the tokens each row's grammar forbids after the
bias and the penalties; all ones for a row without a grammar. It is an input of every
program, so constrained requests compile nothing, and the mask is skipped (lax.cond)
when no row has one.

Draft models (`draft`, spec.draft_k > 0; docs/speculative.md): the call whose rows leave the
last layer runs the draft (`_draft`) after sampling: its KV for every row, then k drafts per
sampling sequence, out as `drafts_RK`. An EAGLE-3 head reads the residual stream entering
its three aux layers, which the layer loop keeps per row and carries in
`draft_state["aux_RAD"]` beside hidden_RD; an MTP layer reads the rows' last hidden state,
the call's own output, so nothing is carried. It is a branch of the same programs, not a
program of its own.

`decode_only` (runtime) lets a backend with a separate decode kernel use it for calls
whose rows are one token per sequence.

Data-parallel attention (`StepSpec.data_ranks` R > 1, docs/data_parallel.md): the program
of bucket N runs N rows on each rank, R N in all (rank r's at [r N, (r + 1) N)), split
over "data", with ranked metadata; each rank's attention reads its own pool shard
(lp_jax/models/data_ranks.py). The counted tokens and the sampled rows are gathered
whole; sampling is over all ranks' rows. The hidden buffer is split over "data" when each
rank's carried rows stay in its own block (`hidden_split`, under budgets a rank): rows
go in and out of it inside a shard_map over "data", nothing gathered; else it is
replicated and the rows written to it are gathered whole. A draft model's pool is split
over "data" as the target's, its extend runs on the call's R N rows and its chained
steps on R rank_seqs_for(N) rows, rank r's sequences on rank r
(`StepSpec.draft_seqs_for`, lp_jax/models/draft_chain.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lp_jax.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from lp_jax.executor.sampler import (
    add_drafts,
    apply_bias,
    apply_bitmask,
    apply_penalties,
    drafts_stand,
    sample,
    token_logprobs,
)
from lp_jax.models import eagle3, mtp
from lp_jax.models.backends import KernelBackends
from lp_jax.models.metadata import AttentionMetadata, build_ranked_metadata
from lp_jax.sharding import named_sharding
from lp_jax.spec.config import MAX_SPECULATIVE_TOKENS
from lp_jax.structured.params import mask_words

MAX_EOS_TOKEN_IDS = 8  # a model's eos ids (config.json and generation_config.json)
# Per-row bias entries: the logit_bias cap, then min_tokens' masks (stop ids and eos).
BIAS_SLOTS = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + MAX_EOS_TOKEN_IDS
# Rows per slice of prompt scoring: [256, vocabulary] float32 logits at a time (156 MB at
# Qwen3's 151,936 entries), each slice one read of the LM head.
SCORE_ROWS = 256
@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static shape of the program family. `max_num_seqs` bounds the sequences of a
    call and its sampled rows; `hidden_rows` is the carried-hidden buffer's length;
    `vocab_size` the model's (padded) vocabulary, which the structured-output bitmask
    covers (0: no bitmask input)."""

    num_layers: int
    hidden_size: int
    page_size: int
    pages_per_seq: int
    max_num_seqs: int
    hidden_rows: int
    buckets: tuple[int, ...]
    vocab_size: int  # required: a program family without the bitmask input would differ
    draft_k: int = 0  # drafts a draft model proposes per sequence (0: none)
    # Data-parallel attention's ranks R: a call of bucket N runs N rows on each rank, R N
    # rows in all, rank r's at [r N, (r + 1) N), with per-rank metadata (data_ranks.py).
    data_ranks: int = 1
    # With R > 1: the carried-hidden buffer is R blocks of hidden_rows, split over "data",
    # and a row's src / dst index its own rank's block (rank-local rows); else one
    # replicated buffer of hidden_rows, indexed by every rank.
    hidden_split: bool = False

    @property
    def hidden_buffer_rows(self) -> int:
        """Rows of the whole carried-hidden buffer (all ranks' blocks when split)."""
        return self.hidden_rows * (self.data_ranks if self.hidden_split else 1)

    @property
    def mask_words(self) -> int:
        """int32 words of a bitmask row (bit v % 32 of word v // 32 is token v)."""
        return mask_words(self.vocab_size)

    def rows_for(self, N: int) -> int:
        """Rows of a call of bucket N: N on each data rank."""
        return self.data_ranks * N

    def seqs_for(self, N: int) -> int:
        """Sequences (and sampled rows) a call of bucket N can hold, over all ranks."""
        return min(self.rows_for(N), self.max_num_seqs)

    def rank_seqs_for(self, N: int) -> int:
        """Sequences one data rank's share of a call of bucket N can hold (its
        metadata's batch size): N rows, and no more than the ceil(max_num_seqs / R)
        sequences the scheduler places on a rank (core/dp_placement.py); seqs_for(N)
        with one rank."""
        return min(N, -(-self.max_num_seqs // self.data_ranks))

    def draft_seqs_for(self, N: int) -> int:
        """A draft model's per-sequence slots in a call of bucket N: seqs_for(N) on one
        rank; under data-parallel attention rank_seqs_for(N) a rank, rank-major (rank r's
        sequences at [r B_r, (r + 1) B_r), as its metadata orders them), so the chained
        draft steps run each rank's sequences on that rank."""
        if self.data_ranks == 1:
            return self.seqs_for(N)
        return self.data_ranks * self.rank_seqs_for(N)


# XLA:TPU's memory-space assignment may copy one whole entry parameter into on-chip memory
# at the start of each call (a cross-program prefetch), and again at its end so the next
# call of the same program finds it there. On a vocabulary-split mesh it picks the
# embedding shard (Qwen3-30B-A3B on 8 v6e chips: [18992, 2048], 77.8 MB) and reads it
# whole to gather a few rows. A step reads each weight once, so such a copy buys at most
# an earlier start of one read; the step allows none. The flag exists only in TPU's
# compiler: other platforms get no options.
TPU_COMPILER_OPTIONS = {"xla_msa_max_cross_program_prefetches": 0}


def compiler_options(platform: str) -> dict:
    """The step's XLA compile options on `platform` ("tpu", "cpu", "gpu", "cuda")."""
    return dict(TPU_COMPILER_OPTIONS) if platform == "tpu" else {}


COUNTS_AXES = (None, "vocab")  # logical axes of output_XV and prompt_XV


def init_counts(spec: StepSpec, vocab_size: int) -> dict:
    """The sampler's token-count state (numpy), one slot per admitted sequence."""
    X = spec.max_num_seqs
    return {"output_XV": np.zeros((X, vocab_size), np.int32),
            "prompt_XV": np.zeros((X, vocab_size), np.bool_)}


def counts_sharding(spec: StepSpec, vocab_size: int, mesh) -> NamedSharding:
    """Where the counts live on `mesh`: split over the vocabulary as the logits are
    (LOGICAL_RULES' "vocab"), so the penalties read and the sampled tokens' scatter-add
    writes each chip's own columns; nothing vocabulary-wide is gathered a step."""
    return named_sharding(COUNTS_AXES, (spec.max_num_seqs, vocab_size), mesh)


def _count_tokens(counts, inputs, tokens_N):
    """Resets starting slots, then counts the prefill rows' tokens into them."""
    out_XV, prompt_XV = counts["output_XV"], counts["prompt_XV"]
    X = out_XV.shape[0]
    reset_B = jnp.where(inputs["count_reset_B"] < 0, X, inputs["count_reset_B"])
    out_XV = out_XV.at[reset_B].set(0, mode="drop")
    prompt_XV = prompt_XV.at[reset_B].set(False, mode="drop")
    slot_N, is_out_N = inputs["count_slot_N"], inputs["count_output_N"]
    out_XV = out_XV.at[jnp.where((slot_N >= 0) & is_out_N, slot_N, X), tokens_N].add(
        1, mode="drop")
    prompt_XV = prompt_XV.at[jnp.where((slot_N >= 0) & ~is_out_N, slot_N, X), tokens_N].set(
        True, mode="drop")
    return {"output_XV": out_XV, "prompt_XV": prompt_XV}


def _score_prompt(model, x_ND, target_N):
    """(logprob_N, top_NK, ids_NK) of each row's target token (rows with target < 0 get
    zeros), SCORE_ROWS rows of logits at a time."""
    N, K = x_ND.shape[0], MAX_LOGPROBS
    Q = min(N, SCORE_ROWS)
    C = -(-N // Q)
    pad = C * Q - N
    x_CQD = jnp.pad(x_ND, ((0, pad), (0, 0))).reshape(C, Q, -1)
    t_CQ = jnp.pad(target_N, (0, pad), constant_values=-1).reshape(C, Q)

    def one_slice(args):
        x_QD, t_Q = args

        def score():
            logits_QV = model.compute_logits(x_QD).astype(jnp.float32)
            chosen_Q, top_QK, ids_QK = token_logprobs(logits_QV, jnp.maximum(t_Q, 0))
            k = top_QK.shape[1]  # min(K, vocabulary)
            return (chosen_Q, jnp.pad(top_QK, ((0, 0), (0, K - k))),
                    jnp.pad(ids_QK, ((0, 0), (0, K - k))))

        def skip():
            return (jnp.zeros(Q, jnp.float32), jnp.zeros((Q, K), jnp.float32),
                    jnp.zeros((Q, K), jnp.int32))

        return jax.lax.cond(jnp.any(t_Q >= 0), score, skip)

    chosen_CQ, top_CQK, ids_CQK = jax.lax.map(one_slice, (x_CQD, t_CQ))
    return (chosen_CQ.reshape(-1)[:N], top_CQK.reshape(C * Q, K)[:N],
            ids_CQK.reshape(C * Q, K)[:N])


def _take_rows(hidden_RD, src_N, rank_rows):
    """hidden_RD[src_N] (rows of src_N < 0: any row); with `rank_rows` (the "data" split),
    each rank's rows from its own block, src_N rank-local."""
    def take(h_RD, s_N):
        return h_RD[jnp.maximum(s_N, 0)]

    if rank_rows is None:
        return take(hidden_RD, src_N)
    split = PartitionSpec("data")
    return jax.shard_map(take, mesh=rank_rows.mesh, in_specs=(split, split), out_specs=split,
                         axis_names={"data"}, check_vma=False)(hidden_RD, src_N)


def _put_rows(hidden_RD, dst_N, x_ND, rank_rows):
    """hidden_RD with rows dst_N set to x_ND (dst_N < 0: dropped); with `rank_rows`, each
    rank's rows into its own block, dst_N rank-local."""
    def put(h_RD, d_N, x):
        return h_RD.at[jnp.where(d_N < 0, h_RD.shape[0], d_N)].set(x, mode="drop")

    if rank_rows is None:
        return put(hidden_RD, dst_N, x_ND)
    split = PartitionSpec("data")
    return jax.shard_map(put, mesh=rank_rows.mesh, in_specs=(split, split, split),
                         out_specs=split, axis_names={"data"},
                         check_vma=False)(hidden_RD, dst_N, x_ND)


def make_step(graphdef, spec: StepSpec, backends: KernelBackends, *, replicated=None,
              counts_sharding=None, draft=None):
    """step(state, kv_pages, hidden_RD, inputs, counts=None, draft_params=None,
    draft_state=None) -> (kv_pages, hidden_RD, out); jit it with kv_pages, hidden_RD,
    counts and draft_state donated. `draft`: a draft model's config (Eagle3Config,
    MtpConfig), whose drafts the step then proposes (spec.draft_k of them, `_draft`).
    On a mesh, `replicated` (its replicated sharding) pins the bitmask input the host
    keeps replicated, and `counts_sharding` (`counts_sharding()`) pins out["counts"] to
    the counts' input sharding. Otherwise sharding propagation from the vocab-sharded
    logits would choose them (it runs back through the mask's bits into the input), and
    the next call would not match its program."""
    R = spec.max_num_seqs
    # Data-parallel attention: the rows split over "data", rank r's N at [r N, (r + 1) N).
    rank_rows = (NamedSharding(replicated.mesh, PartitionSpec("data"))
                 if spec.data_ranks > 1 and replicated is not None else None)
    split = spec.hidden_split and rank_rows is not None

    def step(state, kv_pages, hidden_RD, inputs, counts=None, draft_params=None,
             draft_state=None):
        model = nnx.merge(graphdef, state)
        prev_N = inputs["prev_rows_N"]  # >= 0: the token is in the previous step's tokens_R
        tokens_N = jnp.where(prev_N >= 0, inputs["prev_tokens_R"][jnp.maximum(prev_N, 0)],
                             inputs["tokens_N"])
        src_N = inputs["src_N"]
        x_ND = jnp.where((src_N < 0)[:, None], model.embed(tokens_N),
                         _take_rows(hidden_RD, src_N, rank_rows if split else None))
        if rank_rows is not None:
            x_ND = jax.lax.with_sharding_constraint(x_ND, rank_rows)
        lo, hi = inputs["units"][0], inputs["units"][1]
        aux = {}
        if draft is not None and draft.aux_layer_ids:  # carried rows bring their aux states
            aux_RAD = draft_state["aux_RAD"]  # rows as hidden_RD's (split over data with it)
            taken_NX = _take_rows(aux_RAD.reshape(aux_RAD.shape[0], -1), src_N,
                                  rank_rows if split else None)
            aux = {"aux_layers": draft.aux_layer_ids,
                   "aux_NAD": jnp.where((src_N < 0)[:, None, None], 0,
                                        taken_NX.reshape(-1, *aux_RAD.shape[1:]))}
        x_ND, kv_pages, activated, *aux_NAD = model.run_units(
            x_ND, kv_pages, inputs["meta"], lo, hi, decode_only=inputs["decode_only"],
            backends=backends, **aux)
        dst_N = inputs["dst_N"]
        if split:  # each rank's rows into its own block
            hidden_RD = _put_rows(hidden_RD, dst_N, x_ND, rank_rows)
        else:
            # A replicated buffer: gather the ranks' rows (R N x D), not an all-reduce of
            # the whole buffer that a scatter of split rows would become.
            carried_ND = x_ND if rank_rows is None else jax.lax.with_sharding_constraint(
                x_ND, replicated)
            hidden_RD = _put_rows(hidden_RD, dst_N, carried_ND, None)
            dst_N = jnp.where(dst_N < 0, hidden_RD.shape[0], dst_N)
        if aux:
            aux_RAD = draft_state["aux_RAD"]  # dst_N as hidden_RD's put took it
            put_RX = _put_rows(aux_RAD.reshape(aux_RAD.shape[0], -1), dst_N,
                               aux_NAD[0].reshape(aux_NAD[0].shape[0], -1),
                               rank_rows if split else None)
            draft_state = dict(draft_state, aux_RAD=put_RX.reshape(aux_RAD.shape))

        if counts is not None:  # the token ids whole: the counts are not split by rank
            counts = _count_tokens(counts, inputs, tokens_N if rank_rows is None else
                                   jax.lax.with_sharding_constraint(tokens_N, replicated))
        S = inputs["sample_rows_S"].shape[0]  # spec.seqs_for(bucket)

        s = inputs["sampling"]
        slot_S = s["count_slot"]

        def logits_and_sample():
            raw_SV = model.compute_logits(x_ND[inputs["sample_rows_S"]]).astype(jnp.float32)
            logits_SV = apply_bias(raw_SV, s["bias_ids"], s["bias"])
            if counts is not None:
                def penalize(x_SV):
                    at_S = jnp.maximum(slot_S, 0)
                    mine_S = (slot_S >= 0)[:, None]
                    out_SV = add_drafts(counts["output_XV"][at_S], s["draft_prefix_SK"])
                    return apply_penalties(
                        x_SV, jnp.where(mine_S, out_SV, 0),
                        mine_S & counts["prompt_XV"][at_S], s["presence"], s["frequency"],
                        s["repetition"])
                logits_SV = jax.lax.cond(jnp.any(slot_S >= 0), penalize, lambda x: x,
                                         logits_SV)
            if "bitmask_SW" in s:
                mask_SW = s["bitmask_SW"]
                if replicated is not None:
                    mask_SW = jax.lax.with_sharding_constraint(mask_SW, replicated)
                logits_SV = jax.lax.cond(jnp.any(mask_SW != -1), apply_bitmask,
                                         lambda x, _: x, logits_SV, mask_SW)
            tokens_S = sample(logits_SV, s["temperature"], s["top_k"], s["top_p"], s["seed_S2"],
                              s["position"])
            lp = jax.lax.cond(
                inputs["do_logprobs"], lambda: token_logprobs(raw_SV, tokens_S),
                lambda: (jnp.zeros(S, jnp.float32), jnp.zeros((S, MAX_LOGPROBS), jnp.float32),
                         jnp.zeros((S, MAX_LOGPROBS), jnp.int32)))
            pad = lambda x: jnp.pad(x, [(0, R - S)] + [(0, 0)] * (x.ndim - 1))
            return (pad(tokens_S), *map(pad, lp))

        def no_sample():
            return (jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.float32),
                    jnp.zeros((R, MAX_LOGPROBS), jnp.float32),
                    jnp.zeros((R, MAX_LOGPROBS), jnp.int32))

        # The counts are only read inside the cond: the donated buffer is updated in place.
        tokens_R, logprob_R, top_logprob_RK, top_id_RK = jax.lax.cond(
            inputs["do_sample"], logits_and_sample, no_sample)
        if counts is not None:  # each committed token joins its slot's output counts
            X = counts["output_XV"].shape[0]
            kept_S = drafts_stand(tokens_R[:S], s["draft_prefix_SK"])
            at_S = jnp.where(inputs["do_sample"] & (slot_S >= 0) & kept_S, slot_S, X)
            counts = dict(counts, output_XV=counts["output_XV"].at[at_S, tokens_R[:S]].add(
                1, mode="drop"))
        N, K = x_ND.shape[0], MAX_LOGPROBS
        prompt_lp = jax.lax.cond(
            inputs["do_score"], lambda: _score_prompt(model, x_ND, inputs["score_target_N"]),
            lambda: (jnp.zeros(N, jnp.float32), jnp.zeros((N, K), jnp.float32),
                     jnp.zeros((N, K), jnp.int32)))
        out = {"tokens_R": tokens_R, "experts_activated": activated, "logprob_R": logprob_R,
               "top_logprob_RK": top_logprob_RK, "top_id_RK": top_id_RK,
               "prompt_logprob_N": prompt_lp[0], "prompt_top_logprob_NK": prompt_lp[1],
               "prompt_top_id_NK": prompt_lp[2]}
        if counts is not None:
            out["counts"] = counts if counts_sharding is None else jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, counts_sharding), counts)
        if draft is not None:
            D = inputs["draft"]["first_S_B"].shape[0]  # spec.draft_seqs_for(bucket)
            drafts_BK, draft_kv = jax.lax.cond(
                hi == 2 * spec.num_layers,
                lambda kv: _draft(draft, spec, draft_params, kv,
                                  aux_NAD[0] if aux else x_ND[:, None], inputs, tokens_R,
                                  backends),
                lambda kv: (jnp.full((D, spec.draft_k), -1, jnp.int32), kv),
                draft_state["kv"])
            out["drafts_RK"] = jnp.pad(drafts_BK, ((0, max(R - D, 0)), (0, 0)),
                                       constant_values=-1)
            if replicated is not None:  # whole on every process, as tokens_R: the
                # leader reads every rank's drafts (a rank's rows may live on a follower)
                out["drafts_RK"] = jax.lax.with_sharding_constraint(out["drafts_RK"],
                                                                    replicated)
            out["draft_state"] = dict(draft_state, kv=draft_kv)
        return kv_pages, hidden_RD, out

    return step


def _draft(cfg, spec: StepSpec, params, kv_pages, aux_NAD, inputs, tokens_R, backends):
    """A draft model's drafts for the call's sequences, in the call whose rows leave
    the last layer: every row extends the draft's KV, then each drafting sequence
    proposes from its last row that stands. An EAGLE-3 head (lp_jax/models/eagle3.py)
    reads each row's three aux states, an MTP layer (lp_jax/models/mtp.py) the row's
    last hidden state: aux_NAD[:, 0], the call's output.

    inputs["draft"]: `next_token_N`, the token after each row (the next prompt token;
    -1 - s: the token sampled at sampled row s); per sequence of the call, `first_S_B`
    its first sampled row (-1: it does not draft), `rows_B` its sampled rows, and
    `num_pages_B` the pages it holds (a chained step past them writes nothing and
    drafts nothing); per sampled row, `check_S` the draft that the next row verifies
    (-1: none). Its accepted rows are those whose predecessors sampled their draft. The
    per-sequence arrays have `StepSpec.draft_seqs_for` slots (rank-major under
    data-parallel attention); sampled rows are numbered over all ranks."""
    d = inputs["draft"]
    S = inputs["sample_rows_S"].shape[0]  # spec.seqs_for(bucket)
    tokens_S = tokens_R[:S]
    next_N = d["next_token_N"]
    tok_N = jnp.where(next_N >= 0, next_N, tokens_S[jnp.clip(-1 - next_N, 0, S - 1)])
    first_B, K1 = d["first_S_B"], spec.draft_k + 1
    j_K = jnp.arange(K1)
    s_BK = jnp.clip(first_B[:, None] + j_K[None, :], 0, S - 1)
    match_BK = (tokens_S[s_BK] == d["check_S"][s_BK]) & (j_K[None, :] < d["rows_B"][:, None] - 1)
    last_s_B = jnp.clip(first_B + jnp.sum(jnp.cumprod(match_BK, axis=1), axis=1), 0, S - 1)
    last_row_B = inputs["sample_rows_S"][last_s_B]
    kw = dict(k=spec.draft_k, num_pages_B=d["num_pages_B"], drafting_B=first_B >= 0)
    if isinstance(cfg, mtp.MtpConfig):
        drafts_BK, kv_pages = mtp.propose(cfg, params, kv_pages, aux_NAD[:, 0], tok_N,
                                          inputs["meta"], last_row_B, backends=backends,
                                          decode_only=inputs["decode_only"], **kw)
    else:
        drafts_BK, kv_pages = eagle3.propose(cfg, params, kv_pages, aux_NAD, tok_N,
                                             inputs["meta"], last_row_B,
                                             backend=backends.attention, **kw)
    return jnp.where((first_B >= 0)[:, None], drafts_BK, -1), kv_pages


def empty_inputs(spec: StepSpec, N: int) -> dict:
    """The inputs of an N-row call with no real row (numpy): the lowering example, and
    the template the executor fills."""
    B, C, D = spec.seqs_for(N), spec.pages_per_seq, spec.draft_seqs_for(N)
    i32 = lambda n, v=0: np.full(n, v, np.int32)
    if spec.data_ranks > 1:  # per-rank metadata (metadata.build_ranked_metadata)
        meta = build_ranked_metadata([[]] * spec.data_ranks, page_size=spec.page_size,
                                     num_tokens=N, num_seqs=spec.rank_seqs_for(N),
                                     pages_per_seq=C)
    else:
        meta = AttentionMetadata(
            positions_T=i32(N), slots_T=i32(N, -1), query_start_B1=i32(B + 1),
            seq_lens_B=i32(B), page_table_BC=np.zeros((B, C), np.int32), num_seqs=np.int32(0))
    N = spec.rows_for(N)  # the rows of every rank
    return {
        "units": i32(2),
        "decode_only": np.bool_(False),
        "tokens_N": i32(N),
        "src_N": i32(N, -1),
        "dst_N": i32(N, -1),
        "prev_rows_N": i32(N, -1),
        "prev_tokens_R": i32(spec.max_num_seqs),
        "meta": meta,
        "count_reset_B": i32(B, -1),
        "count_slot_N": i32(N, -1),
        "count_output_N": np.zeros(N, np.bool_),
        "do_sample": np.bool_(False),
        "do_logprobs": np.bool_(False),
        "do_score": np.bool_(False),
        "score_target_N": i32(N, -1),
        "sample_rows_S": i32(B),
        "sampling": {"temperature": np.zeros(B, np.float32), "top_k": i32(B),
                     "top_p": np.ones(B, np.float32), "seed_S2": np.zeros((B, 2), np.uint32),
                     "position": i32(B), "count_slot": i32(B, -1),
                     "presence": np.zeros(B, np.float32), "frequency": np.zeros(B, np.float32),
                     "repetition": np.ones(B, np.float32),
                     "draft_prefix_SK": np.full((B, MAX_SPECULATIVE_TOKENS), -1, np.int32),
                     "bias_ids": np.full((B, BIAS_SLOTS), -1, np.int32),
                     "bias": np.zeros((B, BIAS_SLOTS), np.float32),
                     **({"bitmask_SW": all_ones_mask(spec, B)} if spec.vocab_size else {})},
        **({"draft": {"next_token_N": i32(N), "first_S_B": i32(D, -1), "rows_B": i32(D),
                      "num_pages_B": i32(D), "check_S": i32(B, -1)}} if spec.draft_k else {}),
    }


def all_ones_mask(spec: StepSpec, B: int) -> np.ndarray:
    """A [B, mask_words] bitmask that allows every token: a read-only view of one value,
    so a call without a constrained row builds no [B, ceil(V/32)] array on the host."""
    return np.broadcast_to(np.int32(-1), (B, spec.mask_words))
