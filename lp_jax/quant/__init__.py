"""Quantized weights: the format a model is served in (config.py), the quantized
linear layer the models call (linear.py) and GPT-OSS's MXFP4 kept in 4 bits
(mxfp4.py). The loader's side (HF fine-grained FP8 tensors, quantisation at load) is
lp_jax/loader_quant.py, on the loader's floor. The arrays' layout is pallas_kernels.quant's."""

from lp_jax.quant.config import AT_LOAD, REQUESTABLE, QuantConfig, from_hf, resolve

__all__ = ["AT_LOAD", "REQUESTABLE", "QuantConfig", "from_hf", "resolve"]
