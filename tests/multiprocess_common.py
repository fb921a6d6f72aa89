"""Shared by test_multiprocess.py and its worker processes: two of the Hugging Face
golden prompts of the tiny model (tests/golden/tiny.npz) and the engine arguments."""

from pathlib import Path

import numpy as np

_GOLDEN = np.load(Path(__file__).parent / "golden" / "tiny.npz")
PROMPTS = [_GOLDEN[f"prompt_{i}"].tolist() for i in range(2)]
NEW_TOKENS = 6
GOLDEN_TOKENS = [_GOLDEN[f"greedy_{i}"][:NEW_TOKENS].tolist() for i in range(2)]
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 64),
                   layer_groups=2)
