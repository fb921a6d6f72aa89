"""The loader's side of quantized weights: which checkpoint tensors feed a quantized
parameter and its scale, the checks made before anything is read, and quantisation
at load.

HF fine-grained FP8 ("fp8_block"). A converted linear layer is two tensors:
`<module>.weight` e4m3 [out, in] and `<module>.weight_scale_inv` (float32 or bf16)
[ceil(out/128), ceil(in/128)], per expert. The parameter's 16-bit source already
knows how to turn its tensors into the [in, out] layout (transpose; gate and up
transposed and concatenated along out), and the same build applied to the scales
gives the [k, n] scale of pallas_kernels.quant's layout: a block's scale moves with
its block. Fusing gate and up keeps whole blocks only when the expert width is a
multiple of 128 (Qwen3-30B-A3B: 768), which is checked.

At load ("int8", "fp8" per channel). Each stacked entry (one layer's, or one
expert's, matrix) is built whole in float32 from the 16-bit checkpoint and quantized
by pallas_kernels.quant.ref_quantize on the host CPU, then sliced to the device
shard being assembled: the per-channel amax spans all of K, which a shard split
along K would not see. The weight and its scale are two parameters, so an entry is
quantized once for each; dummy weights are drawn and quantized on device, one
leading slice at a time, weight and scale from the same draw.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lp_jax.config import ModelConfig
from lp_jax.models import deepseek_v3, gpt_oss, qwen3_moe
from lp_jax.quant.linear import quantize
from lp_jax.safetensors_io import CheckpointError
from pallas_kernels.quant import FP8_BLOCK, QuantScheme, ref_quantize

FP8_DTYPE = np.dtype(jnp.float8_e4m3fn)
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def param_schemes(cfg: ModelConfig) -> dict[tuple[str, ...], QuantScheme]:
    """Parameter path -> scheme, for the quantized parameters of cfg's model."""
    model = gpt_oss if cfg.model_type == "gpt_oss" else deepseek_v3 if cfg.is_mla else qwen3_moe
    return {("model", "layers", *key.split(".")): s
            for key, s in model.quantized_params(cfg).items() if s is not None}


def dequantised_params(cfg: ModelConfig) -> set[tuple[str, ...]]:
    """Parameter paths whose checkpoint tensors are FP8 128 x 128 blocks but which the
    model holds in 16 bits (lp_jax.quant.served_scheme): dequantised here, at load.
    DeepSeek-V3's latent projections are read by loader._mla_sources, which does the
    same for them."""
    if cfg.model_type == "gpt_oss":
        return set()
    served = param_schemes(cfg)
    return {("model", "layers", *key.split(".")) for key, s in
            qwen3_moe.stored_params(cfg).items() if s == FP8_BLOCK} - set(served)


def scale_path(path: tuple[str, ...]) -> tuple[str, ...]:
    return (*path[:-1], path[-1] + "_scale")


def _scale_name(name):
    """`<module>.weight` -> `<module>.weight_scale_inv` (also for (name, row))."""
    if isinstance(name, tuple):
        return (_scale_name(name[0]), name[1])
    if not name.endswith(".weight"):
        raise AssertionError(f"FP8 weight tensor {name!r} does not end in .weight")
    return name + "_scale_inv"


def _block_shape(shape):
    """The weight_scale_inv shape of an [out, in] FP8 weight."""
    return tuple(math.ceil(s / FP8_BLOCK.block_k) for s in shape)


def quantized_sources(cfg: ModelConfig, sources: dict) -> dict:
    """`sources` (loader.hf_sources) with every quantized parameter's source and its
    scale's: read from the FP8 checkpoint's tensors, or quantized at load."""
    schemes = param_schemes(cfg)
    out = dict(sources)
    for path in dequantised_params(cfg) if cfg.quantization is not None else ():
        out[path] = _dequantising(sources[path])
    if not schemes or cfg.quantization.method == "mxfp4":  # hf_sources reads those
        return out
    for path, scheme in schemes.items():
        src = sources[path]
        if cfg.quantization.from_checkpoint:
            out[scale_path(path)] = dataclasses.replace(
                src, names=lambda *i, src=src: [_scale_name(n) for n in src.names(*i)],
                shapes=lambda *i, src=src: [_block_shape(s) for s in src.shapes(*i)])
        else:
            out[path] = dataclasses.replace(
                src, build=lambda a, src=src, s=scheme: _quantize_host(src.build(a), s)[0])
            out[scale_path(path)] = dataclasses.replace(
                src, build=lambda a, src=src, s=scheme: _quantize_host(src.build(a), s)[1])
    return out


def _dequantising(src):
    """`src` (a 16-bit parameter's source) reading each FP8 tensor with its
    weight_scale_inv and dequantising the pair before `src.build` lays it out."""
    def names(*i):
        return [n for name in src.names(*i) for n in (name, _scale_name(name))]

    def shapes(*i):
        return [s for shape in src.shapes(*i) for s in (shape, _block_shape(shape))]

    def build(arrs):
        return src.build([dequantize_fp8_blocks(arrs[j], arrs[j + 1])
                          for j in range(0, len(arrs), 2)])

    return dataclasses.replace(src, names=names, shapes=shapes, build=build)


