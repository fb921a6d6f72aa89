"""The model with each Pallas backend (interpret mode on CPU) reproduces the golden
Hugging Face greedy tokens. TPU attention cannot run in JAX's interpreters (see
test_attention_kernels.py), so the TPU MoE kernel runs beside the XLA attention."""

import numpy as np
import pytest

from lp_jax.models import KernelBackends
from lp_jax.models.simple import greedy_generate

NEW_TOKENS = 8  # interpret mode runs ~1 s per decode step on this model


@pytest.mark.parametrize("moe,attention", [("tpu", "xla"), ("gpu", "gpu"), ("xla", "xla")])
def test_pallas_backends_match_golden(monkeypatch, tiny_model, moe, attention):
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    golden = np.load("tests/golden/tiny.npz")
    prompt, want = golden["prompt_1"].tolist(), golden["greedy_1"].tolist()
    tokens = greedy_generate(tiny_model, prompt, NEW_TOKENS,
                             backends=KernelBackends(moe=moe, attention=attention))
    assert tokens == want[:NEW_TOKENS]
