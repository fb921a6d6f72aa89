"""A W4A16 MXFP4 weight tile decoded on chip, checked in the interpreter and compiled
for a v6e with the real Mosaic compiler: the groundwork for fp4 in the TPU MoE kernels
(issue #31; not wired into them yet).

Mosaic (v6e, this libtpu) refuses `vector<..xf4E2M1FN>`, so the tile arrives as int8
bytes of two e2m1 nibbles. The packing is chosen so that decoding needs no lane or
sublane interleave: within each 64-row group of K, byte row r holds rows r (low
nibble) and r + 32 (high nibble), so the two decoded [32, tn] halves concatenate
along sublanes back into K order. The e8m0 scales (one byte per 32 rows per column)
are loaded as float8_e8m0fnu and widened to float32. The nibble decodes with integer
ops and selects: sign bit 3, exponent bits 1-2, mantissa bit 0. Then comes one bf16 dot
with float32 accumulation.

    .venv/bin/python launch/compile_mxfp4_decode_tile.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from pallas_kernels import compile_targets  # noqa: E402

K, N, T = 256, 256, 16
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def decode_e2m1(n_i32):
    """int32 nibbles (0..15) -> float32 e2m1 values."""
    e, m = (n_i32 >> 1) & 3, (n_i32 & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0))
    mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where((n_i32 >> 3) == 1, -mag, mag)


def kernel(w_ref, s_ref, x_ref, o_ref):
    b = w_ref[...].astype(jnp.int32) & 0xFF  # [K/2, N] packed bytes
    s = s_ref[...].astype(jnp.float32)  # [K/32, N] e8m0 scales
    parts = []
    for g in range(b.shape[0] // 32):
        byte = b[32 * g:32 * (g + 1)]
        parts.append(decode_e2m1(byte & 15) * s[2 * g:2 * g + 1])
        parts.append(decode_e2m1(byte >> 4) * s[2 * g + 1:2 * g + 2])
    w = jnp.concatenate(parts, axis=0).astype(x_ref.dtype)
    o_ref[...] = jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32)


def tile_matmul(w_packed, scales, x, interpret=False):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32),
                          interpret=interpret)(w_packed, scales, x)


def pack(nibbles_KN):
    """[K, N] nibbles -> int8 [K/2, N]: per 64-row group, rows r and r + 32 in byte r."""
    g = nibbles_KN.reshape(K // 64, 2, 32, N)
    return (g[:, 0] | (g[:, 1] << 4)).reshape(K // 2, N).astype(np.uint8).view(np.int8)


def main():
    rng = np.random.default_rng(0)
    nib = rng.integers(0, 16, (K, N))
    exps = rng.integers(120, 130, (K // 32, N)).astype(np.uint8)
    w = E2M1[nib] * np.repeat(np.ldexp(1.0, exps.astype(np.int32) - 127), 32, axis=0)
    x = rng.standard_normal((T, K)).astype(np.float32)
    y = tile_matmul(jnp.asarray(pack(nib)), jnp.asarray(exps.view(ml_dtypes.float8_e8m0fnu)),
                    jnp.asarray(x), interpret=True)
    want = x.astype(np.float64) @ w
    err = float(np.linalg.norm(np.asarray(y) - want) / np.linalg.norm(want))
    print(f"interpreter vs the numpy oracle: norm-relative error {err:.2e}")
    sd = jax.ShapeDtypeStruct
    compile_targets.compile_tpu(
        tile_matmul, (sd((K // 2, N), jnp.int8), sd((K // 32, N), jnp.float8_e8m0fnu),
                      sd((T, K), jnp.bfloat16)), topology="v6e:2x2", mesh_shape=(1,))
    print("compiled for v6e (Mosaic)")


if __name__ == "__main__":
    main()
