"""Speculative decoding: draft proposers, the configuration, and exact verification.

- `config.py`: `SpeculativeConfig`, vLLM's `speculative_config` dict, validated once;
- `ngram.py`: the n-gram (prompt lookup) proposer, host-side, no model.

The acceptance test runs on device beside the sampler (lp_jax/executor/verify.py):
greedy, and rejection sampling with the bonus token, which keeps the output
distribution the target model's.
"""

from lp_jax.spec.config import SpeculativeConfig
from lp_jax.spec.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "propose_ngram"]