def dequantize_fp8_blocks(w_OI: np.ndarray, s_oi: np.ndarray) -> np.ndarray:
    """An FP8 [out, in] weight and its [ceil(out/128), ceil(in/128)] weight_scale_inv
    -> float32 [out, in]; the last block of a dimension may be partial (DeepSeek-V3's
    kv_a_proj_with_mqa: 576 rows, 4.5 blocks)."""
    O, I = w_OI.shape
    b = FP8_BLOCK.block_k
    s_OI = np.repeat(np.repeat(s_oi.astype(np.float32), b, axis=0), b, axis=1)[:O, :I]
    return w_OI.astype(np.float32) * s_OI


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, scheme):
    return ref_quantize(w, scheme)


def _quantize_host(w: np.ndarray, scheme: QuantScheme):
    """ref_quantize of one entry on the host CPU, as numpy (w_q, scale)."""
    with jax.default_device(jax.devices("cpu")[0]):
        w_q, scale = _quantize(np.asarray(w, np.float32), scheme)
    return np.asarray(w_q), np.asarray(scale)


def check_mxfp4_request(where, cfg: ModelConfig, has_mxfp4: bool) -> None:
    """Before anything is read: quantization="mxfp4" needs MXFP4 experts to keep, and
    int8 / fp8 at load need 16-bit ones (an MXFP4 checkpoint is already quantized:
    requantising its fp4 values would round them twice). Raises CheckpointError."""
    q = cfg.quantization
    if q is None or q.from_checkpoint and q.method != "mxfp4":
        return
    if q.method == "mxfp4" and not has_mxfp4:
        raise CheckpointError(f"{where}: quantization='mxfp4' keeps MXFP4 experts as "
                              "stored, but this checkpoint has no *_blocks / *_scales experts")
    if q.method != "mxfp4" and has_mxfp4:
        raise CheckpointError(
            f"{where}: quantization={q.method!r} disagrees with the checkpoint, whose experts "
            "are already quantized (MXFP4 *_blocks / *_scales); --quantization int8 / fp8 "
            "is for 16-bit checkpoints: serve these as stored (quantization='mxfp4') or "
            "dequantised to 16 bits (no quantization), or start from a BF16 checkpoint")


def check_fp8_checkpoint(ckpt, cfg: ModelConfig, sources: dict) -> None:
    """Before anything is read: every FP8 tensor feeds a parameter the config converts,
    every converted one is e4m3 with a float32 / bf16 scale, and fused gate/up keeps
    whole blocks. Raises CheckpointError naming the tensor (presence and shapes:
    HFCheckpoint.check, run after this so that a wrong format is named as such)."""
    schemes = param_schemes(cfg)
    from_ckpt = cfg.quantization is not None and cfg.quantization.method == "fp8_block"
    fp8 = set(schemes) | dequantised_params(cfg) if from_ckpt else set()
    quantized = {scale_path(p) for p in schemes} | set(schemes) if from_ckpt else set()
    F = cfg.moe_intermediate_size
    if from_ckpt and ("model", "layers", "mlp", "experts_gate_up_proj") in schemes and F % 128:
        raise CheckpointError(
            f"{ckpt.dir}: moe_intermediate_size {F} is not a multiple of the FP8 block "
            f"({FP8_BLOCK.block_n}): gate and up cannot be fused into one [D, 2F] "
            "weight with whole blocks")
    for path, src in sources.items():
        for idx in np.ndindex(*src.stack_sizes):
            for name in src.names(*idx):
                name = name[0] if isinstance(name, tuple) else name
                if name not in ckpt.where:
                    continue  # HFCheckpoint.check names it
                dtype = ckpt.where[name].tensors[name][0]
                if path in fp8 and not name.endswith("_scale_inv"):
                    if dtype != FP8_DTYPE:
                        raise CheckpointError(
                            f"{ckpt.where[name].path}: tensor {name!r} is {dtype}, but "
                            "quantization_config (fp8) converts it: expected float8_e4m3fn "
                            "(is it missing from modules_to_not_convert?)")
                elif path in quantized or path in fp8:  # a scale
                    if dtype not in SCALE_DTYPES:
                        raise CheckpointError(f"{ckpt.where[name].path}: scale {name!r} is "
                                              f"{dtype}, expected float32 or bfloat16")
                elif dtype == FP8_DTYPE and not (cfg.is_mla and path[2:3] == ("self_attn",)):
                    why = ("config.json has no fp8 quantization_config" if not from_ckpt
                           else "modules_to_not_convert keeps it 16-bit"
                           if ".".join(path[2:]) in qwen3_moe.QUANTIZABLE
                           else f"lp_jax reads {'.'.join(path)} in 16 bits only")
                    raise CheckpointError(f"{ckpt.where[name].path}: tensor {name!r} is FP8 "
                                          f"(F8_E4M3) but {why}")


def dummy_quantized(shape, scheme: QuantScheme, std: float, shardings, key):
    """(w_q, scale) of a N(0, std^2) draw, made on device in `shardings` (weight's,
    scale's), drawn and quantized one leading slice at a time. Parameters of one shape
    (k and v, gate and up) share one compiled program."""
    return _dummy_program(tuple(shape), scheme, float(std), tuple(shardings))(key)


@functools.lru_cache(maxsize=64)
def _dummy_program(shape, scheme: QuantScheme, std: float, shardings):
    def one(k, shp):
        return quantize(jax.random.normal(k, shp, jnp.float32) * std, scheme)

    def init(k):
        if len(shape) < 3:
            return one(k, shape)
        return jax.lax.map(lambda ki: one(ki, shape[1:]), jax.random.split(k, shape[0]))

    return jax.jit(init, out_shardings=shardings)
