"""Measured recheck of the MoE ridge: sweep a MoE callable over tokens per call.

Design note. The analytic crossing in `ridge` assumes peak FLOP/s and bandwidth. The
real kernel has its own knee: achieved FLOP/s grows with tokens per call (more rows
per expert) until it saturates. `measure_moe_knee` times `moe_fn(x_TD)` for T in powers
of two on the current JAX device, converts each time into achieved FLOP/s and bytes/s
with the cost model's expert FLOPs and bytes (so any kernel is judged by the same useful
work), and reports the knee: the smallest T whose FLOP/s reaches `threshold` of the best.

`moe_fn` is any callable mapping a (T, D) array to the layer output; the engine's MoE
layer (e.g. `pallas_kernels.moe.moe_ffn` with its weights closed over) plugs in as is.
Without one, `make_default_moe` builds a top-k SwiGLU MoE in plain jnp with random
weights (capacity-factor dispatch by default, or dropless `ragged_dot`). The credited
work is always the cost model's useful expert FLOPs and E_act(T) weight bytes, whatever
the kernel actually does (padding, dropped rows, all-expert loads). JAX is imported lazily.
Local axis letter (beyond docs/glossary.md): Z = capacity slots per expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lp_jax.roofline.cost_model import expert_traffic
from lp_jax.roofline.model_shape import ModelShape
from lp_jax.roofline.routing import UNIFORM, Routing


@dataclass(frozen=True, slots=True)
class KneePoint:
    """One measured point: T tokens per call, best wall time, achieved rates."""

    tokens: int
    seconds: float
    flops: float  # useful expert FLOPs per call (cost model)
    bytes: float  # expert weight + routed-row bytes per call (cost model)
    flops_per_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.tokens < 1 or not self.seconds > 0:
            raise ValueError("KneePoint needs tokens >= 1 and seconds > 0")


@dataclass(frozen=True, slots=True)
class KneeResult:
    points: tuple[KneePoint, ...]
    knee_tokens: int  # smallest T reaching threshold * max FLOP/s
    threshold: float
    device: str

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("KneeResult needs at least one point")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")

    @property
    def max_flops_per_s(self) -> float:
        return max(p.flops_per_s for p in self.points)


def default_moe_shape(dtype_bytes: int = 4, *, small: bool = True) -> ModelShape:
    """The default sweep's MoE: tiny on CPU (D=512, F=256, E=16, top-2), else the
    Qwen3-30B-A3B expert layer (D=2048, F=768, E=128, top-8)."""
    if small:
        d, f, e, k = 512, 256, 16, 2
    else:
        d, f, e, k = 2048, 768, 128, 8
    return ModelShape(
        name="tiny-moe" if small else "qwen3-30b-a3b-moe-layer",
        hidden_size=d,
        num_layers=1,
        num_q_heads=4,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=1024,
        num_experts=e,
        top_k=k,
        expert_width=f,
        dtype_bytes=dtype_bytes,
    )


def make_default_moe(
    shape: ModelShape,
    *,
    dtype: str = "float32",
    seed: int = 0,
    impl: str = "engine",
    capacity_factor: float = 1.25,
) -> Callable:
    """A jnp top-k SwiGLU MoE layer with random weights: x_TD -> y_TD.

    impl="engine" (default): the engine's own layer, `pallas_kernels.moe.moe_ffn` with
    the platform's backend (Pallas on TPU/GPU, `xla_tiles` on CPU), so the knee is the
    one the engine meets.
    impl="capacity": GShard-style dispatch; each expert computes C = ceil(cf * k * T / E)
    slots (rounded up to 8) with one batched einsum, overflow rows are dropped. Its work
    is ~cf x the useful work on every backend. impl="ragged": dropless, rows sorted by
    expert and two `jax.lax.ragged_dot` grouped matmuls (the engine's pattern; note that
    XLA:CPU lowers ragged_dot densely, doing E/k x the useful work there).
    """
    import jax
    import jax.numpy as jnp

    if impl not in ("engine", "capacity", "ragged"):
        raise ValueError(f"impl must be 'engine', 'capacity' or 'ragged', got {impl!r}")
    d, f, e, k = shape.hidden_size, shape.expert_width, shape.num_experts, shape.top_k
    key_router, key_up, key_down = jax.random.split(jax.random.PRNGKey(seed), 3)
    scale = 1.0 / math.sqrt(d)
    w_router_DE = (jax.random.normal(key_router, (d, e)) * scale).astype(dtype)
    w_gate_up_EDF2 = (jax.random.normal(key_up, (e, d, 2 * f)) * scale).astype(dtype)
    w_down_EFD = (jax.random.normal(key_down, (e, f, d)) / math.sqrt(f)).astype(dtype)

    def route(x_TD):
        logits_TE = (x_TD @ w_router_DE).astype(jnp.float32)
        gate_TA, expert_TA = jax.lax.top_k(logits_TE, k)
        return jax.nn.softmax(gate_TA, axis=-1), expert_TA

    def ragged(x_TD):
        gate_TA, expert_TA = route(x_TD)
        expert_R = expert_TA.reshape(-1)
        order_R = jnp.argsort(expert_R)
        token_R = order_R // k
        group_sizes_E = jnp.bincount(expert_R, length=e).astype(jnp.int32)
        h_RF2 = jax.lax.ragged_dot(x_TD[token_R], w_gate_up_EDF2, group_sizes_E)
        gate_RF, up_RF = jnp.split(h_RF2, 2, axis=-1)
        y_RD = jax.lax.ragged_dot(jax.nn.silu(gate_RF) * up_RF, w_down_EFD, group_sizes_E)
        y_RD = y_RD * gate_TA.reshape(-1)[order_R][:, None].astype(y_RD.dtype)
        return jnp.zeros_like(x_TD).at[token_R].add(y_RD)

    def capacity(x_TD):
        t = x_TD.shape[0]
        z = max(8, -(-math.ceil(capacity_factor * k * t / e) // 8) * 8)
        gate_TA, expert_TA = route(x_TD)
        expert_R = expert_TA.reshape(-1)
        onehot_RE = jax.nn.one_hot(expert_R, e, dtype=jnp.int32)
        slot_R = (jnp.cumsum(onehot_RE, axis=0) * onehot_RE).sum(-1) - 1
        flat_R = jnp.where(slot_R < z, expert_R * z + slot_R, e * z)  # e * z: dropped
        token_R = jnp.arange(t * k) // k
        source_flat = jnp.full((e * z + 1,), t, jnp.int32).at[flat_R].set(token_R)
        source_EZ = source_flat[:-1].reshape(e, z)  # token t (a zero row) marks a free slot
        x_padded_TD = jnp.concatenate([x_TD, jnp.zeros((1, d), x_TD.dtype)])
        x_EZD = x_padded_TD[source_EZ]
        h_EZF2 = jnp.einsum("ezd,edf->ezf", x_EZD, w_gate_up_EDF2)
        gate_EZF, up_EZF = jnp.split(h_EZF2, 2, axis=-1)
        y_EZD = jnp.einsum("ezf,efd->ezd", jax.nn.silu(gate_EZF) * up_EZF, w_down_EFD)
        y_flat = jnp.concatenate([y_EZD.reshape(e * z, d), jnp.zeros((1, d), y_EZD.dtype)])
        y_RD = y_flat[flat_R] * gate_TA.reshape(-1)[:, None].astype(y_flat.dtype)
        return y_RD.reshape(t, k, d).sum(axis=1)

    def engine(x_TD):
        from pallas_kernels.moe import moe_ffn

        logits_TE = (x_TD @ w_router_DE).astype(jnp.float32)
        y_TD, _ = moe_ffn(x_TD, logits_TE, w_gate_up_EDF2, w_down_EFD, top_k=k,
                          norm_topk_prob=True)
        return y_TD

    return {"engine": engine, "capacity": capacity, "ragged": ragged}[impl]


def measure_moe_knee(
    moe_fn: Callable | None = None,
    *,
    shape: ModelShape | None = None,
    tokens: Sequence[int] | None = None,
    repeats: int = 3,
    threshold: float = 0.8,
    routing: Routing = UNIFORM,
    dtype: str | None = None,
    seed: int = 0,
) -> KneeResult:
    """Time `moe_fn(x_TD)` over tokens per call and find where FLOP/s saturates.

    With `moe_fn` given, `shape` must describe it (D for the inputs, and the FLOPs and
    bytes to credit per call). Without, a default MoE is built by `make_default_moe`:
    on CPU a tiny f32 one swept over T = 1 .. 512 (a few seconds on 2 cores); elsewhere
    the bf16 Qwen3-30B-A3B expert layer swept over T = 1 .. 16384.
    """
    import jax
    import jax.numpy as jnp

    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    dtype = dtype or ("float32" if on_cpu else "bfloat16")
    if moe_fn is None:
        itemsize = jnp.dtype(dtype).itemsize
        shape = shape or default_moe_shape(itemsize, small=on_cpu)
        moe_fn = make_default_moe(shape, dtype=dtype, seed=seed)
    elif shape is None:
        raise ValueError("pass the ModelShape that describes moe_fn")
    default_tokens = range(10) if on_cpu else range(15)
    token_counts = tuple(tokens) if tokens is not None else tuple(2**i for i in default_tokens)
    if not token_counts or any(t < 1 for t in token_counts):
        raise ValueError("tokens must be positive")

    from pallas_kernels.timing import time_call

    run = jax.jit(moe_fn)
    key = jax.random.PRNGKey(seed + 1)
    points = []
    for t in token_counts:
        x_TD = jax.random.normal(key, (t, shape.hidden_size)).astype(dtype)
        best = time_call(run, x_TD, iters=repeats).best
        flops, weight_bytes, act_bytes = expert_traffic(shape, t, routing=routing)
        moved = float(weight_bytes + act_bytes)
        points.append(
            KneePoint(
                tokens=t,
                seconds=best,
                flops=float(flops),
                bytes=moved,
                flops_per_s=float(flops) / best,
                bytes_per_s=moved / best,
            )
        )
    peak = max(p.flops_per_s for p in points)
    knee = min(p.tokens for p in points if p.flops_per_s >= threshold * peak)
    kind = getattr(device, "device_kind", device.platform)
    return KneeResult(tuple(points), knee, threshold, kind)
