"""GPT-OSS-20B's experts quantized (int8 / fp8 per channel, at load) through the TPU MoE
kernels, compiled for a v6e with the real Mosaic compiler (libtpu, no TPU needed): the
stacked [2, 32, 2880, 5760] / [2, 32, 2880, 2880] 8-bit weights with their scales,
biases and the clamped SwiGLU, traced layer. Prints, per scheme, the compile time, the
temporaries against one layer's experts, and the audit's dequantised-copy check
(lp_jax/aot/audit.py: no 16/32-bit value shaped like the quantized experts).

    .venv/bin/python launch/compile_gpt_oss_quant.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lp_jax.aot.audit import dequantised_copies  # noqa: E402
from pallas_kernels import compile_targets, moe, quant  # noqa: E402
from pallas_kernels.moe import tpu  # noqa: E402

T, D, F, E, A, L = 64, 2880, 2880, 32, 4, 2  # GPT-OSS-20B's experts, 2 stacked layers


def args(scheme):
    sd = jax.ShapeDtypeStruct
    return (sd((T, D), jnp.bfloat16), sd((T, E), jnp.float32),
            sd((L, E, D, 2 * F), scheme.weight_dtype), sd((L, E, F, D), scheme.weight_dtype),
            sd((L, E, 2 * F), jnp.bfloat16), sd((L, E, D), jnp.bfloat16),
            sd((L, E, *scheme.scale_shape(D, 2 * F)), jnp.float32),
            sd((L, E, *scheme.scale_shape(F, D)), jnp.float32), sd((), jnp.int32))


def main():
    shapes = {s for w in [(L, E, D, 2 * F), (L, E, F, D)] for s in (w, w[1:], (1, *w[1:]))}
    for scheme in (quant.INT8, quant.FP8):
        def fn(x, logits, w_gu, w_d, b_gu, b_d, s_gu, s_d, layer, scheme=scheme):
            return tpu.moe_ffn_tpu(x, logits, w_gu, w_d, layer=layer, top_k=A,
                                   norm_topk_prob=True, biases=(b_gu, b_d),
                                   activation=moe.MoEActivation("gpt_oss_clamped"),
                                   scales=(s_gu, s_d), scheme=scheme)[0]

        t0 = time.perf_counter()
        compiled = compile_targets.compile_tpu(fn, args(scheme), topology="v6e:2x2",
                                               mesh_shape=(1,))
        secs = time.perf_counter() - t0
        hlo = compiled.as_text()
        temp = compiled.memory_analysis().temp_size_in_bytes
        layer_bytes = E * 3 * D * F  # one layer's 8-bit experts
        found = dequantised_copies(hlo, shapes)
        print(f"{scheme.name}: compiled for v6e in {secs:.1f} s, "
              f"{hlo.count('tpu_custom_call')} Mosaic calls, temporaries {temp / 1e6:.1f} MB "
              f"(one layer's experts {layer_bytes / 1e6:.0f} MB), dequantised copies: "
              f"{'none (PASS)' if not found else found}")


if __name__ == "__main__":
    main()
