"""Quantized weights inside the models: the parameter pair a quantized matrix becomes,
and the dot the dense projections run on it.

A quantized [.., K, N] weight is two nnx params, `name` (int8 or e4m3, the layout of
pallas_kernels.quant) and `name_scale` (float32 [.., k, n]), declared by
`weight_params`. The scale's logical axes are the weight's, except a per-channel
scale's K axis (size 1), which is unsharded.

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
from pallas_kernels.quant import QuantScheme, ref_dequantize, ref_quantize


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


def linear(x_TK: jax.Array, w_KN: jax.Array, scale_kn: jax.Array | None = None,
           scheme: QuantScheme | None = None) -> jax.Array:
    """x @ w accumulated in float32, in x's dtype; w quantized when `scale_kn` is given."""
    if scale_kn is None:
        return jnp.dot(x_TK, w_KN, preferred_element_type=jnp.float32).astype(x_TK.dtype)
    if scheme.block_k is None:  # per output channel: the scale after the dot
        y_TN = jnp.dot(x_TK, w_KN.astype(x_TK.dtype), preferred_element_type=jnp.float32)
        return (y_TN * scale_kn[0]).astype(x_TK.dtype)
    w_KN = ref_dequantize(w_KN, scale_kn, scheme, dtype=x_TK.dtype)
    return jnp.dot(x_TK, w_KN, preferred_element_type=jnp.float32).astype(x_TK.dtype)
