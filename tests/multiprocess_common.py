"""Shared by test_multiprocess.py and its worker processes: two of the Hugging Face
golden prompts of the tiny model (tests/golden/tiny.npz) and of tiny-deepseek (the MTP
run's), and the engine arguments."""

from pathlib import Path

import numpy as np

_GOLDEN = np.load(Path(__file__).parent / "golden" / "tiny.npz")
PROMPTS = [_GOLDEN[f"prompt_{i}"].tolist() for i in range(2)]
NEW_TOKENS = 6
GOLDEN_TOKENS = [_GOLDEN[f"greedy_{i}"][:NEW_TOKENS].tolist() for i in range(2)]
# One row bucket: 36 rows hold chunked's 32-token budget and layered's 32 prefill rows
# beside 4 decodes, so each engine compiles one program (prefill and decode steps both
# run it). lp-serve in test_multiprocess.py runs chunked with these arguments, so its
# program is the worker's, read back from the run's compilation cache.
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(36,),
                   layer_groups=2)
# The DP 2 x TP 4 run's pages a rank: both prompts' KV (5 + 12 and 17 + 12 tokens and 3
# drafts past them, 16-token pages: 2 + 2) fit one rank, so the placement, not the room,
# spreads them.
DP_PAGES = 4
# The DP run's model: tiny-deepseek with a two-token MTP head (conftest.two_token_mtp_dir),
# its golden prompts 0 and 1 (tests/golden/tiny-deepseek.npz) and 3 drafts a step. Prompt
# 0's tokens 8..11 (237, 237, 237, 446) are ones the head drafts, so some drafts stand.
_MTP_GOLDEN = np.load(Path(__file__).parent / "golden" / "tiny-deepseek.npz")
MTP_PROMPTS = [_MTP_GOLDEN[f"prompt_{i}"].tolist() for i in range(2)]
MTP_NEW_TOKENS, MTP_DRAFTS = 12, 3
MTP_GOLDEN_TOKENS = [_MTP_GOLDEN[f"greedy_{i}"][:MTP_NEW_TOKENS].tolist() for i in range(2)]


def eagle3_config(head_dir) -> dict:
    """The chunked run's (and lp-serve's) drafts: test_spec_eagle's two-token EAGLE-3 head
    for tiny, whose drafts (289, 194) prompt 0's greedy tokens repeat, 3 a step."""
    return {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}
