"""Expert parallelism proper: each routed row goes to the shard that owns its expert.

`sharded_moe_ffn` splits the experts over the "expert" mesh axis: ep shards of
E_local = E / ep experts each. It runs a MoE layer by one of two schemes
(`moe_dispatch` of `KernelBackends`):

* "allreduce": tokens stay replicated, every shard routes all T tokens, runs its
  experts on the rows routed to them and the [T, D] float32 partial outputs are
  psum'ed (`sharded_kernels._local_experts_moe`).
* "all_to_all" (this file): tokens are split over the shards, and only the routed
  rows travel, once there and once back:

      x_TD (replicated)   pad T to T_pad = ep * t; shard i keeps tokens [i t, (i+1) t)
      x_tD, logits_tE     route over all E experts (moe.ref.route with the layer's
                          Router and correction bias, as every scheme)
      rows_RD             R = t * A (token, slot) rows sorted by expert id: one run per
                          owner (expert // E_local), sorted by the owner's local experts
      counts_SXE          all_gather of every shard's rows per expert ([E] int32 each):
                          every shard derives the same `_Plan` of sizes and offsets
        -- transport -->  each row to its owner only; the owner reads the rows' local
                          experts off the plan (runs are sorted), so no id travels
      owner               moe.moe_ffn on the rows it received, one row per (token, slot):
                          top-1 on one-hot logits (weight exactly 1), empty rows masked;
                          GPT-OSS: the owner's expert biases and clamped SwiGLU, so a
                          row comes back with its down bias, weighted at the combine
        <-- transport --  the output rows back to their source, into the same positions
      y_tD                combine: the routing weights times the rows, summed in float32
      y_TD                all_gather over "expert" (tiled): every shard holds all tokens,
                          as attention (tensor parallel, replicated over "expert") needs

  Padding tokens (token_mask_T false, and the pad up to T_pad) send nothing.

Transports, one signature (`_ragged_round_trip`, `_capacity_round_trip`):

* "ragged" (GPU, TPU): `lax.ragged_all_to_all` moves exactly the rows, there and
  back. The receive buffer is sized for the worst case, every shard's rows to one
  owner: ep * t * min(A, E_local) rows (a token sends an owner at most min(A, E_local)
  rows). The kernels compute only the rows received.
* "capacity" (CPU: XLA:CPU has no ragged-all-to-all): `lax.all_to_all` of a fixed
  [ep, C, D] block per round, C = ceil(capacity_factor * R / ep) rows per (source,
  owner). Nothing is dropped: rounds repeat in a `lax.while_loop` until the longest
  run has been sent; every shard reads the same round count off the plan, so all run
  the same collectives.
* "ref_ragged": "ragged" with `ref_ragged_all_to_all` (all_gather + gathers), for
  testing the ragged offsets on CPU.

"auto" picks allreduce or all_to_all per call at trace time (T is static) from the
communication bytes per layer: `dispatch_bytes.fewer_bytes`. With
ep == 1 (no expert axis, or it does not divide E) there is nothing to dispatch.

Stats are the same under both schemes: tokens_per_expert [E] is the sum of the
gathered counts, and `moe_stats` derives experts_activated and expert_bytes_loaded
from it as moe_ffn does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lp_jax.models.dispatch_bytes import fewer_bytes
from pallas_kernels import moe
from pallas_kernels.moe.ref import SILU, SOFTMAX, MoEActivation, Router, combine, route

DISPATCHES = ("allreduce", "all_to_all", "auto")
TRANSPORTS = ("ragged", "capacity", "ref_ragged")
CAPACITY_FACTOR = 2.0


def mesh_platform(mesh) -> str:
    """"cpu", "gpu" or "tpu": the platform of the mesh's devices (also for an
    AbstractMesh, and for compile-only TPU devices)."""
    device = getattr(mesh, "abstract_device", None)
    if device is not None:
        platform = device.platform
    elif hasattr(mesh, "devices"):
        platform = mesh.devices.flat[0].platform
    else:
        platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def default_transport(mesh) -> str:
    return "capacity" if mesh_platform(mesh) == "cpu" else "ragged"


def resolve_dispatch(dispatch: str, *, ep: int, tokens: int, hidden: int, top_k: int,
                     act_bytes: int, transport: str, reduce_bytes: int = 4) -> str:
    """"allreduce" or "all_to_all": what `dispatch` means for this call. ep == 1 is
    "allreduce" (no collective at all: the single-shard path). `reduce_bytes`: the width
    the all-reduce runs at (float32; TPU's compiler reduces at the activation width)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown moe_dispatch {dispatch!r}; expected one of {DISPATCHES}")
    if ep == 1:
        return "allreduce"
    if dispatch != "auto":
        return dispatch
    transport = "ragged" if transport == "ref_ragged" else transport
    return fewer_bytes(tokens, hidden, top_k, ep, act_bytes=act_bytes, transport=transport,
                       reduce_bytes=reduce_bytes)


# ------------------------------------------------------------------ transports
def ref_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                          recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all` built from all_gather and gathers (runs on CPU).

    Same arguments and result: slice i of a sender (operand[input_offsets[i]:][:send_sizes[i]])
    goes to shard i // k (k = len(input_offsets) / axis size) and lands at
    output_offsets[i] of that shard's result; the rest of `output` is kept. Every shard
    gathers every operand, so it is a reference, not a fast path.
    """
    ep = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    k = input_offsets.shape[0] // ep
    operand_X, in_off_XN, out_off_XN = (jax.lax.all_gather(a, axis_name)  # [ep, ...]
                                        for a in (operand, input_offsets, output_offsets))
    # Incoming slice j = s * k + c is sender s's slice me * k + c; its size is recv_sizes[j].
    pick = lambda a_XN: jax.lax.dynamic_slice_in_dim(a_XN, me * k, k, axis=1).reshape(ep * k)
    src_J, start_J, dst_J = jnp.arange(ep * k) // k, pick(in_off_XN), pick(out_off_XN)
    p_O = jnp.arange(output.shape[0])
    hit_JO = (p_O >= dst_J[:, None]) & (p_O < (dst_J + recv_sizes)[:, None])
    j_O = jnp.argmax(hit_JO, axis=0)
    row_O = jnp.clip(start_J[j_O] + p_O - dst_J[j_O], 0, operand.shape[0] - 1)
    received = operand_X[src_J[j_O], row_O]
    hit_O = jnp.any(hit_JO, axis=0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(hit_O, received, output)


class _Plan(NamedTuple):
    """Where every row goes, from all shards' row counts (one all_gather of [E] int32).

    Each shard sorts its rows by expert id, so its rows for owner X form one run, sorted
    by X's local experts; an owner's receive buffer holds the sources' runs in source
    order. Seen from shard `me`:
    """

    counts_SE: jax.Array  # [ep, E_local] rows source S sends to my local expert E
    send_sizes_X: jax.Array  # my rows for owner X ...
    input_offsets_X: jax.Array  # ... start there in my rows_RD
    output_offsets_X: jax.Array  # ... and there in X's receive buffer
    recv_sizes_S: jax.Array  # rows source S sends me ...
    recv_offsets_S: jax.Array  # ... start there in my receive buffer
    back_offsets_S: jax.Array  # ... and sat there in S's rows_RD
    max_run: jax.Array  # the most rows any source sends any owner


def _plan(counts_SXE: jax.Array, me) -> _Plan:
    sizes_SX = jnp.sum(counts_SXE, axis=-1)
    in_off_SX = jnp.cumsum(sizes_SX, axis=1) - sizes_SX  # runs in a source's rows
    out_off_SX = jnp.cumsum(sizes_SX, axis=0) - sizes_SX  # runs in an owner's buffer
    return _Plan(counts_SXE[:, me], sizes_SX[me], in_off_SX[me], out_off_SX[me],
                 sizes_SX[:, me], out_off_SX[:, me], in_off_SX[:, me], jnp.max(sizes_SX))


def _received_ids(counts_SE, s, j):
    """Local expert of row j of source s's run to me (-1 past its end): the runs are
    sorted by expert, so no expert id has to travel with the rows."""
    ends_E = jnp.cumsum(counts_SE, axis=1)[s]
    return jnp.where(j < ends_E[..., -1], jnp.sum(ends_E <= j[..., None], axis=-1), -1)


def _ragged_round_trip(rows_RD, plan: _Plan, experts_fn, *, axis, ep, max_rows_per_owner,
                       capacity_factor, a2a):
    """Rows to their owners and back with ragged all-to-alls (exact rows).

    experts_fn(rows_QD, local_ids_Q) -> y_QD; Q is the receive buffer, rows with local
    id -1 are empty. Returns y_RD in rows_RD's order (rows sent nowhere: 0)."""
    del capacity_factor
    R, D = rows_RD.shape
    Q = ep * max_rows_per_owner
    recv_QD = a2a(rows_RD, jnp.zeros((Q, D), rows_RD.dtype), plan.input_offsets_X,
                  plan.send_sizes_X, plan.output_offsets_X, plan.recv_sizes_S, axis_name=axis)
    q_Q = jnp.arange(Q, dtype=jnp.int32)
    s_Q = jnp.minimum(jnp.searchsorted(plan.recv_offsets_S + plan.recv_sizes_S, q_Q,
                                       side="right"), ep - 1)
    ids_Q = _received_ids(plan.counts_SE, s_Q, q_Q - plan.recv_offsets_S[s_Q])
    y_QD = experts_fn(recv_QD, ids_Q)
    # Back: each source's rows return to where they sat in its rows_RD.
    return a2a(y_QD, jnp.zeros((R, D), y_QD.dtype), plan.recv_offsets_S, plan.recv_sizes_S,
               plan.back_offsets_S, plan.send_sizes_X, axis_name=axis)


def _capacity_round_trip(rows_RD, plan: _Plan, experts_fn, *, axis, ep, max_rows_per_owner,
                         capacity_factor, a2a=None):
    """Rows to their owners and back with fixed-size all-to-alls, C rows per (source,
    owner) per round, as many rounds as the longest run needs (every shard computes the
    same count from the same plan). Same contract as `_ragged_round_trip`."""
    del max_rows_per_owner, a2a
    R, D = rows_RD.shape
    C = max(1, math.ceil(capacity_factor * R / ep))
    exchange = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
    s_S1 = jnp.arange(ep, dtype=jnp.int32)[:, None]

    def one_round(carry):
        r, y_RD = carry
        j_C = r * C + jnp.arange(C, dtype=jnp.int32)
        # Round r sends rows [r C, (r + 1) C) of each run; R marks "none".
        src_XC = jnp.where(j_C < plan.send_sizes_X[:, None],
                           plan.input_offsets_X[:, None] + j_C, R)
        recv_SCD = exchange(rows_RD.at[src_XC].get(mode="fill", fill_value=0))
        ids_SC = _received_ids(plan.counts_SE, s_S1, jnp.broadcast_to(j_C, (ep, C)))
        y_QD = experts_fn(recv_SCD.reshape(ep * C, D), ids_SC.reshape(ep * C))
        y_XCD = exchange(y_QD.reshape(ep, C, D))
        return r + 1, y_RD.at[src_XC].set(y_XCD.astype(y_RD.dtype), mode="drop")

    rounds = -(-plan.max_run // C)
    init = (jnp.int32(0), jnp.zeros((R, D), rows_RD.dtype))
    return jax.lax.while_loop(lambda c: c[0] < rounds, one_round, init)[1]


def _transport(name: str):
    if name == "capacity":
        return _capacity_round_trip, None
    if name == "ragged":
        return _ragged_round_trip, jax.lax.ragged_all_to_all
    if name == "ref_ragged":
        return _ragged_round_trip, ref_ragged_all_to_all
    raise ValueError(f"unknown transport {name!r}; expected one of {TRANSPORTS}")


# -------------------------------------------------------- dispatch and combine
def _owner_experts(w_gate_up, w_down, layer, *, backend, interpret, biases=(),
                   activation: MoEActivation = SILU, scales=(), scheme=None):
    """experts_fn for the transports: moe_ffn on received rows, one row per (token, slot).
    biases: () or this shard's (b_gate_up, b_down); activation: as in moe_ffn; scales:
    () or this shard's (s_gate_up, s_down) of quantized weights, with their scheme. A row's
    output includes its expert's down bias; the source weights it by the routing when
    it combines."""
    E_local = w_gate_up.shape[-3]

    def experts_fn(rows_QD, local_ids_Q):
        valid_Q = local_ids_Q >= 0
        # Empty rows point at expert 0 (not -inf everywhere: softmax would give NaN); the
        # mask keeps them out of every group.
        ids_Q = jnp.where(valid_Q, local_ids_Q, 0)
        logits_QE = jnp.where(ids_Q[:, None] == jnp.arange(E_local), 0.0, -jnp.inf)
        y_QD, _ = moe.moe_ffn(rows_QD, logits_QE, w_gate_up, w_down, layer=layer, top_k=1,
                              norm_topk_prob=False, backend=backend, token_mask_T=valid_Q,
                              interpret=interpret, biases=biases, activation=activation,
                              scales=tuple(scales) or None, scheme=scheme)
        return y_QD

    return experts_fn


def all_to_all_moe(x_tD, router_logits_tE, token_mask_t, w_gate_up, w_down, layer, *, axis,
                   top_k, norm_topk_prob, backend, interpret, transport,
                   capacity_factor=CAPACITY_FACTOR, biases=(),
                   activation: MoEActivation = SILU, scales=(), scheme=None,
                   router: Router = SOFTMAX, correction_bias_E=None):
    """One shard's part of the all_to_all scheme, inside shard_map over `axis`.

    x_tD, router_logits_tE, token_mask_t: this shard's t tokens (logits over all E
    experts); weights: the shard's E_local experts ([E_local, ...] or [L, E_local, ...]
    with `layer`), and GPT-OSS's biases and activation likewise (`_owner_experts`;
    they stay with their owner, only rows travel). `router` and `correction_bias_E`
    (the [E] bias, replicated): the routing variant, as in moe_ffn. Returns (y_tD float32 for this
    shard's tokens, tokens_per_expert [E] over all shards' tokens, the same on every
    shard).
    """
    t = x_tD.shape[0]
    A = top_k
    ep = jax.lax.axis_size(axis)
    E_local = w_gate_up.shape[-3]
    E = ep * E_local
    weights_tA, expert_ids_tA = route(router_logits_tE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    valid_R = jnp.repeat(token_mask_t.astype(bool), A)
    ids_R = jnp.where(valid_R, expert_ids_tA.reshape(t * A), E)  # E: sent nowhere, sorts last
    # Sorted by expert: one run per owner, sorted by the owner's local experts.
    order_R = jnp.argsort(ids_R, stable=True).astype(jnp.int32)
    counts_E = jnp.bincount(ids_R, length=E + 1)[:E].astype(jnp.int32)
    counts_SXE = jax.lax.all_gather(counts_E.reshape(ep, E_local), axis)
    plan = _plan(counts_SXE, jax.lax.axis_index(axis))

    round_trip, a2a = _transport(transport)
    y_RD = round_trip(
        x_tD[order_R // A], plan,
        _owner_experts(w_gate_up, w_down, layer, backend=backend, interpret=interpret,
                       biases=biases, activation=activation, scales=scales, scheme=scheme),
        axis=axis, ep=ep, max_rows_per_owner=t * min(A, E_local),
        capacity_factor=capacity_factor, a2a=a2a)
    weights_tA = jnp.where(token_mask_t[:, None], weights_tA, 0.0)
    tokens_per_expert_E = jnp.sum(counts_SXE, axis=0).reshape(E)
    return combine(y_RD, order_R, weights_tA, t), tokens_per_expert_E
