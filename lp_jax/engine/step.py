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

`decode_only` (runtime) lets a backend with a separate decode kernel use it for calls
whose rows are one token per sequence.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lp_jax.engine.sampler import sample
from lp_jax.models.metadata import AttentionMetadata
from lp_jax.models.qwen3_moe import KernelBackends

_POW2_UP_TO = 512  # buckets double up to here, then grow by 1.5x (padding <= 1.5x)


def default_token_buckets(max_rows: int, *, min_rows: int = 1) -> tuple[int, ...]:
    """Row buckets: powers of two up to 512, then alternately x1.5 and x4/3 (768, 1024,
    1536, 2048, ...), with max_rows itself last. Padding stays under 2x in every call and
    under 1.5x above 512 rows, where padded rows cost compute; the count grows with
    log(max_rows) only: 19 buckets for an 8192-token layered budget."""
    out, b = [], min_rows
    while b < max_rows:
        out.append(b)
        if b < _POW2_UP_TO:
            b *= 2
        else:
            b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return (*out, max_rows)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} rows exceed the largest compiled bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static shape of the program family. `max_num_seqs` bounds the sequences of a
    call and its sampled rows; `hidden_rows` is the carried-hidden buffer's length."""

    num_layers: int
    hidden_size: int
    page_size: int
    pages_per_seq: int
    max_num_seqs: int
    hidden_rows: int
    buckets: tuple[int, ...]

    def seqs_for(self, N: int) -> int:
        """Sequences (and sampled rows) a call of N rows can hold."""
        return min(N, self.max_num_seqs)


def make_step(graphdef, spec: StepSpec, backends: KernelBackends):
    """step(state, kv_pages, hidden_RD, inputs) -> (kv_pages, hidden_RD, out); jit it with
    kv_pages and hidden_RD donated."""
    R = spec.max_num_seqs

    def step(state, kv_pages, hidden_RD, inputs):
        model = nnx.merge(graphdef, state)
        prev_N = inputs["prev_rows_N"]  # >= 0: the token is in the previous step's tokens_R
        tokens_N = jnp.where(prev_N >= 0, inputs["prev_tokens_R"][jnp.maximum(prev_N, 0)],
                             inputs["tokens_N"])
        src_N = inputs["src_N"]
        x_ND = jnp.where((src_N < 0)[:, None], model.embed(tokens_N),
                         hidden_RD[jnp.maximum(src_N, 0)])
        lo, hi = inputs["units"][0], inputs["units"][1]
        x_ND, kv_pages, activated = model.run_units(
            x_ND, kv_pages, inputs["meta"], lo, hi, decode_only=inputs["decode_only"],
            backends=backends)
        dst_N = jnp.where(inputs["dst_N"] < 0, hidden_RD.shape[0], inputs["dst_N"])
        hidden_RD = hidden_RD.at[dst_N].set(x_ND, mode="drop")

        def logits_and_sample():
            s = inputs["sampling"]
            logits_SV = model.compute_logits(x_ND[inputs["sample_rows_S"]])
            tokens_S = sample(logits_SV, s["temperature"], s["top_k"], s["top_p"], s["seed_S2"],
                              s["position"])
            return jnp.pad(tokens_S, (0, R - tokens_S.shape[0]))

        tokens_R = jax.lax.cond(inputs["do_sample"], logits_and_sample,
                                lambda: jnp.zeros((R,), jnp.int32))
        return kv_pages, hidden_RD, {"tokens_R": tokens_R, "experts_activated": activated}

    return step


def empty_inputs(spec: StepSpec, N: int) -> dict:
    """The inputs of an N-row call with no real row (numpy): the lowering example, and
    the template the executor fills."""
    B, C = spec.seqs_for(N), spec.pages_per_seq
    i32 = lambda n, v=0: np.full(n, v, np.int32)
    return {
        "units": i32(2),
        "decode_only": np.bool_(False),
        "tokens_N": i32(N),
        "src_N": i32(N, -1),
        "dst_N": i32(N, -1),
        "prev_rows_N": i32(N, -1),
        "prev_tokens_R": i32(spec.max_num_seqs),
        "meta": AttentionMetadata(
            positions_T=i32(N), slots_T=i32(N, -1), query_start_B1=i32(B + 1),
            seq_lens_B=i32(B), page_table_BC=np.zeros((B, C), np.int32), num_seqs=np.int32(0)),
        "do_sample": np.bool_(False),
        "sample_rows_S": i32(B),
        "sampling": {"temperature": np.zeros(B, np.float32), "top_k": i32(B),
                     "top_p": np.ones(B, np.float32), "seed_S2": np.zeros((B, 2), np.uint32),
                     "position": i32(B)},
    }
