"""GLM-4.5 / 4.6 (Hugging Face `glm4_moe`, Glm4MoeForCausalLM): the Qwen3-MoE stack with
the MoE blocks the DeepSeek-V3 family shares, each switched on by the config.

What differs from Qwen3-MoE, each checked against transformers' modeling_glm4_moe.py
(goldens: tests/test_golden_parity.py):

* attention: biases on q/k/v (not o), per-head q/k RMSNorm only with `use_qk_norm`,
  RoPE on the first `partial_rotary_factor` (0.5) of each head's channels;
* the router: sigmoid scores, `e_score_correction_bias` [E] (float32) added to choose
  the experts but not to weight them, group-limited top-k (`n_group`, `topk_group`),
  renormalised and multiplied by `routed_scaling_factor` (`moe.ref.Router`), run by
  every MoE backend and dispatch scheme;
* `n_shared_experts` shared experts, a dense SwiGLU beside the routed ones;
* layers [0, first_k_dense_replace) are dense MLPs, chosen by the layer loop's
  `lax.cond` like Qwen3's `mlp_only_layers`: no program is added.

The blocks live in qwen3_moe.py, so the two families share one layer loop, one loader
mapping and one quantization table. The checkpoint's next-token (MTP) layers
(`model.layers.{num_hidden_layers}...`) are read only as speculative drafts (mtp.py);
otherwise the loader says in a log line that it skips them.
"""

from __future__ import annotations

from lp_jax.models.qwen3_moe import Qwen3MoeForCausalLM


class Glm4MoeForCausalLM(Qwen3MoeForCausalLM):
    """Glm4MoeForCausalLM: `Qwen3MoeForCausalLM` on a glm4_moe config (see above)."""
