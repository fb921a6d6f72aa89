"""The Pallas attention kernels under data-parallel attention, on the host's 8 simulated
CPUs with the kernels in the Pallas interpreters.

Each data rank runs the single-rank kernel on its own rows, its ranked metadata's view and
its shard of the pool: the kernels' shard_map over the heads nests inside `per_rank`'s
over "data" (`sharded_kernels.kernel_mesh`). Checked by behaviour:

* GQA: tiny-h128 (the TPU kernel's head_dim 128) on DP 2 x TP 4 under layered, and MLA:
  tiny-deepseek-a128 (the MLA kernel's 128-wide latent) on DP 2 x TP 1 under chunked,
  give Hugging Face's greedy tokens (tests/golden) with prompts arriving while others
  decode, so ragged steps and decode-only steps both run the kernels;
* after every step each sequence's pages lie in one rank's range; at the end every page
  is free, one program served, nothing compiled while serving;
* the compiled program gathers no pool: each rank's kernels read its shard in place;
* the GPU kernels (Triton, interpreted), ragged and decode, per rank on DP 2 x TP 4 give
  XLA's attention on a ranked batch.

Two engines, one program each; the golden files' prompts, of which only NEW_TOKENS tokens
are compared.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN_ENGINES, run_golden_prompts
from test_dp_families import PAGES_PER_RANK, RankChecked, lazy_dp_engines

from checkpoints.make_tiny import ensure_tiny
from lp_jax.models.metadata import build_metadata
from pallas_kernels import attention

GOLDEN = "tests/golden/{}.npz"
NEW_TOKENS = 3
MAX_PROGRAMS = 32  # the start-up budget at defaults (tests/test_programs.py)
# (preset, data ranks, tensor ranks, policy). GQA: the heads' shard_map nests inside the
# ranks' (t = 4); MLA: its layout for a slice, t = 1 (docs/data_parallel.md).
LAYOUTS = {"gqa-layered": ("tiny-h128", 2, 4, "layered"),
           "mla-chunked": ("tiny-deepseek-a128", 2, 1, "chunked")}
# One row bucket a rank. The interpreter's cost follows the rows times the steps: layered
# runs best with the golden engines' budget, chunked with a smaller one.
SHAPES = {"layered": GOLDEN_ENGINES["layered"],
          "chunked": dict(scheduling="chunked", max_num_batched_tokens=16, token_buckets=(20,))}


def _warm_interpreter():
    """One call of the TPU kernel on one device. The TPU interpreter compiles a host-side
    helper of its own (an `unstack` of the grid index its callbacks read) on its first
    kernel run in a process; run here, it is not counted as the engine's compile while
    serving."""
    meta = build_metadata([(0, 1, [0])], page_size=8, num_tokens=1, num_seqs=1,
                          pages_per_seq=1)
    with attention.interpret_mode():
        attention.ragged_paged_attention(
            jnp.ones((1, 1, 128)), jnp.ones((1, 8, 2, 128)), meta.query_start_B1,
            meta.seq_lens_B, meta.page_table_BC, meta.num_seqs, sm_scale=1.0, backend="tpu")


@pytest.fixture(scope="module")
def dp_pallas_engine():
    """dp_pallas_engine(name): the engine of LAYOUTS[name] with the TPU attention kernel
    (interpreted; XLA's MoE), built on first use (layered: two layer groups).
    backends="off": no start-up self-test, so nothing can fall back to XLA unseen."""
    _warm_interpreter()
    get, built = lazy_dp_engines(LAYOUTS, SHAPES, env={"LP_JAX_PALLAS_INTERPRET": "1"},
                                 attention_backend="tpu", moe_backend="xla")
    yield get
    for llm in built.values():
        llm.shutdown()


def _all_gather_shapes(hlo_text: str) -> list[tuple[int, ...]]:
    """The result shape (one device's) of every all-gather in compiled HLO text."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{?[\d,]*\}? all-gather(?:-start)?\(", hlo_text)
    return [tuple(int(d) for d in s.split(",") if d) for s in shapes]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pallas_attention_per_rank_gives_the_golden_tokens(dp_pallas_engine, name):
    """Prompts of 5, 17 and 40 tokens, the later two arriving while the first decodes:
    spread over the ranks, every rank's kernels serve its rows, the tokens are golden."""
    preset, dp, _, _ = LAYOUTS[name]
    golden = np.load(GOLDEN.format(preset))
    llm = dp_pallas_engine(name)
    stats = llm.stats()
    assert stats["kernel_backends"]["attention"] == "tpu" and not stats["kernel_fallbacks"]
    kv = llm.engine.runner.kv_pages  # each rank's devices hold only its own pages
    assert kv.sharding.spec[0] == "data"
    assert kv.sharding.shard_shape(kv.shape)[0] == kv.shape[0] // dp
    outs = run_golden_prompts(RankChecked(llm.engine), golden, max_tokens=NEW_TOKENS)
    for i in range(3):
        assert outs[i].token_ids == golden[f"greedy_{i}"][:NEW_TOKENS].tolist(), f"prompt {i}"
    stats = llm.stats()
    assert sum(r > 0 for r in stats["data_parallel"]["rows"]) == min(dp, 3)
    assert stats["data_parallel"]["free_pages"] == [PAGES_PER_RANK] * dp
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["compilations_after_warmup"] == 0
    assert stats["programs"] == 1 and stats["startup_compilations"] <= MAX_PROGRAMS
    (program,) = llm.engine.runner.programs.values()
    S, X = kv.shape[1], kv.shape[3]  # no pages of the pool, whole or a shard, gathered
    gathered = _all_gather_shapes(program.as_text())
    assert gathered and not [s for s in gathered if len(s) == 4 and (s[1], s[3]) == (S, X)]


def test_gpu_kernels_per_rank_match_xla():
    """The GPU attention kernels (Triton, interpreted) inside `per_rank` on DP 2 x TP 4,
    the heads' shard_map nested in the ranks' as for the TPU kernels above, ragged and
    decode entry points: XLA's attention on the same ranked batch, each rank's rows
    reading its pool shard with local page ids."""
    from lp_jax.config import ModelConfig
    from lp_jax.models.data_ranks import per_rank
    from lp_jax.models.metadata import build_ranked_metadata
    from lp_jax.models.sharded_kernels import (
        kernel_mesh,
        sharded_decode_attention,
        sharded_ragged_paged_attention,
    )
    from lp_jax.sharding import make_mesh, named_sharding

    K, G, H, S, P_r = 4, 2, 16, 8, 4
    mesh = make_mesh(2, 1, 4)
    cfg = ModelConfig.from_pretrained(ensure_tiny(preset="tiny")).replace(kv_ranks=2)
    # rank 0: a 5-token prompt and 3 tokens after 6 cached; rank 1: one 7-token prompt
    ragged = build_ranked_metadata([[(0, 5, [0]), (6, 3, [1, 2])], [(0, 7, [3])]],
                                   page_size=S, num_tokens=8, num_seqs=2, pages_per_seq=2)
    decode = build_ranked_metadata([[(8, 1, [1, 2]), (3, 1, [0])], [(9, 1, [3, 0])]],
                                   page_size=S, num_tokens=2, num_seqs=2, pages_per_seq=2)
    kq, kp = jax.random.split(jax.random.key(1))
    pool = jax.random.normal(kp, (2 * P_r, S, 2 * K, H), jnp.float32)
    pool = jax.device_put(pool, named_sharding(("kv_pages", None, "kv_combined_heads", None),
                                               pool.shape, mesh))

    def run(kernel, meta, rows, backend):
        q = jax.random.normal(kq, (rows, K * G, H), jnp.float32)
        q = jax.device_put(q, named_sharding(("batch", "q_heads", None), q.shape, mesh))

        def body(cfg, kv, meta, q):
            return kernel(kernel_mesh(q), q, kv, meta, backend), kv

        with attention.interpret_mode():
            return jax.jit(lambda kv, q: per_rank(cfg, body, kv, meta, q)[0])(pool, q)

    def ragged_kernel(mesh, q, kv, m, backend):
        return sharded_ragged_paged_attention(mesh, q, kv, m.query_start_B1, m.seq_lens_B,
                                              m.page_table_BC, m.num_seqs, sm_scale=0.1,
                                              backend=backend)

    def decode_kernel(mesh, q, kv, m, backend):
        return sharded_decode_attention(mesh, q, kv, m.seq_lens_B, m.page_table_BC,
                                        sm_scale=0.1, backend=backend)

    for kernel, meta, rows in ((ragged_kernel, ragged, 16), (decode_kernel, decode, 4)):
        want = run(kernel, meta, rows, "xla")
        got = run(kernel, meta, rows, "gpu")
        mask = np.asarray(meta.slots_T) >= 0  # padding rows are left unspecified
        np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask],
                                   rtol=1e-5, atol=1e-5)


def test_the_cuda_aot_compiles_for_one_hosts_gpus(monkeypatch):
    """`python -m lp_jax.aot --platform cuda` takes a mesh of up to 8 GPUs (one host), so
    a data-parallel layout compiles for the H200 as for a TPU slice; an export (no CUDA
    plugin) stays one device."""
    import pallas_kernels.compile_targets as ct
    from lp_jax.aot import AotConfig, build, load_config

    AotConfig(platform="cuda", mesh_shape=(2, 1, 4))
    with pytest.raises(ValueError, match="at most 8 GPUs"):
        AotConfig(platform="cuda", mesh_shape=(4, 1, 4))
    if ct.cuda_compiler_missing() is None:
        devices = ct.cuda_topology_devices("h200", 8)
        assert len(devices) == 8 and {d.process_index for d in devices} == {0}
    monkeypatch.setattr(ct, "cuda_compiler_missing", lambda: "no CUDA compiler (a test)")
    with pytest.raises(ValueError, match="needs the CUDA plugin"):
        build(load_config("checkpoints/configs/deepseek-v3-reduced.json"),
              AotConfig(platform="cuda", mesh_shape=(2, 1, 4)))
