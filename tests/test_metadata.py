"""The vectorised decode-batch metadata equals the general builder's."""

import numpy as np

from lp_jax.models.metadata import build_decode_metadata, build_metadata


def test_decode_fast_path_matches_general_builder():
    rng = np.random.default_rng(0)
    for n in (0, 1, 5, 8):
        seqs = []
        for _ in range(n):
            length = int(rng.integers(1, 100))
            pages = rng.permutation(200)[: (length + 15) // 16].tolist()
            seqs.append((length - 1, 1, pages))
        want = build_metadata(seqs, page_size=16, num_tokens=8, num_seqs=8, pages_per_seq=8)
        got = build_decode_metadata([s[0] for s in seqs], [s[2] for s in seqs], page_size=16,
                                    num_seqs=8, pages_per_seq=8)
        for field in ("positions_T", "slots_T", "query_start_B1", "seq_lens_B",
                      "page_table_BC", "num_seqs"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), field)
