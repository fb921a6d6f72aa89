"""Which weight format a model is served in: `QuantConfig`, read from a checkpoint's
`quantization_config` or asked for with `quantization=`, validated before anything loads.

Two ways in, one config out:

* A quantized checkpoint says so in config.json. Hugging Face's fine-grained FP8
  (`quant_method: "fp8"`, `weight_block_size: [128, 128]`, `activation_scheme:
  "dynamic"`, `modules_to_not_convert`) becomes method "fp8_block", from_checkpoint.
  GPT-OSS's `quant_method: "mxfp4"` is recognised and, for now, returns None: the
  loader dequantises those experts to 16 bits (loader.dequantize_mxfp4).
* `quantization="int8" | "fp8"` on a 16-bit checkpoint (or dummy weights) quantises
  per output channel at load (pallas_kernels.quant.ref_quantize).
* `quantization="mxfp4"` on GPT-OSS's MXFP4 checkpoint keeps its experts in 4 bits,
  packed two codes a byte (mxfp4.py, pallas_kernels.quant's layout; opt-in); the loader
  checks that the checkpoint has MXFP4 experts.

`resolve` joins the two: asking for a format the checkpoint does not have is an
error, asking for the one it has is a no-op (as vLLM's `--quantization fp8` on an FP8
checkpoint). Every refusal names the field or value at fault.

What the model holds is not always what the checkpoint stores (`served_scheme`): an HF
FP8 checkpoint's routed experts stay e4m3 (the MoE kernels apply the 128 x 128 block
scales per tile), but its dense projections (attention, dense MLP, shared experts) are
dequantised to 16 bits once, at load. A block scale varies along K, so it cannot leave
the dot as a per-channel scale does, and no compiler lp_jax targets runs such a dot
without a dequantised copy of the whole weight in every step: XLA:TPU has no FP8 matmul
on v5e / v5p / v6e and builds the f32 product (and the expanded f32 scale) per call;
XLA:GPU on the H200 writes the bf16 weight to memory, then a bf16 GEMM (its FP8 GEMM
rewrite takes per-tensor scales only). Held in 16 bits they cost twice their FP8 bytes
of HBM, which the HBM plan counts, and nothing per step.

`modules_to_not_convert` follows transformers' `should_convert_module`: an entry keeps
a module in 16 bits when it equals the module's name, is a dotted prefix or suffix of
it, or matches it whole as a regular expression ("model.layers.*.self_attn").
"""

from __future__ import annotations

import dataclasses
import re

from lp_jax.quant.mxfp4 import MXFP4
from pallas_kernels.quant import FP8, FP8_BLOCK, INT8, QuantScheme

AT_LOAD = {"int8": INT8, "fp8": FP8}  # what `quantization=` may ask of a 16-bit checkpoint
REQUESTABLE = (*AT_LOAD, "mxfp4")  # the values of `quantization=`
METHODS = {**AT_LOAD, "fp8_block": FP8_BLOCK, "mxfp4": MXFP4}
HF_METHODS = ("fp8", "mxfp4")  # quant_method values a checkpoint may carry


@dataclasses.dataclass(frozen=True, slots=True)
class QuantConfig:
    """method: "int8", "fp8" (per channel, at load), "fp8_block" (HF fine-grained FP8,
    from the checkpoint) or "mxfp4" (GPT-OSS's experts as stored). modules_to_not_convert:
    HF module names or patterns that stay in 16 bits."""

    method: str
    from_checkpoint: bool = False
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization {self.method!r}; expected one of "
                             f"{sorted(AT_LOAD)} (or an FP8 checkpoint)")
        if self.method == "fp8_block" and not self.from_checkpoint:
            raise ValueError("fp8_block comes from a checkpoint's quantization_config; "
                             "ask for quantization='fp8' to quantise per channel at load")
        if self.method == "mxfp4" and not self.from_checkpoint:
            raise ValueError("mxfp4 keeps an MXFP4 checkpoint's experts as stored; lp_jax "
                             "does not quantise to it")

    @property
    def scheme(self) -> QuantScheme:
        return METHODS[self.method]

    def converts(self, module: str) -> bool:
        """Whether HF module `module` (e.g. "model.layers.3.mlp.gate") is quantized."""
        return not any(_matches(p, module) for p in self.modules_to_not_convert)


def served_scheme(param: str, stored: QuantScheme | None) -> QuantScheme | None:
    """The scheme the model holds parameter `param` ("mlp.experts_down_proj",
    "dense_mlp.up_proj", ...) in, when its checkpoint tensors are stored in `stored`:
    the same, except FP8 128 x 128 blocks outside the routed experts, which the loader
    dequantises to 16 bits (None; see the module docstring)."""
    if stored == FP8_BLOCK and not param.startswith("mlp.experts_"):
        return None
    return stored


def _matches(pattern: str, module: str) -> bool:
    if module == pattern or module.startswith(pattern + ".") or module.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, module) is not None
    except re.error:
        return False


def from_hf(qc: dict | None, *, source: str = "config.json") -> QuantConfig | None:
    """The QuantConfig of a checkpoint's `quantization_config` (None: unquantized, or
    GPT-OSS MXFP4, which the loader dequantises). Raises ValueError naming the field."""
    if not qc:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in HF_METHODS:
        raise ValueError(f"{where}.quant_method {method!r} is not supported; lp_jax reads "
                         f"{HF_METHODS} checkpoints (or quantises a 16-bit one at load: "
                         f"quantization={sorted(AT_LOAD)})")
    if method == "mxfp4":
        return None
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{where}.activation_scheme {scheme!r} is not supported: lp_jax "
                         "serves FP8 weights with 16-bit activations (only 'dynamic' "
                         "checkpoints carry no activation scales it would need)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt {fmt!r} is not supported; only 'e4m3'")
    block = qc.get("weight_block_size")
    want = [FP8_BLOCK.block_k, FP8_BLOCK.block_n]
    if block is None:
        raise ValueError(f"{where}.weight_block_size is missing: per-tensor FP8 checkpoints "
                         f"are not supported, only {want} blocks")
    if list(block) != want:
        raise ValueError(f"{where}.weight_block_size {list(block)} is not supported; only "
                         f"{want}")
    skip = qc.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(m, str) for m in skip):
        raise ValueError(f"{where}.modules_to_not_convert must be a list of names, got "
                         f"{skip!r}")
    return QuantConfig("fp8_block", from_checkpoint=True, modules_to_not_convert=tuple(skip))


def resolve(checkpoint: QuantConfig | None, requested: str | None) -> QuantConfig | None:
    """The format to serve: the checkpoint's, or `requested` applied at load. A request
    that disagrees with a quantized checkpoint is an error."""
    if requested is None:
        return checkpoint
    if checkpoint is not None:
        if requested in ("fp8", checkpoint.method):
            return checkpoint
        raise ValueError(f"quantization={requested!r} disagrees with the checkpoint, which "
                         f"is already quantized ({checkpoint.method}); --quantization is "
                         "for 16-bit checkpoints: drop it, or pass 'fp8'")
    if requested == "mxfp4":  # the loader checks the checkpoint's experts are MXFP4
        return QuantConfig("mxfp4", from_checkpoint=True)
    if requested not in AT_LOAD:
        raise ValueError(f"unknown quantization {requested!r}; expected one of "
                         f"{list(REQUESTABLE)} (a quantized checkpoint is detected from its "
                         "config.json)")
    return QuantConfig(requested)
