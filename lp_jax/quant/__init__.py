"""Quantized weights: the format a model is served in (config.py), the quantized
linear layer the models call (linear.py), and the loader's side, HF fine-grained FP8
tensors and quantisation at load (load.py). The arrays' layout is pallas_kernels.quant's."""

from lp_jax.quant.config import AT_LOAD, QuantConfig, from_hf, resolve

__all__ = ["AT_LOAD", "QuantConfig", "from_hf", "resolve"]
