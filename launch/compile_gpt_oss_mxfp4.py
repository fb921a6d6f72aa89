"""GPT-OSS-20B's MXFP4 experts (W4A16, kept packed: quant.py's layout) through the TPU MoE
kernels, compiled for a v6e with the real Mosaic compiler (libtpu, no TPU needed): the
stacked int8 [2, 32, 1440, 5760] / [2, 32, 1440, 2880] bytes of two e2m1 codes with their
e8m0 scales [2, 32, 96, 5760] / [2, 32, 96, 2880] (K/32 = 90 rows, padded to 96), biases
and the clamped SwiGLU, traced layer; at 64 tokens (decode) and 2048 (a prefill chunk).
Prints the compile time, the Mosaic calls, the temporaries against one layer's 4-bit
experts, and the audit's dequantised-copy check (lp_jax/aot/audit.py: no 16/32-bit value
shaped like one layer, or the stack, of the experts in their logical [.., 2880, 5760] /
[.., 2880, 2880] shapes, in the StableHLO or the optimized HLO). Then the same kernels at
Qwen3-30B-A3B's expert shapes (D = 2048, F = 768, 128 experts, top-8, SiLU; no Qwen3
checkpoint ships MXFP4, this checks that the tiles divide its 768 width: separate
768-wide gate and up blocks, one 768-column decode chunk each).

    .venv/bin/python launch/compile_gpt_oss_mxfp4.py
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/ helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lp_jax.aot.audit import dequantised_copies  # noqa: E402
from pallas_kernels import compile_targets, moe, quant  # noqa: E402
from pallas_kernels.moe import tpu  # noqa: E402
from tests.test_tpu_compile import _kernel_weight_roots  # noqa: E402

D, F, E, A, L = 2880, 2880, 32, 4, 2  # GPT-OSS-20B's experts, 2 stacked layers
S = quant.MXFP4


def args(T):
    sd = jax.ShapeDtypeStruct
    return (sd((T, D), jnp.bfloat16), sd((T, E), jnp.float32),
            sd((L, E, *S.stored_shape(D, 2 * F)), S.weight_dtype),
            sd((L, E, *S.stored_shape(F, D)), S.weight_dtype),
            sd((L, E, 2 * F), jnp.bfloat16), sd((L, E, D), jnp.bfloat16),
            sd((L, E, *S.scale_shape(D, 2 * F)), S.scale_dtype),
            sd((L, E, *S.scale_shape(F, D)), S.scale_dtype), sd((), jnp.int32))


def fn(x, logits, w_gu, w_d, b_gu, b_d, s_gu, s_d, layer):
    return tpu.moe_ffn_tpu(x, logits, w_gu, w_d, layer=layer, top_k=A, norm_topk_prob=True,
                           biases=(b_gu, b_d), activation=moe.MoEActivation("gpt_oss_clamped"),
                           scales=(s_gu, s_d), scheme=S)[0]


def main():
    # the logical (dequantised) shapes: stacked, one layer, and a [1, ...] slice of it
    shapes = {s for w in [(L, E, D, 2 * F), (L, E, F, D)] for s in (w, w[1:], (1, *w[1:]))}
    layer_bytes = E * (S.stored_bytes(D, 2 * F) + S.stored_bytes(F, D))
    for T in (64, 2048):
        t0 = time.perf_counter()
        compiled = compile_targets.compile_tpu(fn, args(T), topology="v6e:2x2",
                                               mesh_shape=(1,))
        secs = time.perf_counter() - t0
        hlo = compiled.as_text()
        with compile_targets.tpu_target("v6e"):
            stablehlo = jax.export.export(jax.jit(fn), platforms=["tpu"])(
                *args(T)).mlir_module()
        temp = compiled.memory_analysis().temp_size_in_bytes
        found = dequantised_copies(hlo, shapes) + dequantised_copies(stablehlo, shapes)
        print(f"mxfp4 T={T}: compiled for v6e in {secs:.1f} s, "
              f"{hlo.count('tpu_custom_call')} Mosaic calls, temporaries {temp / 1e6:.1f} MB "
              f"(one layer's 4-bit experts {layer_bytes / 1e6:.1f} MB), dequantised copies: "
              f"{'none (PASS)' if not found else found[:3]}; the kernels read "
              f"{sorted(set(_kernel_weight_roots(hlo, min_elements=E * F * D // 2)))}")
    # The control: dequantise the stack to bfloat16, then the 16-bit kernels (exported
    # for TPU, not compiled): the audit must find its bfloat16 copies.
    with compile_targets.tpu_target("v6e"):
        control = jax.export.export(jax.jit(dequantise_then_kernel), platforms=["tpu"])(
            *args(64)).mlir_module()
    found = dequantised_copies(control, shapes)
    print(f"control (dequantise then the 16-bit kernel): {len(found)} dequantised values "
          f"found ({'FAIL, as it must' if found else 'none: the audit misses it'})")
    f, a, shapes, min_elements = qwen3_shapes()
    t0 = time.perf_counter()
    compiled = compile_targets.compile_tpu(f, a, topology="v6e:2x2", mesh_shape=(1,))
    hlo = compiled.as_text()
    found = dequantised_copies(hlo, shapes)
    print(f"mxfp4 at Qwen3-30B-A3B shapes, T=64: compiled for v6e in "
          f"{time.perf_counter() - t0:.1f} s, {hlo.count('tpu_custom_call')} Mosaic calls, "
          f"temporaries {compiled.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB, "
          f"dequantised copies: {'none (PASS)' if not found else found[:3]}; the kernels "
          f"read {sorted(_kernel_weight_roots(hlo, min_elements=min_elements))}")


def qwen3_shapes(T=64, D=2048, F=768, E=128, A=8):
    sd = jax.ShapeDtypeStruct
    a = (sd((T, D), jnp.bfloat16), sd((T, E), jnp.float32),
         sd((L, E, *S.stored_shape(D, 2 * F)), S.weight_dtype),
         sd((L, E, *S.stored_shape(F, D)), S.weight_dtype),
         sd((L, E, *S.scale_shape(D, 2 * F)), S.scale_dtype),
         sd((L, E, *S.scale_shape(F, D)), S.scale_dtype), sd((), jnp.int32))

    def f(x, logits, w_gu, w_d, s_gu, s_d, layer):
        return tpu.moe_ffn_tpu(x, logits, w_gu, w_d, layer=layer, top_k=A,
                               norm_topk_prob=True, scales=(s_gu, s_d), scheme=S)[0]

    shapes = {s for w in [(L, E, D, 2 * F), (L, E, F, D)] for s in (w, w[1:], (1, *w[1:]))}
    return f, a, shapes, E * F * D // 2


def dequantise_then_kernel(x, logits, w_gu, w_d, b_gu, b_d, s_gu, s_d, layer):
    deq = [quant.ref_dequantize(w, s, S, jnp.bfloat16) for w, s in ((w_gu, s_gu), (w_d, s_d))]
    return tpu.moe_ffn_tpu(x, logits, *deq, layer=layer, top_k=A, norm_topk_prob=True,
                           biases=(b_gu, b_d),
                           activation=moe.MoEActivation("gpt_oss_clamped"))[0]


if __name__ == "__main__":
    main()
