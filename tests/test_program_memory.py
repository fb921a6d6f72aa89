"""Every compiled step program updates the KV pool in place, whatever its row bucket.

A program's temporaries must not grow with the pool: the pool is donated, each call
writes a few rows into it, and nothing else the step holds is near its size. A copy of
it costs the pool's bytes in every layer of every step, which a 1-row decode once did on
XLA:CPU (93 ms a token against 1.7 ms at 2 rows, 1,024 pages): its one-row KV write
became a dynamic-update-slice fused with the reshape back to the pool's shape, which XLA
does not update in place. One small engine, buckets 1 and 2, a pool large enough
(33.5 MB) that a copy stands out against the ~0.2 MB the programs need.
"""

import re

import pytest

from lp_jax import LLM
from lp_jax.aot.audit import pool_copies

BUCKETS = (1, 2)


@pytest.fixture(scope="module")
def runner(tiny_dir):
    llm = LLM(tiny_dir, kv_pages=1024, max_model_len=512, scheduling="chunked", max_num_seqs=2,
              max_num_batched_tokens=2, token_buckets=BUCKETS, compilation_cache_dir=None,
              log=None)
    return llm.engine.runner


def _pool_parameter(hlo: str) -> int:
    """The entry parameter number of the KV pool in a compiled program's HLO."""
    m = re.search(r"%kv_pages\S* = \S+ parameter\((\d+)\)", hlo)
    assert m, "no kv_pages parameter in the compiled HLO"
    return int(m.group(1))


@pytest.mark.parametrize("rows", BUCKETS)
def test_program_updates_the_pool_in_place(runner, rows):
    pool = runner.kv_pages
    program = runner.programs[rows]
    hlo = program.as_text()
    temp = program.memory_analysis().temp_size_in_bytes
    copies = pool_copies(hlo, pool.size)
    assert temp < 0.25 * pool.nbytes and not copies, (
        f"{rows}-row program: temporaries {temp / 2**20:.1f} MiB against a "
        f"{pool.nbytes / 2**20:.1f} MiB pool; copies of the pool: {copies}")
    # Output 0 (the new pool) shares the buffer of the pool argument.
    header = hlo.split("\n", 1)[0]
    assert re.search(rf"\{{0\}}: \({_pool_parameter(hlo)}, \{{\}}, (may|must)-alias\)",
                     header), header[:300]
