from lp_jax.models.metadata import AttentionMetadata, build_metadata
from lp_jax.models.qwen3_moe import KernelBackends, Qwen3MoeForCausalLM, init_kv_cache

__all__ = [
    "AttentionMetadata",
    "KernelBackends",
    "Qwen3MoeForCausalLM",
    "build_metadata",
    "init_kv_cache",
]
