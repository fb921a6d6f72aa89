"""Quantized weights inside the models: the parameter pair a quantized matrix becomes,
and the dot the dense projections run on it.

A quantized [.., K, N] weight is two nnx params, `name` (int8 or e4m3, the layout of
pallas_kernels.quant) and `name_scale` (float32 [.., k, n]), declared by
`weight_params`. The scale's logical axes are the weight's, except a per-channel
scale's K axis (size 1), which is unsharded.

`row_dot` is the projections' dot, x @ w accumulated in float32. On a GPU, one row is
written as partial dots over 512-row slices of w, summed after (its docstring says why);
`dense_dot` is it in x's dtype, which a GPU's GEMM of several rows writes directly.

`linear` is the dense projections' quantized dot:
* per output channel (int8, fp8): (x @ w_q) * scale. The scale is constant along K,
  so it multiplies the float32 accumulator after the dot; the only conversion is
  w_q's to the activation dtype (exact: int8 and e4m3 values are bf16 values), which
  XLA fuses into the dot's operand. No dequantised weight exists.
* 128 x 128 blocks (HF FP8): the scale varies along K, so it cannot leave the dot.
  The weight is dequantised in the dot's operand (convert, multiply), an elementwise
  producer XLA fuses into the dot on TPU; this is one layer's projection, not its
  experts (those go to the MoE kernels whole, with their scales).

Why not qwix. qwix (Google's JAX quantization library) rewrites a Flax model's
`nnx.Linear` / `nnx.Einsum` / `jnp.dot` calls through interception rules, and its
serving path (PTQ) quantises those weights itself. Here the projections are slices
`w[i]` of stacked [L, K, N] arrays inside a traced layer loop (stacked.py), the
weights arrive already quantized from the checkpoint (HF FP8 blocks) in a layout the
MoE kernels share (pallas_kernels.quant), and the loader must stream them shard by
shard without a 16-bit copy. qwix would need its own param layout and to see the
16-bit weights; what it would contribute for weight-only serving is the two lines
of `linear` below. So it is not a dependency.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lp_jax.quant.mxfp4 import quantize_mxfp4
from pallas_kernels.platform import target_platform
from pallas_kernels.quant import QuantScheme, ref_dequantize, ref_quantize

ROW_SLICE_K = 512  # rows of w per partial product in a one-row GPU dot (`row_dot`)


def quantize(w: jax.Array, scheme: QuantScheme) -> tuple[jax.Array, jax.Array]:
    """(w_q, scale) of w in `scheme`: ref_quantize, or the MX rule for mxfp4."""
    return quantize_mxfp4(w) if scheme.name == "mxfp4" else ref_quantize(w, scheme)


def scale_axes(axes: tuple, scheme: QuantScheme) -> tuple:
    """Logical axes of the scale of a weight with logical axes `axes`."""
    k_axis = None if scheme.block_k is None else axes[-2]
    return (*axes[:-2], k_axis, axes[-1])


def weight_params(rngs: nnx.Rngs, shape, axes, dtype, scheme: QuantScheme | None, *,
                  fan_in: int | None = None) -> dict[str, nnx.Param]:
    """{"": weight} for a 16-bit weight N(0, 1/fan_in); with `scheme`, {"": w_q,
    "_scale": scale}: the same draw quantized (`quantize`). Keys are name suffixes."""
    std = 1.0 / math.sqrt(fan_in or shape[-2])
    w = jax.random.normal(rngs.params(), shape, jnp.float32) * std
    if scheme is None:
        return {"": nnx.Param(w.astype(dtype), logical_axes=axes)}
    w_q, scale = quantize(w, scheme)
    return {"": nnx.Param(w_q, logical_axes=axes),
            "_scale": nnx.Param(scale, logical_axes=scale_axes(axes, scheme))}


def set_weight(module: nnx.Module, name: str, rngs, shape, axes, dtype,
               scheme: QuantScheme | None, **kw) -> None:
    """Declares weight `name` (and `name_scale` when quantized) on `module`."""
    for suffix, p in weight_params(rngs, shape, axes, dtype, scheme, **kw).items():
        setattr(module, name + suffix, p)


def scale_of(module: nnx.Module, name: str) -> nnx.Param | None:
    return getattr(module, name + "_scale", None)


def row_dot(x_TK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """x @ w accumulated in float32, returned in float32.

    A plain dot, except for one row on a GPU. XLA:GPU rewrites a dot whose left side is
    one row into multiply + reduce over K. When the reduce keeps few outputs for its
    length (N = 2048 over K = 4096: o_proj; N = 512: k_proj, v_proj), its cost model
    leaves the multiply in a fusion of its own, which writes the whole float32 product
    [K, N] to memory and reads it back: 4x the bytes of a 16-bit weight, and K * N * 4
    bytes of temporaries. Here that dot is written as S = K / 512 partial dots over
    512-row slices of w, added after: the reduce keeps S * N outputs, the multiply fuses
    into it, and w is read once, as a plain dot would read it; the partials [S, N] are the
    only temporaries. Autotuning does not touch reduce fusions, so a device's program
    keeps this form. On TPU the one-row dot reads w once as it is.
    """
    T, K = x_TK.shape if x_TK.ndim == 2 else (0, 0)
    S = K // ROW_SLICE_K
    if T != 1 or S < 2 or K % ROW_SLICE_K or target_platform() != "gpu":
        return jnp.dot(x_TK, w_KN, preferred_element_type=jnp.float32)
    return sliced_row_dot(x_TK, w_KN)


def dense_dot(x_TK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """x @ w accumulated in float32, in x's dtype. On a GPU, more than one row asks the
    dot itself for x's dtype: XLA:GPU's GEMMs accumulate in float32 and round once, as
    a float32 dot and a cast would, but the float32 product never reaches memory. (With
    a float32 dot XLA merges the q / k / v projections into one GEMM with a float32
    output, and each consumer reads it and rounds.) Elsewhere, and for one row, `row_dot`
    and a cast."""
    if x_TK.ndim == 2 and x_TK.shape[0] > 1 and target_platform() == "gpu":
        return jnp.dot(x_TK, w_KN, preferred_element_type=x_TK.dtype)
    return row_dot(x_TK, w_KN).astype(x_TK.dtype)


def sliced_row_dot(x_1K: jax.Array, w_KN: jax.Array) -> jax.Array:
    """x @ w for one row as K / ROW_SLICE_K partial dots added one by one (float32).
    The adds are written out: XLA merges a sum over the slices into the reduce over K,
    which undoes the split. The row stays an axis of the partial dots: without it XLA
    transposes the product instead of fusing it."""
    S = x_1K.shape[1] // ROW_SLICE_K
    p_1SN = jnp.einsum("tsk,skn->tsn", x_1K.reshape(1, S, ROW_SLICE_K),
                       w_KN.reshape(S, ROW_SLICE_K, w_KN.shape[1]),
                       preferred_element_type=jnp.float32)
    y_1N = p_1SN[:, 0]
    for s in range(1, S):
        y_1N = y_1N + p_1SN[:, s]
    return y_1N


def linear(x_TK: jax.Array, w_KN: jax.Array, scale_kn: jax.Array | None = None,
           scheme: QuantScheme | None = None) -> jax.Array:
    """x @ w accumulated in float32 (`dense_dot`), in x's dtype; w quantized when
    `scale_kn` is given."""
    if scale_kn is None:
        return dense_dot(x_TK, w_KN)
    if scheme.block_k is None:  # per output channel: the scale after the dot
        y_TN = row_dot(x_TK, w_KN.astype(x_TK.dtype))
        return (y_TN * scale_kn[0]).astype(x_TK.dtype)
    w_KN = ref_dequantize(w_KN, scale_kn, scheme, dtype=x_TK.dtype)
    return row_dot(x_TK, w_KN).astype(x_TK.dtype)
