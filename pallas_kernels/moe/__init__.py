"""MoE feed-forward: one entry point, `moe_ffn`, with a backend switch.

Backends:
  "xla"  sort + jax.lax.ragged_dot (`ref.ref_moe_ffn`): the reference.
  "xla_tiles"  plain XLA over the kernels' tile layout (`xla_tiles.py`): the CPU path,
         whose cost follows the routing (XLA:CPU runs ragged_dot densely).
  "tpu"  Pallas Mosaic TPU (`tpu.py`): fused-gather gate/up kernel with the SwiGLU
         epilogue (biases and activation included), then the same tile-grid kernel for
         the down projection (its bias in the epilogue).
  "gpu"  Pallas Mosaic GPU for Hopper (`gpu.py`): a tile-list grouped matmul (WGMMA),
         gate/up with the SwiGLU epilogue fused, then the same kernel for down; biases
         in the epilogues.
  "auto" tpu on a TPU, gpu on a Hopper (sm_90) GPU with 16-bit weights, xla_tiles
         elsewhere. Never "xla": an export of `lax.ragged_dot` for cuda carries a dense
         fallback body (every expert on every row) that XLA:GPU may pick at compile time,
         so it stays out of "auto" until an H200 run measures it.

Weights: one layer's [E, D, 2F] / [E, F, D] (layer=None), or a stacked model's
[L, E, D, 2F] / [L, E, F, D] with `layer` (a Python int or an int32 scalar, traced
inside a layer loop is fine). The kernel backends address the layer inside the whole
arrays (`ref.stacked_experts`: the expert ids are offset by layer*E into the
[L*E, ...] view), so a layer loop copies no weights; the xla reference slices.

GPT-OSS experts (`biases=(b_gate_up [.., E, 2F], b_down [.., E, D])`, stacked like
the weights, and `activation=MoEActivation("gpt_oss_clamped", limit, alpha)`; see
ref.py) run on every backend, and "auto" resolves for them as for Qwen3. The
activation is one frozen (hashable, jit-static) object that every backend takes
whole. The kernels add the biases in float32 in their epilogues (gate/up bias before
the activation, down bias to each routed row before the weighted combine, as
transformers' GptOssExperts) and take stacked biases whole, like the weights. Without
biases and with the default `SILU` the kernels take exactly the operands they take
for Qwen3.

All backends share routing (`ref.route`, every variant of `ref.Router`), dispatch
order (`ref.dispatch`) and stats (`ref.moe_stats`); the Pallas ones pad each
expert's rows to the kernel tile (`layout.py`) and never read the weights of an expert with no rows.

Quantized experts (issue 31): `scales=(s_gate_up, s_down)` and `scheme=` a
`pallas_kernels.quant.QuantScheme` (int8 or fp8 per channel, HF fine-grained fp8
128 x 128 blocks), stacked like the weights and like `biases=`; None is the 16-bit
path. W8A16 on every backend: tiles of the 8-bit weights are converted on chip, the
dots accumulate in float32 and the scales multiply the float32 sums (per channel in
the epilogue, per 128-row K block in the K loop on TPU). Both kernels take them: the
TPU kernels convert weight blocks in VMEM (`tpu_quant.py`); the Hopper kernel, whose
WGMMA takes N-major B tiles only in 16 bits, converts each K step's 8-bit tiles into
16-bit shared memory (`gpu.py`). "auto" on Hopper takes 8-bit weights with scales to the
kernel (16-bit x), packed MXFP4 too where D and F are multiples of 64 and at least 128
(else xla_tiles: `gpu.mxfp4_fits`); 8-bit weights without
scales are refused everywhere (`ref.py`).

Interpret mode (run the Pallas kernels on CPU, for tests): pass `interpret=True`, or
set the environment variable LP_JAX_PALLAS_INTERPRET=1 (read at trace time) to make
`interpret=None` (the default) mean True. TPU kernels then run under
`pltpu.InterpretParams()`, GPU kernels under `plgpu.InterpretGPUParams()`.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.moe.ref import SILU, SOFTMAX, MoEActivation, Router, ref_moe_ffn
from pallas_kernels.moe.xla_tiles import moe_ffn_xla_tiles
from pallas_kernels.platform import target_platform
from pallas_kernels.quant import QuantScheme

BACKENDS = ("auto", "xla", "xla_tiles", "tpu", "gpu")
INTERPRET_ENV = "LP_JAX_PALLAS_INTERPRET"


def _is_hopper() -> bool:
    target = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if target is not None:  # an ahead-of-time compile for an absent device
        return any(name in target.device_kind for name in ("H100", "H200", "H800", "GH200"))
    try:
        cc = getattr(jax.devices()[0], "compute_capability", None)
    except RuntimeError:
        return False
    return cc is not None and str(cc).split(".")[0] == "9"


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = target_platform()
    if platform == "tpu":
        return "tpu"
    if platform == "gpu" and _is_hopper():
        return "gpu"
    return "xla_tiles"


def resolve_interpret(interpret):
    """None -> $LP_JAX_PALLAS_INTERPRET; a bool or an interpreter params object passes."""
    if interpret is not None:
        return interpret
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def moe_ffn(
    x_TD: jax.Array,
    router_logits_TE: jax.Array,
    w_gate_up_LEDF2: jax.Array,
    w_down_LEFD: jax.Array,
    *,
    layer=None,
    top_k: int,
    norm_topk_prob: bool,
    backend: str = "auto",
    token_mask_T: jax.Array | None = None,
    interpret=None,
    biases=None,
    activation: MoEActivation = SILU,
    scales=None,
    scheme: QuantScheme | None = None,
    router: Router = SOFTMAX,
    correction_bias_E: jax.Array | None = None,
):
    """Routes tokens to experts and runs the SwiGLU experts. Returns (y_TD, stats).

    w_gate_up_LEDF2 / w_down_LEFD: [E, D, 2F] / [E, F, D] with layer=None, else the
      stacked [L, E, D, 2F] / [L, E, F, D] and the layer to run.
    token_mask_T marks real tokens (padding rows activate no expert and return 0).
    stats: tokens_per_expert [E], experts_activated, expert_bytes_loaded (one layer).
    interpret: run the Pallas backends in interpret mode: True/False, None (default:
      $LP_JAX_PALLAS_INTERPRET), or a `pltpu.InterpretParams` / `plgpu.InterpretGPUParams`
      for the tpu / gpu backend. Ignored by xla.
    biases: None, or GPT-OSS's (b_gate_up, b_down), stacked like the weights.
    activation: a `MoEActivation` (default SILU; GPT-OSS's clamped SwiGLU). Both (ref.py)
      on every backend.
    scales, scheme: None (16-bit weights), or int8 / fp8 weights' (s_gate_up, s_down)
      and their `quant.QuantScheme` (above).
    router, correction_bias_E: the routing variant (a static `ref.Router`: softmax or
      sigmoid scores, group-limited top-k, routed_scaling_factor) and its [E] float
      correction bias (chooses experts, does not weight them); `ref.route`.
    """
    auto = backend == "auto"
    backend = resolve_backend(backend)
    mma_itemsize = (x_TD.dtype if scales else w_gate_up_LEDF2.dtype).itemsize
    if auto and backend == "gpu" and mma_itemsize != 2:
        backend = "xla_tiles"  # the Hopper kernel multiplies in 16 bits only
    if auto and backend == "gpu" and scheme is not None and scheme.pack > 1:
        from pallas_kernels.moe.gpu import mxfp4_fits

        if not (mxfp4_fits(x_TD.shape[-1]) and mxfp4_fits(w_down_LEFD.shape[-2] * 2)):
            backend = "xla_tiles"  # the Hopper kernel's 128-row MXFP4 steps (gpu.py)
    kwargs = dict(layer=layer, top_k=top_k, norm_topk_prob=norm_topk_prob,
                  token_mask_T=token_mask_T, biases=biases, activation=activation,
                  scales=scales, scheme=scheme, router=router,
                  correction_bias_E=correction_bias_E)
    args = (x_TD, router_logits_TE, w_gate_up_LEDF2, w_down_LEFD)
    if backend == "xla":
        return ref_moe_ffn(*args, **kwargs)
    if backend == "xla_tiles":
        return moe_ffn_xla_tiles(*args, **kwargs)
    if backend == "tpu":
        from pallas_kernels.moe.tpu import moe_ffn_tpu

        return moe_ffn_tpu(*args, **kwargs, interpret=resolve_interpret(interpret))
    from pallas_kernels.moe.gpu import moe_ffn_gpu

    return moe_ffn_gpu(*args, **kwargs, interpret=resolve_interpret(interpret))
