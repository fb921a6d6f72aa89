"""Quantized weights: the format a model is served in (config.py), the quantized
linear layer the models call (linear.py), the loader's side, HF fine-grained FP8
tensors and quantisation at load (load.py), and GPT-OSS's MXFP4 kept in 4 bits
(mxfp4.py). The arrays' layout is pallas_kernels.quant's."""

from lp_jax.quant.config import AT_LOAD, REQUESTABLE, QuantConfig, from_hf, resolve

__all__ = ["AT_LOAD", "REQUESTABLE", "QuantConfig", "from_hf", "resolve"]
