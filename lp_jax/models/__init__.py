from lp_jax.models.backends import KernelBackends
from lp_jax.models.deepseek_v3 import DeepseekV3ForCausalLM
from lp_jax.models.glm4_moe import Glm4MoeForCausalLM
from lp_jax.models.gpt_oss import GptOssForCausalLM
from lp_jax.models.kv_cache import init_kv_cache
from lp_jax.models.metadata import AttentionMetadata, build_metadata
from lp_jax.models.qwen3_moe import Qwen3MoeForCausalLM
from lp_jax.models.stacked import StackedCausalLM

# model_type (config.json) -> model class; every class has the interface the engine
# uses (embed, run_units, run_layers, compute_logits, config, dtype).
MODEL_CLASSES: dict[str, type[StackedCausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}


def model_class(model_type: str) -> type[StackedCausalLM]:
    try:
        return MODEL_CLASSES[model_type]
    except KeyError:
        raise ValueError(f"no model class for model_type {model_type!r}; lp_jax has "
                         f"{sorted(MODEL_CLASSES)}") from None


__all__ = [
    "AttentionMetadata",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "KernelBackends",
    "MODEL_CLASSES",
    "Qwen3MoeForCausalLM",
    "StackedCausalLM",
    "build_metadata",
    "init_kv_cache",
    "model_class",
]
