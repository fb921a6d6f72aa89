"""GPT-OSS's MXFP4 experts kept in 4 bits: the conversions from the checkpoint's packed
bytes into the kernels' packed layout, and the MX quantiser for dummy weights.

The checkpoint stores an expert projection [out, in] as `*_blocks` uint8 [out, in/32,
16] (two e2m1 codes a byte, low nibble first: input 32 g + 2 b and 32 g + 2 b + 1) and
`*_scales` uint8 [out, in/32] (an e8m0 exponent + 127 per 32 inputs). The engine keeps
it in pallas_kernels.quant's MXFP4 layout (see its docstring): int8 [in/2, out] whose
byte j holds input rows j and j + in/2 (`pack_mxfp4`), and a `jnp.float8_e8m0fnu` scale
[in/32, out] (the checkpoint's byte is the e8m0 bit pattern, so it is reinterpreted, not
converted), its rows padded with e8m0 1.0 to a multiple of 8 (`quant.pad_scale_rows`:
GPT-OSS-20B's 90 rows become 96, which the TPU compiler lays out row-major; the padding
rows are never read). The nibbles are moved, never converted, so the stored values are the
checkpoint's exactly; every MoE backend (reference, xla_tiles through `ref_dequantize`,
the TPU and GPU kernels, which decode on chip) reads this one layout.

Stored bytes: 0.5 B a weight (the int8 array has K/2 rows) and 1 B per 32 for the
scales, as in the checkpoint: 0.53125 B a weight, plus the padding scale rows (GPT-OSS-
20B: 6 of 96, 0.2% of its experts). `quant.stored_bytes` and the engine's expert-bytes
counter count the padding (it is in HBM); lp_jax.roofline's "fp4" counts 0.53125 B.

Opt-in (`quantization="mxfp4"`); by default an MXFP4 checkpoint is dequantised to 16
bits at load (loader.dequantize_mxfp4), as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.quant import MXFP4, pack_mxfp4, pad_scale_rows

E2M1_MAX = 6.0


def codes_from_blocks(blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., G, 16] -> the e2m1 codes uint8 [..., G * 32], low nibble first."""
    blocks = np.asarray(blocks, np.uint8)
    out = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)
    return out.reshape(*blocks.shape[:-2], -1)


def packed_from_blocks(blocks: np.ndarray) -> np.ndarray:
    """One projection's checkpoint blocks uint8 [out, in/32, 16] -> the kernels' packed
    int8 [in/2, out] (pallas_kernels.quant's MXFP4 layout)."""
    return pack_mxfp4(codes_from_blocks(blocks).T)


def e8m0_scales(scales: np.ndarray) -> np.ndarray:
    """uint8 exponents + 127 -> float8_e8m0fnu 2^(e - 127): the same bytes (255 is NaN
    in both)."""
    return np.ascontiguousarray(scales, np.uint8).view(ml_dtypes.float8_e8m0fnu)


def scales_from_checkpoint(scales: np.ndarray) -> np.ndarray:
    """One projection's checkpoint scales uint8 [out, in/32] -> the stored e8m0 scale
    [k, out]: transposed, rows padded to a multiple of 8 (`pad_scale_rows`)."""
    return pad_scale_rows(e8m0_scales(scales).T, MXFP4)


def quantize_mxfp4(w_KN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(packed int8 [..., K/2, N], e8m0 power-of-two scale [..., k, N]: K/32 rows padded
    to a multiple of 8) of w, the OCP MX rule: scale 2^(floor(log2 amax) - 2), values
    rounded to e2m1 (saturating at 6; float4_e2m1fn's rounding gives the code). For
    random (dummy) weights and initialisation only; checkpoints arrive quantized."""
    K, N = w_KN.shape[-2:]
    blocks = w_KN.astype(jnp.float32).reshape(*w_KN.shape[:-2], K // 32, 32, N)
    amax = jnp.max(jnp.abs(blocks), axis=-2)
    exp = jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.maximum(amax, 1e-30))) - 2, 0)
    scale = jnp.exp2(exp)
    q = jnp.clip(blocks / scale[..., None, :], -E2M1_MAX, E2M1_MAX)
    q4 = q.reshape(w_KN.shape).astype(jnp.float4_e2m1fn)
    codes = jax.lax.bitcast_convert_type(q4, jnp.uint4).astype(jnp.uint8)
    return pack_mxfp4(codes), pad_scale_rows(scale.astype(MXFP4.scale_dtype), MXFP4)
