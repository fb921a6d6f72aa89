"""lp_jax: layered-prefill serving for Mixture-of-Experts LLMs in JAX.

`LLM` and `SamplingParams` are imported lazily, so that the pure-Python parts
(scheduler, simulator, roofline tables) load without JAX.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from lp_jax.llm import LLM

        return LLM
    if name == "SamplingParams":
        from lp_jax.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lp_jax' has no attribute {name!r}")
