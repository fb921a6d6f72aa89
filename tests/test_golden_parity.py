"""lp_jax against Hugging Face transformers: golden logits and greedy continuations.

The golden files come from tests/golden/make_golden.py (transformers on CPU,
float32). Tolerance: 1e-4 absolute on float32 logits; greedy tokens identical.

Pages of PAGE_SIZE = 36 tokens: every prompt with its 32 greedy tokens (37, 49 and 72
tokens) then takes 2 pages, so one decode program serves a preset's three prompts
(16-token pages need 3, 4 and 5, three programs), every prefill is padded to the longest
prompt (one prefill program; the padding must leave the logits as they are), and every
sequence still crosses a page boundary (prompt 2 already in its prefill).
"""

import re

import numpy as np
import pytest

from checkpoints.make_tiny import PRESETS, ensure_tiny
from lp_jax.loader import load_model
from lp_jax.models.simple import greedy_generate

GOLDEN = "tests/golden/{}.npz"
PAGE_SIZE = 36


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_matches_transformers(preset):
    golden = np.load(GOLDEN.format(preset))
    model = load_model(ensure_tiny(preset=preset))
    n = len([k for k in golden.files if re.fullmatch(r"prompt_\d+", k)])
    assert n >= 3
    totals = [len(golden[f"prompt_{i}"]) + len(golden[f"greedy_{i}"]) for i in range(n)]
    assert {-(-t // PAGE_SIZE) for t in totals} == {2}  # one decode program, two pages
    # one prefill program: every prompt padded to the longest (the padding rows must
    # leave the real rows' logits Hugging Face's)
    rows = max(len(golden[f"prompt_{i}"]) for i in range(n))
    for i in range(n):
        prompt = golden[f"prompt_{i}"].tolist()
        want = golden[f"greedy_{i}"].tolist()
        tokens, logits = greedy_generate(model, prompt, len(want), page_size=PAGE_SIZE,
                                         return_prompt_logits=True, prefill_rows=rows)
        np.testing.assert_allclose(logits, golden[f"logits_{i}"], rtol=0, atol=1e-4)
        assert tokens == want, f"{preset} prompt {i}: greedy continuation differs"
