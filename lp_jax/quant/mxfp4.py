"""GPT-OSS's MXFP4 experts kept in 4 bits: the scheme, and the conversions from the
checkpoint's packed bytes.

The checkpoint stores an expert projection [out, in] as `*_blocks` uint8 [out, in/32,
16] (two e2m1 values a byte, low nibble first) and `*_scales` uint8 [out, in/32] (an
e8m0 exponent + 127 per 32 inputs). In pallas_kernels.quant's layout that is a weight
[in, out] of `jnp.float4_e2m1fn` (the nibble is the e2m1 bit pattern, so unpacking is
exact) and a `jnp.float8_e8m0fnu` scale 2^(e - 127) [in/32, out] (the checkpoint's byte
is the e8m0 bit pattern, so it is reinterpreted, not converted): block_k 32, block_n 1,
and w = w_q * scale as for every scheme, so the reference and xla_tiles MoE backends run
it through `ref_dequantize` (which widens the scale to float32) unchanged.

Stored bytes: the e2m1 values are 4-bit in JAX's type (how XLA lays sub-byte types
out in HBM is its business; numpy and `nbytes` count a byte each), the scales 1 B per
32 weights, as in the checkpoint: 0.53125 B a weight, what `quant.stored_bytes`, the
engine's expert-bytes counter and lp_jax.roofline's "fp4" count.

The Pallas MoE kernels do not take fp4 yet, so this format is opt-in
(`quantization="mxfp4"`); by default an MXFP4 checkpoint is dequantised to 16 bits at
load (loader.dequantize_mxfp4), as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.quant import QuantScheme

MXFP4 = QuantScheme("mxfp4", jnp.float4_e2m1fn, 32, 1, jnp.float8_e8m0fnu)
E2M1_MAX = 6.0
_NIBBLE_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                          np.float32).astype(ml_dtypes.float4_e2m1fn)


def unpack_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., G, 16] -> float4_e2m1fn [..., G * 32], low nibble first."""
    blocks = np.asarray(blocks, np.uint8)
    out = np.empty((*blocks.shape, 2), _NIBBLE_VALUES.dtype)
    out[..., 0] = _NIBBLE_VALUES[blocks & 0x0F]
    out[..., 1] = _NIBBLE_VALUES[blocks >> 4]
    return out.reshape(*blocks.shape[:-2], -1)


def e8m0_scales(scales: np.ndarray) -> np.ndarray:
    """uint8 exponents + 127 -> float8_e8m0fnu 2^(e - 127): the same bytes (255 is NaN
    in both)."""
    return np.ascontiguousarray(scales, np.uint8).view(ml_dtypes.float8_e8m0fnu)


def quantize_mxfp4(w_KN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e2m1 [..., K, N], e8m0 power-of-two scale [..., K/32, N]) of w, the OCP MX
    rule: scale 2^(floor(log2 amax) - 2), values rounded to e2m1 (saturating at 6).
    For random (dummy) weights and initialisation only; checkpoints arrive quantized."""
    K, N = w_KN.shape[-2:]
    blocks = w_KN.astype(jnp.float32).reshape(*w_KN.shape[:-2], K // 32, 32, N)
    amax = jnp.max(jnp.abs(blocks), axis=-2)
    exp = jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.maximum(amax, 1e-30))) - 2, 0)
    scale = jnp.exp2(exp)
    q = jnp.clip(blocks / scale[..., None, :], -E2M1_MAX, E2M1_MAX)
    return q.reshape(w_KN.shape).astype(jnp.float4_e2m1fn), scale.astype(MXFP4.scale_dtype)
