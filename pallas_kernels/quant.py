"""Weight-only quantization schemes: what a quantized weight and its scales look like.

This file is the contract between the loader (which produces quantized weights) and the
kernels (which consume them). A quantized matrix w_KN (K input rows, N output columns,
the layout every kernel here multiplies as x_TK @ w_KN) is stored as

    w_q_KN   [..., K, N]      in `scheme.weight_dtype` (int8 or float8_e4m3fn)
    scale_kn [..., k, n]      `scheme.scale_dtype` (float32; MXFP4's e8m0), k = ceil(K /
                              block_k), n = ceil(N / block_n)

and means  w_KN[i, j] = w_q_KN[i, j] * scale_kn[i // block_k, j // block_n].  The scale is
multiplicative, as Hugging Face's fine-grained FP8 `weight_scale_inv` is (its name says
"inverse" of the quantiser's scale; dequantisation multiplies by it).

Schemes:
* "int8": per output channel (block_k = K, block_n = 1), symmetric, scale = amax / 127.
* "fp8": per output channel, e4m3, scale = amax / 448.
* "fp8_block": Hugging Face fine-grained FP8, 128 x 128 blocks of e4m3 (the checkpoint's
  [out, in] blocks, transposed into this [in, out] layout).

Leading dimensions ([L, E] of stacked experts) are shared by the weight and its scale.
`ref_dequantize` is the oracle the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True, slots=True)
class QuantScheme:
    """A weight format, frozen and hashable: a static argument of every kernel.

    block_k None means the whole K dimension (one scale per output channel). scale_dtype:
    the scales as stored (float32, or MXFP4's 1-byte float8_e8m0fnu powers of two);
    every consumer widens them to float32 before multiplying.
    """

    name: str
    weight_dtype: object
    block_k: int | None
    block_n: int
    scale_dtype: object = jnp.float32

    def scale_shape(self, K: int, N: int) -> tuple[int, int]:
        bk = K if self.block_k is None else self.block_k
        return math.ceil(K / bk), math.ceil(N / self.block_n)

    def block_k_for(self, K: int) -> int:
        return K if self.block_k is None else self.block_k

    def stored_bytes(self, K: int, N: int) -> int:
        """HBM bytes of one quantized [K, N] matrix: its values and its scales."""
        return (stored_bytes((K, N), self.weight_dtype)
                + stored_bytes(self.scale_shape(K, N), self.scale_dtype))


def stored_bytes(shape, dtype) -> int:
    """Bytes of an array of `shape` at `dtype`'s width in bits (4-bit types: half a byte
    a value, where numpy's itemsize says 1)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    else:  # bool
        bits = dtype.itemsize * 8
    return math.prod(shape) * bits // 8


INT8 = QuantScheme("int8", jnp.int8, None, 1)
FP8 = QuantScheme("fp8", jnp.float8_e4m3fn, None, 1)
FP8_BLOCK = QuantScheme("fp8_block", jnp.float8_e4m3fn, 128, 128)
SCHEMES = {s.name: s for s in (INT8, FP8, FP8_BLOCK)}


def scheme_named(name: str) -> QuantScheme:
    if name not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {name!r}; expected one of "
                         f"{sorted(SCHEMES)}")
    return SCHEMES[name]


def check_scale(w_q: jax.Array, scale: jax.Array, scheme: QuantScheme) -> None:
    """Raises ValueError unless w_q and scale are a valid pair for `scheme`."""
    if jnp.dtype(w_q.dtype) != jnp.dtype(scheme.weight_dtype):
        raise ValueError(f"{scheme.name} weights must be {jnp.dtype(scheme.weight_dtype)}, "
                         f"got {w_q.dtype}")
    K, N = w_q.shape[-2:]
    want = (*w_q.shape[:-2], *scheme.scale_shape(K, N))
    if tuple(scale.shape) != want:
        raise ValueError(f"{scheme.name} scale for weight {tuple(w_q.shape)} must have "
                         f"shape {want}, got {tuple(scale.shape)}")


def expand_scale(scale: jax.Array, scheme: QuantScheme, K: int, N: int) -> jax.Array:
    """The per-element [..., K, N] scale (repeats each block's scale over its block)."""
    bk = scheme.block_k_for(K)
    full = jnp.repeat(jnp.repeat(scale, bk, axis=-2), scheme.block_n, axis=-1)
    return full[..., :K, :N]


def ref_dequantize(w_q: jax.Array, scale: jax.Array, scheme: QuantScheme,
                   dtype=jnp.float32) -> jax.Array:
    """w_q * scale per block, in `dtype` (float32 by default: the kernels' arithmetic)."""
    check_scale(w_q, scale, scheme)
    K, N = w_q.shape[-2:]
    full = expand_scale(scale.astype(jnp.float32), scheme, K, N)
    return (w_q.astype(jnp.float32) * full).astype(dtype)


def ref_quantize(w: jax.Array, scheme: QuantScheme) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantisation of w [..., K, N] to (w_q, scale) in `scheme`.

    The JAX quantiser used at load time (`quantization="int8" | "fp8"`). Tests check it
    against an independent numpy one (checkpoints/), not against itself.
    """
    K, N = w.shape[-2:]
    k, n = scheme.scale_shape(K, N)
    bk = scheme.block_k_for(K)
    qmax = INT8_MAX if scheme.weight_dtype == jnp.int8 else FP8_E4M3_MAX
    pad = [(0, 0)] * (w.ndim - 2) + [(0, k * bk - K), (0, n * scheme.block_n - N)]
    wp = jnp.pad(w.astype(jnp.float32), pad)
    blocks = wp.reshape(*w.shape[:-2], k, bk, n, scheme.block_n)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    q = wp / expand_scale(scale, scheme, k * bk, n * scheme.block_n)
    if scheme.weight_dtype == jnp.int8:
        q = jnp.clip(jnp.round(q), -INT8_MAX, INT8_MAX)
    q = q[..., :K, :N].astype(scheme.weight_dtype)
    return q, scale.astype(jnp.float32)
