"""Weight-only quantization schemes: what a quantized weight and its scales look like.

This file is the contract between the loader (which produces quantized weights) and the
kernels (which consume them). A quantized matrix w_KN (K input rows, N output columns,
the layout every kernel here multiplies as x_TK @ w_KN) is stored as

    w_q_KN   [..., K, N]      in `scheme.weight_dtype` (int8 or float8_e4m3fn)
    scale_kn [..., k, n]      `scheme.scale_dtype` (float32; MXFP4's e8m0), k = ceil(K /
                              block_k), n = ceil(N / block_n) (MXFP4 stores k rounded
                              up to a multiple of 8: padding rows, never read)

and means  w_KN[i, j] = w_q_KN[i, j] * scale_kn[i // block_k, j // block_n].  The scale is
multiplicative, as Hugging Face's fine-grained FP8 `weight_scale_inv` is (its name says
"inverse" of the quantiser's scale; dequantisation multiplies by it).

Schemes:
* "int8": per output channel (block_k = K, block_n = 1), symmetric, scale = amax / 127.
* "fp8": per output channel, e4m3, scale = amax / 448.
* "fp8_block": Hugging Face fine-grained FP8, 128 x 128 blocks of e4m3 (the checkpoint's
  [out, in] blocks, transposed into this [in, out] layout).
* "mxfp4": GPT-OSS's MXFP4 (OCP MX), e2m1 values with one e8m0 power-of-two scale per 32
  values along K (block_k 32, block_n 1), kept packed two a byte (`pack` = 2): see
  "The packed MXFP4 layout" below.

The packed MXFP4 layout (W4A16; what the loader stores and every MoE backend reads).
Mosaic TPU refuses `f4E2M1FN` vectors and sm_90 has no fp4 MMA, so the e2m1 values travel
as plain bytes, two 4-bit codes a byte, and each kernel decodes them on chip:

    w_p_KN   [..., K/2, N]    int8; byte (j, n) holds the e2m1 code of w[j, n] in its
                              low nibble and of w[j + K/2, n] in its high nibble
    scale_kn [..., k, N]      float8_e8m0fnu (1 byte: 2^(e - 127)), in w's row order:
                              row i of w has scale row i // 32; k is K/32 rounded up to
                              a multiple of 8 (`scale_row_multiple`; GPT-OSS-20B's K/32
                              = 90 is stored as 96 rows)

so w[i, n] = e2m1(code(i, n)) * scale[i // 32, n]. The rows past K/32 are padding:
they hold e8m0 1.0 (`SCALE_PAD`, byte 127) and every consumer ignores them (no w row
maps to them). Consumers also take unpadded scales (exactly K/32 rows; `check_scale`).
Why pad: the TPU compiler's default layout of an [L, E, 90, N] stack (and of the 1, 2
and 100 rows probed) is not row-major ({3,1,2,0}: the experts dim second-minor), so
every step copied GPT-OSS-20B's stacked scales into the row-major layout the kernels
read (94.9 + 47.5 MiB a chip on v6e); every multiple of 8 probed gets the row-major
default on v5e and v6e (BENCHMARKS.md, "MXFP4 scale rows padded"). The loader pads at
load (the checkpoint keeps HF's K/32 rows). Stored bytes: 0.5 a weight plus 1 per 32,
plus the padding rows (0.53125 B a weight plus padding of the scale rows to a multiple
of 8; GPT-OSS-20B: 96/90 of the scale bytes, 0.2% of the experts). K must be a multiple
of 32 (GPT-OSS-20B: D = F = 2880, Qwen3-30B-A3B: 2048 and 768, whose 64 and 24 scale
rows need no padding; the tiny GPT-OSS's F = 32, whose halves of 16 rows share one scale
row: a half need not be whole scale blocks, the scale row is always i // 32). A shard
of the byte rows along K is no shard of w (it holds two row ranges), so K is never split
across devices in this layout. The code is the e2m1 bit pattern:
bit 3 sign, bits 1-2 exponent (bias 1), bit 0 mantissa; values 0, 0.5, 1, 1.5, 2, 3, 4, 6
and their negatives (`E2M1_VALUES`).

Why K/2 and not neighbouring rows: the halves [0, K/2) and [K/2, K) are the two halves
the TPU gate/up kernel already gathers x in (a 32-bit word holds x[j] and x[K/2 + j],
`tpu.pack_rows`), so one packed block [R, N] at byte rows [r0, r0 + R) serves both halves:
its low nibbles multiply x[:, r0:r0 + R], its high nibbles x[:, K/2 + r0:K/2 + r0 + R],
with no lane or sublane interleave. A K tile of t rows of w is t/2 byte rows [r0, r0 +
t/2): its low nibbles are rows r0.. of w, its high nibbles rows K/2 + r0.. .
`pack_mxfp4` / `unpack_mxfp4` convert from / to the codes [..., K, N]; `ref_dequantize`
reads this layout, so the reference, xla_tiles, TPU and GPU backends share it.

Leading dimensions ([L, E] of stacked experts) are shared by the weight and its scale.
`ref_dequantize` is the oracle the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

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
    pack: int = 1  # weights per stored element along K (MXFP4: 2 nibbles a byte, K/2 rows)
    scale_row_multiple: int = 1  # stored scale rows rounded up to this (MXFP4: 8)

    def logical_k(self, rows: int) -> int:
        """K of a stored weight with `rows` rows (K/pack of them are stored)."""
        return rows * self.pack

    def stored_shape(self, K: int, N: int) -> tuple[int, int]:
        """The stored weight's [rows, N] for a logical [K, N] matrix."""
        bk = self.block_k_for(K)
        if self.pack > 1 and (K % self.pack or K % bk):
            raise ValueError(f"{self.name}: K = {K} must be a multiple of {bk}")
        return K // self.pack, N

    def scale_shape(self, K: int, N: int) -> tuple[int, int]:
        """The stored scale's [k, n], k padded to `scale_row_multiple` rows."""
        m = self.scale_row_multiple
        return -(-self.scale_rows(K) // m) * m, math.ceil(N / self.block_n)

    def scale_rows(self, K: int) -> int:
        """Scale rows that K rows of w use: ceil(K / block_k) (no padding)."""
        return math.ceil(K / self.block_k_for(K))

    def block_k_for(self, K: int) -> int:
        return K if self.block_k is None else self.block_k

    def stored_bytes(self, K: int, N: int) -> int:
        """HBM bytes of one quantized [K, N] matrix: its values and its scales as stored
        (MXFP4: padding rows included)."""
        return (stored_bytes(self.stored_shape(K, N), self.weight_dtype)
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
MXFP4 = QuantScheme("mxfp4", jnp.int8, 32, 1, jnp.float8_e8m0fnu, pack=2,
                    scale_row_multiple=8)
SCALE_PAD = 1.0  # the value of padding scale rows (e8m0 byte 127); never read
SCHEMES = {s.name: s for s in (INT8, FP8, FP8_BLOCK, MXFP4)}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by 4-bit code


def pack_mxfp4(codes_KN):
    """e2m1 codes (integers 0..15) [..., K, N] -> the packed int8 [..., K/2, N]: rows j
    and j + K/2 share byte row j (low, high nibble). numpy or jax arrays."""
    K = codes_KN.shape[-2]
    if K % 32:
        raise ValueError(f"mxfp4: K = {K} must be a multiple of 32")
    lo, hi = codes_KN[..., :K // 2, :], codes_KN[..., K // 2:, :]
    packed = (lo & 15) | ((hi & 15) << 4)
    if isinstance(packed, jax.Array):
        return jax.lax.bitcast_convert_type(packed.astype(jnp.uint8), jnp.int8)
    return packed.astype("uint8").view("int8")


def decode_e2m1(code):
    """int32 e2m1 codes (0..15) -> float32 values, with integer ops and selects only
    (Mosaic TPU has no fp4 vectors): sign bit 3, exponent bits 1-2, mantissa bit 0."""
    e, m = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0))
    mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where((code >> 3) & 1 == 1, -mag, mag)


def unpack_mxfp4(w_p):
    """The packed int8 [..., K/2, N] -> float32 e2m1 values [..., K, N] (no scales)."""
    b = w_p.astype(jnp.int32) & 0xFF
    return jnp.concatenate([decode_e2m1(b & 15), decode_e2m1(b >> 4)], axis=-2)


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
    rows, N = w_q.shape[-2:]
    K = scheme.logical_k(rows)
    scheme.stored_shape(K, N)  # packed: K a multiple of the block
    want = (*w_q.shape[:-2], *scheme.scale_shape(K, N))
    exact = (*want[:-2], scheme.scale_rows(K), want[-1])
    if tuple(scale.shape) not in (want, exact):
        also = "" if want == exact else f" (or {exact}, unpadded)"
        raise ValueError(f"{scheme.name} scale for weight {tuple(w_q.shape)} must have "
                         f"shape {want}{also}, got {tuple(scale.shape)}")


def pad_scale_rows(scale_kn, scheme: QuantScheme):
    """scale [..., k, n] with its rows padded to `scheme.scale_row_multiple` with
    SCALE_PAD (the stored layout; a no-op when k is already a multiple). numpy or jax."""
    k, m = scale_kn.shape[-2], scheme.scale_row_multiple
    extra = -(-k // m) * m - k
    if not extra:
        return scale_kn
    widths = [(0, 0)] * (scale_kn.ndim - 2) + [(0, extra), (0, 0)]
    if isinstance(scale_kn, jax.Array):
        return jnp.pad(scale_kn, widths, constant_values=jnp.asarray(SCALE_PAD, scale_kn.dtype))
    pad = np.full((*scale_kn.shape[:-2], extra, scale_kn.shape[-1]), SCALE_PAD, scale_kn.dtype)
    return np.concatenate([scale_kn, pad], axis=-2)


def expand_scale(scale: jax.Array, scheme: QuantScheme, K: int, N: int) -> jax.Array:
    """The per-element [..., K, N] scale (repeats each block's scale over its block;
    padding rows past K fall off)."""
    bk = scheme.block_k_for(K)
    full = jnp.repeat(jnp.repeat(scale, bk, axis=-2), scheme.block_n, axis=-1)
    return full[..., :K, :N]


def ref_dequantize(w_q: jax.Array, scale: jax.Array, scheme: QuantScheme,
                   dtype=jnp.float32) -> jax.Array:
    """w_q * scale per block, in `dtype` (float32 by default: the kernels' arithmetic)."""
    check_scale(w_q, scale, scheme)
    K, N = scheme.logical_k(w_q.shape[-2]), w_q.shape[-1]
    full = expand_scale(scale.astype(jnp.float32), scheme, K, N)
    values = unpack_mxfp4(w_q) if scheme.pack == 2 else w_q.astype(jnp.float32)
    return (values * full).astype(dtype)


def ref_quantize(w: jax.Array, scheme: QuantScheme) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantisation of w [..., K, N] to (w_q, scale) in `scheme`.

    The JAX quantiser used at load time (`quantization="int8" | "fp8"`). Tests check it
    against an independent numpy one (checkpoints/), not against itself.
    """
    if scheme.pack > 1:
        raise ValueError(f"{scheme.name}: quantised by lp_jax.quant.mxfp4, not ref_quantize")
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
