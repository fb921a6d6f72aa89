"""Run a Pallas kernel per shard of the mesh: `jax.shard_map` wrappers for the model.

GSPMD cannot partition a `pallas_call`: given sharded operands it gathers them whole
onto every device (the KV pool, the expert weights) and runs the kernel replicated.
Under a multi-device mesh the model therefore calls its Pallas kernels through these
wrappers, which run the per-device kernel inside `jax.shard_map` on the shards the
operands already have. The "xla" backends stay under GSPMD and come here only for
the MoE's all_to_all dispatch (`expert_dispatch`), which is explicit communication.

Where the mesh comes from. The model holds no mesh, and its callers (`ModelRunner`,
`simple.greedy_generate`) jit it without a mesh context: the mesh lives in the
NamedShardings the loader gave the parameters. In jax 0.11 a traced array's type
keeps the mesh of its sharding (`jax.typeof(w).sharding.mesh`, an AbstractMesh, also
for Auto axes), and `jax.shard_map` accepts an AbstractMesh inside jit. So
`kernel_mesh(w)` reads the mesh off the weight a kernel is about to use: no caller
has to enter `jax.set_mesh` (without which `jax.sharding.get_abstract_mesh()` is
empty), and the mesh cannot disagree with where the weights are. An array on one
device has an empty mesh, which means "call the kernel directly". Under data-parallel
attention the attention wrappers run inside `data_ranks.per_rank`'s shard_map (manual
over "data"), and `kernel_mesh` gives them the context's mesh instead, so their
shard_map nests in it: each rank's kernels see its rows and its pool shard.

Specs follow `sharding.LOGICAL_RULES`, so they match the shardings the loader and
the runner give the operands, and entering the shard_map moves no data:

* attention: the query heads of q_TNH and the J axis of kv_pages_PSJH [P, S, 2K, H]
  split over the heads' mesh axis ("tensor", t devices). Contiguous shards stay
  consistent: K and V of KV head k sit at J = 2k, 2k + 1 and query head n reads KV
  head n // G, so shard d holds query heads [d N/t, (d+1) N/t) and exactly the KV
  heads they read. A kernel needs whole (K, V) pairs, so heads are split only when
  t divides the pool's KV heads; otherwise the kernel runs replicated. With more
  devices than KV heads the pool holds t / K copies of each (`kv_cache.py`), so t
  divides them and each shard holds one. Page tables and lengths are
  replicated. `write_kv` stays under GSPMD: its scatter keeps the pool's sharding.
* MoE: expert weights [E, D, 2F] / [E, F, D], or the stacked [L, E, D, 2F] /
  [L, E, F, D] with a layer index, split over the experts' mesh axes ("expert" and
  "tensor", `sharding.mesh_axes`) on their E axis (when they divide E; otherwise
  replicated), and GPT-OSS's expert biases [(L,) E, 2F] / [(L,) E, D] with them;
  tokens replicated ("allreduce") or split over the same axes
  ("all_to_all"); see `sharded_moe_ffn`. `model_moe_ffn` is the models' one entry:
  it picks the mesh and the scheme for a layer.

Every shard_map runs with check_vma=False: the kernels declare their outputs with
plain `jax.ShapeDtypeStruct`s, which check_vma=True rejects inside shard_map
(it wants their varying mesh axes spelled out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lp_jax.models.expert_dispatch import (
    CAPACITY_FACTOR,
    all_to_all_moe,
    default_transport,
    mesh_platform,
    resolve_dispatch,
)
from lp_jax.sharding import axes_size, axis_dividing
from pallas_kernels import attention, moe
from pallas_kernels.moe.ref import (
    SILU,
    SOFTMAX,
    MoEActivation,
    Router,
    check_bias,
    combine,
    moe_stats,
    route,
)

PALLAS_MOE_BACKENDS = ("tpu", "gpu")


def kernel_mesh(x: jax.Array) -> Mesh | AbstractMesh | None:
    """The mesh a kernel's shard_map runs on: that of x (read from its type, so also
    under jit) when it spans more than one device; None otherwise.

    Inside a shard_map that is already manual over some axes (`data_ranks.per_rank`,
    manual over "data"), the context's mesh, whose manual axes x's type does not show:
    a nested shard_map on it splits over the axes still free. It runs even when those
    span one device (DP d x TP 1), so that the kernel is manual over every axis: a
    kernel called beside automatic axes is not partitioned as one (the Pallas
    interpreter's callbacks refuse it)."""
    context = jax.sharding.get_abstract_mesh()
    if context.manual_axes:
        return context
    mesh = jax.typeof(x).sharding.mesh
    return mesh if mesh.size > 1 else None


def is_pallas_attention(backend: str) -> bool:
    return attention.resolve_backend(backend) != "xla"


def is_pallas_moe(backend: str) -> bool:
    return moe.resolve_backend(backend) in PALLAS_MOE_BACKENDS


def resolve_moe_dispatch(mesh, dispatch: str, x_TD, w_gate_up, top_k: int,
                         transport: str | None = None) -> str:
    """"allreduce" or "all_to_all": the scheme `sharded_moe_ffn(mesh, ...)` runs for
    `dispatch` on these operands ("auto" asks `expert_dispatch.resolve_dispatch`).
    "allreduce" when mesh is None or the expert axis does not split the experts."""
    experts = None if mesh is None else axis_dividing("experts", w_gate_up.shape[-3], mesh)
    act_bytes = jnp.dtype(x_TD.dtype).itemsize
    # The allreduce path psums float32 partials, but TPU's compiler moves the cast to the
    # activation dtype ahead of the all-reduce (compiled HLO, launch/bench_ep_comm.py).
    tpu = mesh is not None and mesh_platform(mesh) == "tpu"
    return resolve_dispatch(
        dispatch, ep=1 if experts is None else axes_size(experts, mesh), tokens=x_TD.shape[0],
        hidden=x_TD.shape[1], top_k=top_k, act_bytes=act_bytes,
        transport=transport or (default_transport(mesh) if mesh is not None else "ragged"),
        reduce_bytes=act_bytes if tpu else 4)


# ------------------------------------------------------------------ attention
def _head_specs(mesh, q_xNH, kv_pages_PSJH: jax.Array) -> tuple[P, P]:
    """(spec of q and of the output, spec of the KV pool): both split over the KV heads
    (dim 2 of the pool: 2K interleaved, or K in the packed [P, S, K, 2H] form)."""
    J = kv_pages_PSJH.shape[2] * (2 if attention.is_packed(q_xNH, kv_pages_PSJH) else 1)
    heads = axis_dividing("kv_combined_heads", J, mesh)
    return P(None, heads, None), P(None, None, heads, None)


def _sharded_attention(kernel, mesh, q_xNH, kv_pages_PSJH, rest, sinks_N, sliding_window,
                       k_scale=None, v_scale=None):
    """kernel(q, kv, *rest, sinks_N=, sliding_window=, k_scale=, v_scale=) on each head
    shard of `mesh` (called directly when `mesh` is None): the sinks split with the query
    heads, the window and an FP8 pool's scales (traced scalars) replicated; each passed
    only when given."""
    extras = {k: v for k, v in (("sinks_N", sinks_N), ("sliding_window", sliding_window),
                                ("k_scale", k_scale), ("v_scale", v_scale))
              if v is not None}
    if mesh is None:
        return kernel(q_xNH, kv_pages_PSJH, *rest, **extras)
    q_spec, kv_spec = _head_specs(mesh, q_xNH, kv_pages_PSJH)
    names = tuple(extras)
    specs = {"sinks_N": P(q_spec[1]), "sliding_window": P(), "k_scale": P(), "v_scale": P()}

    def per_shard(q, kv, *args):
        n = len(args) - len(names)
        return kernel(q, kv, *args[:n], **dict(zip(names, args[n:], strict=True)))

    return jax.shard_map(
        per_shard, mesh=mesh,
        in_specs=(q_spec, kv_spec, *(P() for _ in rest), *(specs[k] for k in names)),
        out_specs=q_spec, check_vma=False)(
        q_xNH, kv_pages_PSJH, *rest,
        *(jnp.asarray(extras[k], jnp.int32) if k == "sliding_window"
          else jnp.asarray(extras[k], jnp.float32) if k in ("k_scale", "v_scale")
          else extras[k] for k in names))


def sharded_ragged_paged_attention(mesh, q_TNH, kv_pages_PSJH, query_start_B1, seq_lens_B,
                                   page_table_BC, num_seqs, *, sm_scale, backend,
                                   sinks_N=None, sliding_window=None, k_scale=None,
                                   v_scale=None):
    """`attention.ragged_paged_attention` run on each head shard of `mesh` (called
    directly when `mesh` is None)."""
    kernel = functools.partial(attention.ragged_paged_attention, sm_scale=sm_scale,
                               backend=backend)
    rest = (query_start_B1, seq_lens_B, page_table_BC, jnp.asarray(num_seqs, jnp.int32))
    return _sharded_attention(kernel, mesh, q_TNH, kv_pages_PSJH, rest, sinks_N,
                              sliding_window, k_scale, v_scale)


def sharded_decode_attention(mesh, q_BNH, kv_pages_PSJH, seq_lens_B, page_table_BC, *,
                             sm_scale, backend, sinks_N=None, sliding_window=None,
                             k_scale=None, v_scale=None):
    """`attention.decode_attention` run on each head shard of `mesh` (called directly
    when `mesh` is None)."""
    kernel = functools.partial(attention.decode_attention, sm_scale=sm_scale, backend=backend)
    return _sharded_attention(kernel, mesh, q_BNH, kv_pages_PSJH, (seq_lens_B, page_table_BC),
                              sinks_N, sliding_window, k_scale, v_scale)


# ------------------------------------------------------------------------ MoE
def model_moe_ffn(x_TD, router_logits_TE, w_gate_up, w_down, *, layer, top_k,
                  norm_topk_prob, backend, moe_dispatch, token_mask_T, biases=None,
                  activation: MoEActivation = SILU, scales=None, scheme=None,
                  router: Router = SOFTMAX, correction_bias_E=None, scatter_rows=False):
    """A model layer's MoE (Qwen3, GPT-OSS): the whole stacked expert weights (and
    GPT-OSS's biases, with its activation: as in moe_ffn) and the layer index go to the
    kernels, which address the layer themselves. On a multi-device mesh, read off the weights, a
    Pallas kernel runs per expert shard, and so does any backend under the all_to_all
    dispatch; the xla backends under allreduce stay under GSPMD.

    Quantized experts: `scales` (s_gate_up, s_down) and `scheme` (pallas_kernels.quant), as
    in moe_ffn; on a mesh they split over the experts' axes with the weights, under either
    dispatch. `router` and `correction_bias_E` (the routing variant, moe.ref.route): as
    in moe_ffn, every shard routing with them. `scatter_rows`: the output rows stay
    split over the experts' axis (the row-split residual stream, sequence_parallel.py)."""
    mesh = kernel_mesh(w_gate_up)
    dispatch = resolve_moe_dispatch(mesh, moe_dispatch, x_TD, w_gate_up, top_k)
    if dispatch == "allreduce" and not is_pallas_moe(backend):
        if mesh is not None and dict(mesh.shape).get("data", 1) > 1:
            # Rows split over the data ranks (data-parallel attention): gather the T x D
            # rows once, rather than let GSPMD all-reduce every expert-sorted row it
            # would gather from the split ones.
            whole = NamedSharding(mesh, P())
            x_TD, router_logits_TE = (jax.lax.with_sharding_constraint(a, whole)
                                      for a in (x_TD, router_logits_TE))
            if token_mask_T is not None:
                token_mask_T = jax.lax.with_sharding_constraint(token_mask_T, whole)
        mesh = None
    return sharded_moe_ffn(
        mesh, x_TD, router_logits_TE, w_gate_up, w_down, layer=layer, top_k=top_k,
        norm_topk_prob=norm_topk_prob, backend=backend, token_mask_T=token_mask_T,
        dispatch=dispatch, biases=biases, activation=activation, scales=scales,
        scheme=scheme, router=router, correction_bias_E=correction_bias_E,
        scatter_rows=scatter_rows)


def _local_experts_moe(x_TD, router_logits_TE, w_gate_up, w_down, expert_offset, layer, *,
                       top_k, norm_topk_prob, token_mask_T, backend, interpret,
                       biases=(), activation: MoEActivation = SILU, scales=None,
                       scheme=None, router: Router = SOFTMAX, correction_bias_E=None):
    """The part of `moe.moe_ffn` computed by one shard's experts.

    The weights (and biases) hold the shard's E_local experts ([E_local, ...], or the
    stacked [L, E_local, ...] with `layer`), global ids [expert_offset, expert_offset +
    E_local); router_logits_TE covers all experts. Routing runs over all of them
    with `moe.ref.route`, as in moe_ffn, so every shard agrees on each token's
    experts and weights. Each (token, slot) pair then becomes one row, routed top-1
    to its expert's local index (logit 0 there and -inf elsewhere, so its weight is
    exactly 1); rows whose expert lives on another shard, and rows of padding tokens,
    are masked out, so the kernel reads only the weights of local experts that have
    rows. The rows are combined back to tokens with the routing weights in float32
    (a row's output, down bias included, times its weight: as in moe_ffn).

    Returns (this shard's part of y_TD in float32, tokens_per_expert [E_local]).
    """
    T = x_TD.shape[0]
    E_local = w_gate_up.shape[-3]
    weights_TA, expert_ids_TA = route(router_logits_TE, top_k, norm_topk_prob, router,
                                      correction_bias_E)
    local_ids_TA = expert_ids_TA - expert_offset
    mine_TA = (local_ids_TA >= 0) & (local_ids_TA < E_local) & token_mask_T[:, None]
    # Rows of other shards point at local expert 0; they are masked out anyway.
    local_ids_R = jnp.where(mine_TA, local_ids_TA, 0).reshape(T * top_k)
    local_logits_RE = jnp.where(local_ids_R[:, None] == jnp.arange(E_local), 0.0, -jnp.inf)
    y_RD, stats = moe.moe_ffn(
        jnp.repeat(x_TD, top_k, axis=0), local_logits_RE, w_gate_up, w_down, layer=layer,
        top_k=1, norm_topk_prob=False, backend=backend,
        token_mask_T=mine_TA.reshape(T * top_k), interpret=interpret, biases=biases,
        activation=activation, scales=scales, scheme=scheme,
    )
    weights_TA = jnp.where(mine_TA, weights_TA, 0.0)
    y_TD = combine(y_RD, jnp.arange(T * top_k, dtype=jnp.int32), weights_TA, T)
    return y_TD, stats["tokens_per_expert"]


def sharded_moe_ffn(mesh, x_TD, router_logits_TE, w_gate_up, w_down, *, layer=None, top_k,
                    norm_topk_prob, backend, token_mask_T=None, interpret=None,
                    dispatch="allreduce", capacity_factor=CAPACITY_FACTOR, _transport=None,
                    biases=None, activation: MoEActivation = SILU, scales=None, scheme=None,
                    router: Router = SOFTMAX, correction_bias_E=None, scatter_rows=False):
    """`moe.moe_ffn` with the experts split over the experts' mesh axes (called
    directly when `mesh` is None).

    Weights as in moe_ffn: [E, D, 2F] / [E, F, D] with layer=None, or the stacked
    [L, E, D, 2F] / [L, E, F, D] with `layer`, split on their E axis (dim 1 when
    stacked): each shard addresses the layer inside its own shard, no weight copy.
    `biases` (None or (b_gate_up, b_down)) and `activation`: GPT-OSS's, as in moe_ffn;
    the biases are split like the weights, as operands beside them. `scales` and `scheme`
    (quantized experts, as in moe_ffn): the scales split like the weights too.
    `router` and `correction_bias_E` (moe.ref.route): every shard routes with them; the
    [E] bias travels replicated.

    Returns moe_ffn's (y_TD, stats), stats as global figures, the same under both
    schemes: tokens_per_expert over all E experts, and the rest derived from it by
    `moe_stats`, as moe_ffn does (expert_bytes_loaded: each activated expert's bytes
    once, summed over the expert shards: what one device holding them all would read).

    `dispatch` (see `expert_dispatch`, and `resolve_moe_dispatch` for "auto"):
    * "allreduce": tokens (and router logits) are replicated over those axes: every
      device routes all T tokens, runs its local experts on the rows routed to them
      (`_local_experts_moe`) and the partial outputs are psum'ed (T x D float32).
    * "all_to_all": each device routes T / ep of the tokens and sends each (token,
      slot) row only to the device owning its expert (`expert_dispatch.all_to_all_moe`);
      the outputs come back, are combined, and all_gather'ed over the axes.
    With ep == 1 (the axis is absent or does not divide E) both are the same: the
    kernel runs on whole experts on every device, with no collective.
    `scatter_rows` (T a multiple of the experts' shards): the output is left split over
    the experts' axis by rows, shard i holding rows [i T/ep, (i+1) T/ep): "allreduce"
    reduce-scatters (psum_scatter) the partial outputs, in x's dtype, where it would psum
    them in float32; "all_to_all" skips its all_gather.
    `capacity_factor` sizes the CPU transport's rounds; `_transport` ("ragged",
    "capacity", "ref_ragged"; None: by the mesh's platform) is for tests.
    """
    biases = tuple(biases or ())  # operands that travel through shard_map
    check_bias(biases, w_gate_up, w_down)
    scales = tuple(scales or ())
    if mesh is None:
        return moe.moe_ffn(x_TD, router_logits_TE, w_gate_up, w_down, layer=layer,
                           top_k=top_k, norm_topk_prob=norm_topk_prob, backend=backend,
                           token_mask_T=token_mask_T, interpret=interpret, biases=biases,
                           activation=activation, scales=scales or None, scheme=scheme,
                           router=router, correction_bias_E=correction_bias_E)
    T = x_TD.shape[0]
    experts = axis_dividing("experts", w_gate_up.shape[-3], mesh)
    transport = _transport or default_transport(mesh)
    dispatch = resolve_moe_dispatch(mesh, dispatch, x_TD, w_gate_up, top_k, transport)
    if token_mask_T is None:
        token_mask_T = jnp.ones((T,), bool)
    # The layer index travels as a replicated operand (it may be a loop counter).
    layer_args = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    # Replicated operands after the layer: the router's correction bias, if any.
    layer_args += () if correction_bias_E is None else (correction_bias_E,)
    nl = 0 if layer is None else 1
    w_spec = P(experts, None, None) if layer is None else P(None, experts, None, None)
    b_spec = P(experts, None) if layer is None else P(None, experts, None)
    # The shard-split operands after the tokens: weights, biases, scales; then the layer.
    split_args = (w_gate_up, w_down, *biases, *scales)
    split_specs = (w_spec, w_spec, *(b_spec for _ in biases), *(w_spec for _ in scales))
    nb = len(biases)
    if dispatch == "all_to_all":
        return _all_to_all_moe_ffn(
            mesh, experts, x_TD, router_logits_TE, token_mask_T, split_args, split_specs,
            layer_args, nb, nl, top_k=top_k, norm_topk_prob=norm_topk_prob,
            backend=backend, interpret=interpret, transport=transport,
            capacity_factor=capacity_factor, activation=activation, scheme=scheme,
            router=router, scatter_rows=scatter_rows)

    def per_shard(x_TD, router_logits_TE, token_mask_T, w_gate_up, w_down, *rest):
        biases, scales_ = rest[:nb], rest[nb:len(split_args) - 2]
        layer_arg = rest[len(split_args) - 2:][:nl]
        bias_arg = rest[len(split_args) - 2 + nl:]
        E_local = w_gate_up.shape[-3]
        offset = 0 if experts is None else jax.lax.axis_index(experts) * E_local
        y_TD, tokens_per_expert_E = _local_experts_moe(
            x_TD, router_logits_TE, w_gate_up, w_down, offset,
            layer_arg[0] if layer_arg else None,
            top_k=top_k, norm_topk_prob=norm_topk_prob, token_mask_T=token_mask_T,
            backend=backend, interpret=interpret, biases=biases, activation=activation,
            scales=scales_ or None, scheme=scheme, router=router,
            correction_bias_E=bias_arg[0] if bias_arg else None)
        if rows is not None:
            y_TD = jax.lax.psum_scatter(y_TD.astype(x_TD.dtype), experts,
                                        scatter_dimension=0, tiled=True)
        elif experts is not None:
            y_TD = jax.lax.psum(y_TD, experts)
        return y_TD.astype(x_TD.dtype), tokens_per_expert_E

    rows = experts if scatter_rows and experts is not None else None
    y_TD, tokens_per_expert_E = jax.shard_map(
        per_shard, mesh=mesh,
        in_specs=(P(), P(), P(), *split_specs, *(P() for _ in layer_args)),
        out_specs=(P(rows), P(experts)), check_vma=False,
    )(x_TD, router_logits_TE, token_mask_T, *split_args, *layer_args)
    return y_TD, moe_stats(tokens_per_expert_E, w_gate_up, w_down, *biases, scales=scales)


def _all_to_all_moe_ffn(mesh, experts, x_TD, router_logits_TE, token_mask_T, split_args,
                        split_specs, layer_args, nb, nl, scatter_rows=False, **kw):
    """The "all_to_all" scheme: T padded to a multiple of ep and split over `experts`
    (shard i takes tokens [i t, (i+1) t)); the outputs all_gather'ed back to [T, D].
    split_args: the weights, then the `nb` biases and the scales, if any, split over
    `experts` (scales and biases stay with their experts; only rows travel). layer_args:
    the `nl` layer index (0 or 1) and then the router's correction bias, if any.
    `scatter_rows`: the outputs stay on their shards (no all_gather; T a multiple of ep)."""
    T = x_TD.shape[0]
    pad = -T % axes_size(experts, mesh)
    if scatter_rows and pad:
        raise ValueError(f"scatter_rows needs the {T} rows to split evenly over {experts}")
    x_TD_pad = jnp.pad(x_TD, ((0, pad), (0, 0)))
    logits_TE_pad = jnp.pad(router_logits_TE, ((0, pad), (0, 0)))
    mask_T_pad = jnp.pad(token_mask_T.astype(bool), (0, pad))  # the pad sends nothing

    def per_shard(x_tD, router_logits_tE, token_mask_t, w_gate_up, w_down, *rest):
        biases, scales = rest[:nb], rest[nb:len(split_args) - 2]
        layer_arg = rest[len(split_args) - 2:][:nl]
        bias_arg = rest[len(split_args) - 2 + nl:]
        y_tD, tokens_per_expert_E = all_to_all_moe(
            x_tD, router_logits_tE, token_mask_t, w_gate_up, w_down,
            layer_arg[0] if layer_arg else None, axis=experts, biases=biases,
            scales=scales, correction_bias_E=bias_arg[0] if bias_arg else None, **kw)
        y_tD = y_tD.astype(x_tD.dtype)
        if scatter_rows:
            return y_tD, tokens_per_expert_E
        return jax.lax.all_gather(y_tD, experts, axis=0, tiled=True), tokens_per_expert_E

    tokens = P(experts)
    y_TD, tokens_per_expert_E = jax.shard_map(  # the counts: all experts, on every shard
        per_shard, mesh=mesh,
        in_specs=(tokens, tokens, tokens, *split_specs, *(P() for _ in layer_args)),
        out_specs=(tokens if scatter_rows else P(), P()), check_vma=False,
    )(x_TD_pad, logits_TE_pad, mask_T_pad, *split_args, *layer_args)
    return y_TD[:T], moe_stats(tokens_per_expert_E, *split_args[:2 + nb],
                               scales=split_args[2 + nb:])
