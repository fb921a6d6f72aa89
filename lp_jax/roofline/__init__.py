"""Hardware-agnostic roofline model for layered prefill on Mixture-of-Experts models.

Design note. The layered-prefill argument (docs: /work/shared/papers.md section 1) is a
roofline argument: chunked prefill reloads every layer's expert weights once per chunk,
and a chunk of T tokens gives each expert only k*T/E rows, far below the ridge point of
any current accelerator. This package turns that argument into numbers for any
`ModelShape` on any `Hardware` entry:

- `hardware`    -- vendor-sourced accelerator table, ridge points, a device microbenchmark;
- `model_shape` -- the shape of a Qwen3-MoE / Qwen3 / GPT-OSS model from its HF config;
- `formats`     -- stored bytes of the weight formats (bf16, int8, fp8, fp8_block, fp4)
                   and KV formats (bf16, fp8), scales included;
- `routing`     -- expected activated experts E_act(T): uniform, Zipf-skewed, measured;
- `padding`     -- rows a grouped matmul really computes once each expert is tile-padded;
- `cost_model`  -- per-op FLOPs and HBM bytes of one layer step, per device (tp, ep);
- `ridge`       -- where the MoE turns compute-bound, the paper's Fig. 2 chunk table,
                   and the marginal expert traffic of prefill next to a decode batch;
- `knee`        -- a measured recheck: sweep a MoE callable over tokens per call;
- `plots`       -- matplotlib figures (imported lazily).

Everything except `measure_current_device`, `knee` and `plots` is numpy-only.
`python -m lp_jax.roofline` prints the tables and writes the plots.
"""

from lp_jax.roofline.cost_model import (
    LayerCost,
    OpCost,
    StepTokens,
    layer_cost,
    lm_head_cost,
    model_step_cost,
)
from lp_jax.roofline.formats import KV_FORMATS, WEIGHT_FORMATS, WeightFormat
from lp_jax.roofline.hardware import (
    HARDWARE,
    Hardware,
    Sources,
    get_hardware,
    measure_current_device,
)
from lp_jax.roofline.knee import KneePoint, KneeResult, make_default_moe, measure_moe_knee
from lp_jax.roofline.model_shape import (
    GPT_OSS_20B,
    LLAMA3_8B,
    QWEN3_30B_A3B,
    ModelShape,
    resolve_model,
)
from lp_jax.roofline.padding import expected_padded_rows
from lp_jax.roofline.ridge import (
    ChunkRow,
    ComputeBound,
    LayeredSaving,
    MarginalTraffic,
    compute_bound_tokens,
    fig2_table,
    layered_marginal_saving,
    marginal_expert_traffic,
    moe_intensity,
    tokens_per_expert,
)
from lp_jax.roofline.routing import (
    QWEN3_ZIPF_EXPONENT,
    MeasuredRouting,
    UniformRouting,
    ZipfRouting,
    expected_active,
    fit_zipf_exponent,
)

__all__ = [
    "GPT_OSS_20B",
    "HARDWARE",
    "KV_FORMATS",
    "LLAMA3_8B",
    "QWEN3_30B_A3B",
    "QWEN3_ZIPF_EXPONENT",
    "ChunkRow",
    "ComputeBound",
    "Hardware",
    "KneePoint",
    "KneeResult",
    "LayerCost",
    "LayeredSaving",
    "MarginalTraffic",
    "MeasuredRouting",
    "ModelShape",
    "OpCost",
    "Sources",
    "StepTokens",
    "UniformRouting",
    "WEIGHT_FORMATS",
    "WeightFormat",
    "ZipfRouting",
    "compute_bound_tokens",
    "expected_active",
    "expected_padded_rows",
    "fig2_table",
    "fit_zipf_exponent",
    "get_hardware",
    "layer_cost",
    "layered_marginal_saving",
    "lm_head_cost",
    "make_default_moe",
    "marginal_expert_traffic",
    "measure_current_device",
    "measure_moe_knee",
    "model_step_cost",
    "moe_intensity",
    "resolve_model",
    "tokens_per_expert",
]
