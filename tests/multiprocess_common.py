"""Shared by test_multiprocess.py and its worker processes."""

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 311, 64, 128, 9], [8, 200, 31, 4, 77]]
NEW_TOKENS = 6
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 64),
                   layer_groups=2, compilation_cache_dir=None)
