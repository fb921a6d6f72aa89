"""lp_jax: layered-prefill serving for Mixture-of-Experts LLMs in JAX.

`LLM` and `SamplingParams` are imported lazily, so that the pure-Python parts
(scheduler, simulator, roofline tables) load without JAX. `__version__` is the installed
package's (pyproject.toml), read on first use.
"""

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    if name == "__version__":
        from lp_jax.version import lp_jax_version

        return lp_jax_version()
    if name == "LLM":
        from lp_jax.llm import LLM

        return LLM
    if name == "SamplingParams":
        from lp_jax.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lp_jax' has no attribute {name!r}")
