"""Stored bytes of a weight or KV-cache format, as the engine lays them out in HBM.

Design note. A roofline counts bytes moved; a quantized weight moves its values and its
scales. A [K, N] matrix in a blocked format stores K * N values of `value_bits` and one
scale of `scale_bytes` per (block_k x block_n) block (block_k None: the whole K, one scale
per output channel). The rules are the engine's, not new ones:

- "bf16": 2 bytes a weight, no scale.
- "int8" / "fp8": per output channel (block_k = K, block_n = 1), a float32 scale per
  column: pallas_kernels/quant.py (INT8, FP8; "scale_kn float32").
- "fp8_block": Hugging Face fine-grained FP8, 128 x 128 blocks, a float32 scale a block
  (pallas_kernels/quant.py FP8_BLOCK; the loader widens bf16 `weight_scale_inv` to float32).
- "fp4": MXFP4, e2m1 values (4 bits) and one e8m0 exponent (1 byte) per 32 values along K
  (lp_jax/quant/mxfp4.py, the checkpoint's `*_blocks` / `*_scales`): 0.53125 B a weight.
  The engine's opt-in MXFP4 path keeps those scales as e8m0 bytes too, their rows padded
  to a multiple of 8 (pallas_kernels/quant.py), which its expert-bytes counter counts
  (ModelConfig.expert_bytes) and this format leaves out (GPT-OSS-20B: 0.2%).

Which matrices a format covers follows what the engine holds (lp_jax.quant.served_scheme):
int8 / fp8 cover the attention projections, the routed experts and dense MLPs; fp8_block
and fp4 the routed experts only. An FP8 checkpoint's dense projections (attention, dense
MLP, shared experts) are dequantised to 16 bits at load, since no target compiler runs a
128 x 128 block-scaled dot without a dequantised copy of the weight per step; GPT-OSS's
modules_to_not_convert keeps its attention 16-bit. The router, embeddings and lm_head stay
in the activation dtype in every format.

Compute rate. The kernels run W8A16 / W4A16 (dequantise a tile on chip, matmul in bf16,
accumulate in float32), so the FLOP rate of a quantized model is the bf16 peak in
`hardware.py`; only the bytes change. An int8-MXU rate (v5e / v6e run int8 at twice bf16)
is not modelled: the hardware table carries no int8 figure.

KV formats: "bf16" (2 B a value) and "fp8" (e4m3, 1 B; the per-layer k/v scales are two
float32 scalars a layer, lp_jax/models/kv_cache.py, below any page's bytes and left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """One weight format: bits a value, and a scale of `scale_bytes` per block."""

    name: str
    value_bits: int
    block_k: int | None = None  # None: the whole K dimension (per output channel)
    block_n: int = 1
    scale_bytes: int = 0  # 0: no scales (a 16-bit format)
    dense: bool = True  # also covers the attention projections, dense MLPs, shared experts

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("WeightFormat.name must be non-empty")
        if self.value_bits not in (4, 8, 16, 32):
            raise ValueError(f"value_bits must be 4, 8, 16 or 32, got {self.value_bits}")
        if (self.block_k is not None and self.block_k < 1) or self.block_n < 1:
            raise ValueError("scale blocks must be >= 1")
        if self.scale_bytes < 0:
            raise ValueError("scale_bytes must be >= 0")

    def scale_count(self, k: int, n: int) -> int:
        """Scales of a [k, n] matrix (0 for an unscaled format)."""
        if not self.scale_bytes:
            return 0
        bk = k if self.block_k is None else self.block_k
        return math.ceil(k / bk) * math.ceil(n / self.block_n)

    def matrix_bytes(self, k: int, n: int) -> int:
        """Stored bytes of a [k, n] matrix: values plus scales."""
        if k < 1 or n < 1:
            raise ValueError("matrix dimensions must be >= 1")
        values_bits = k * n * self.value_bits
        return math.ceil(values_bits / 8) + self.scale_count(k, n) * self.scale_bytes


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("bf16", 16),
        WeightFormat("int8", 8, None, 1, 4),
        WeightFormat("fp8", 8, None, 1, 4),
        WeightFormat("fp8_block", 8, 128, 128, 4, dense=False),
        WeightFormat("fp4", 4, 32, 1, 1, dense=False),
    )
}
KV_FORMATS: dict[str, int] = {"bf16": 2, "fp8": 1}  # bytes a cached K or V value


def weight_format(name: str) -> WeightFormat:
    if name not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weight format {name!r}; expected one of {sorted(WEIGHT_FORMATS)}"
        )
    return WEIGHT_FORMATS[name]


def kv_itemsize(name: str) -> int:
    if name not in KV_FORMATS:
        raise ValueError(f"unknown KV format {name!r}; expected one of {sorted(KV_FORMATS)}")
    return KV_FORMATS[name]
