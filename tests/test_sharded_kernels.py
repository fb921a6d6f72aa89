"""Pallas kernels per shard of the mesh (lp_jax.models.sharded_kernels), on 8 simulated
CPU devices with the kernels in interpret mode.

* The wrappers give the single-device kernel's outputs (MoE: and its global stats),
  with heads / experts split over the mesh and with the replicated fallback when the
  axis does not divide K / E; MoE also with stacked [L, E, ...] weights and the layer
  a loop counter.
* The engine on a (2, 2) mesh with Pallas backends gives the single-device xla
  model's greedy tokens, and its compiled steps keep the KV pool sharded: no
  all-gather of the pool or of the expert weights, the donated pool comes back in
  its own sharding. It serves tiny-mlp-only (4 layers, 3 of them MoE with 8 experts,
  one dense): the interpreted MoE kernel's grid, which sets the engine's pace here,
  is a quarter of the 8-layer, 16-expert tiny model's, and the dense layer runs
  beside the sharded kernels.

MoE runs the "tpu" kernel only. JAX 0.11.2's Mosaic GPU interpreter keeps its
per-cluster state (register ids, clocks) in one process-wide object and resets it
whenever a cluster finishes, assuming nothing else runs then; with several simulated
devices interpreting at once that fails, and the "gpu" MoE kernel dies at random
(KeyError in `deallocate_buffer`). Attention runs the "gpu" (Triton, HLO
interpreter) kernel on the tiny model and the "tpu" kernel on the head_dim-128 preset.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from checkpoints.make_tiny import ensure_tiny
from lp_jax import LLM, SamplingParams
from lp_jax.loader import load_model
from lp_jax.models import KernelBackends
from lp_jax.models.metadata import build_metadata
from lp_jax.models.sharded_kernels import (
    kernel_mesh,
    sharded_decode_attention,
    sharded_moe_ffn,
    sharded_ragged_paged_attention,
)
from lp_jax.models.simple import greedy_generate
from lp_jax.sharding import make_mesh, named_sharding
from pallas_kernels import attention
from pallas_kernels.moe import moe_ffn

KV_AXES = ("kv_pages", None, "kv_combined_heads", None)  # as the runner shards the pool
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 311, 64, 128, 9], [8, 200, 31, 4, 77]]
NEW_TOKENS = 3  # interpret mode on 4 devices costs ~1.5 s per step


def _put(x, logical_axes, mesh):
    return jax.device_put(x, named_sharding(logical_axes, x.shape, mesh))


# ------------------------------------------------------------------ attention
def _attention_batch(K=2, G=2, H=16, S=8, num_pages=12):
    """A ragged batch (a 5-token prompt, 3 tokens after 9 cached, one padding
    sequence, 2 padding tokens), its decode counterpart, and a random pool."""
    kq, kd, kp = jax.random.split(jax.random.key(0), 3)
    ragged = build_metadata([(0, 5, [0, 1]), (9, 3, [2, 3])], page_size=S, num_tokens=10,
                            num_seqs=3, pages_per_seq=2)
    decode = build_metadata([(6, 1, [4]), (13, 1, [5, 6]), (2, 1, [7])], page_size=S,
                            num_tokens=4, num_seqs=4, pages_per_seq=2)
    q_TNH = jax.random.normal(kq, (10, K * G, H), jnp.float32)
    q_BNH = jax.random.normal(kd, (4, K * G, H), jnp.float32)
    kv_pages_PSJH = jax.random.normal(kp, (num_pages, S, 2 * K, H), jnp.float32)
    return ragged, decode, q_TNH, q_BNH, kv_pages_PSJH


@pytest.mark.parametrize("data,expert,tensor", [
    (1, 2, 2),  # heads split in two
    (2, 1, 4),  # 4 does not divide K = 2: the pool and the kernel are replicated
])
def test_sharded_attention_matches_single_device(data, expert, tensor):
    mesh = make_mesh(data, expert, tensor)
    ragged, decode, q_TNH, q_BNH, kv_pages_PSJH = _attention_batch()
    ragged_args = (ragged.query_start_B1, ragged.seq_lens_B, ragged.page_table_BC,
                   ragged.num_seqs)
    decode_args = (decode.seq_lens_B, decode.page_table_BC)
    kw = dict(sm_scale=0.25, backend="gpu")
    with attention.interpret_mode():
        want_ragged = attention.ragged_paged_attention(q_TNH, kv_pages_PSJH, *ragged_args, **kw)
        want_decode = attention.decode_attention(q_BNH, kv_pages_PSJH, *decode_args, **kw)
        q_TNH, q_BNH = (_put(q, (None, "q_heads", None), mesh) for q in (q_TNH, q_BNH))
        kv_pages_PSJH = _put(kv_pages_PSJH, KV_AXES, mesh)
        got_ragged = jax.jit(lambda *args: sharded_ragged_paged_attention(mesh, *args, **kw))(
            q_TNH, kv_pages_PSJH, *ragged_args)
        got_decode = jax.jit(lambda *args: sharded_decode_attention(mesh, *args, **kw))(
            q_BNH, kv_pages_PSJH, *decode_args)
    np.testing.assert_allclose(got_ragged, want_ragged, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_decode, want_decode, rtol=1e-6, atol=1e-6)


def _all_gather_shapes(hlo_text: str) -> list[str]:
    """Result shapes ("f32[24,8,4,16]") of every all-gather in compiled HLO text."""
    return re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-gather(?:-start)?\(", hlo_text)


def _shape_str(x) -> str:
    return f"{x.dtype.name.replace('float', 'f')}[{','.join(map(str, x.shape))}]"


def test_sharded_attention_keeps_the_pool_sharded():
    """write_kv + attention on a head-sharded pool: the wrapper's program gathers
    nothing, and the donated pool comes back in its own sharding; the GSPMD call
    of the same kernel gathers the whole pool (so the check can fail)."""
    mesh = make_mesh(expert=2, tensor=2)
    ragged, _, q_TNH, _, kv_pages_PSJH = _attention_batch()
    q_TNH = _put(q_TNH, (None, "q_heads", None), mesh)
    kv_pages_PSJH = _put(kv_pages_PSJH, KV_AXES, mesh)
    k_TKH = v_TKH = jnp.ones((10, 2, 16), jnp.float32)

    def step(kernel):
        def f(q_TNH, kv_pages_PSJH):
            kv_pages_PSJH = attention.write_kv(kv_pages_PSJH, k_TKH, v_TKH, ragged.slots_T)
            args = (q_TNH, kv_pages_PSJH, ragged.query_start_B1, ragged.seq_lens_B,
                    ragged.page_table_BC, ragged.num_seqs)
            return kernel(*args, sm_scale=0.25, backend="gpu"), kv_pages_PSJH

        return jax.jit(f, donate_argnums=1).lower(q_TNH, kv_pages_PSJH).compile()

    def sharded(*args, **kw):
        return sharded_ragged_paged_attention(kernel_mesh(args[1]), *args, **kw)

    with attention.interpret_mode():
        per_shard = step(sharded)
        gspmd = step(attention.ragged_paged_attention)
    pool = _shape_str(kv_pages_PSJH)
    assert _all_gather_shapes(per_shard.as_text()) == []
    assert pool in _all_gather_shapes(gspmd.as_text())
    assert per_shard.output_shardings[1].is_equivalent_to(kv_pages_PSJH.sharding, 4)
    assert per_shard.output_shardings[0].is_equivalent_to(q_TNH.sharding, 3)


# ------------------------------------------------------------------------ MoE
@pytest.mark.parametrize("expert,tensor", [
    (2, 2),
    (8, 1),  # two experts per device
    (3, 1),  # 3 does not divide E = 16: the kernel runs replicated
])
def test_sharded_moe_matches_single_device(expert, tensor):
    mesh = make_mesh(expert=expert, tensor=tensor)
    T, D, E, F, A = 12, 64, 16, 32, 4
    kx, kl, kg, kd = jax.random.split(jax.random.key(1), 4)
    x_TD = jax.random.normal(kx, (T, D), jnp.float32)
    logits_TE = jax.random.normal(kl, (T, E), jnp.float32)
    w_gate_up_EDF2 = jax.random.normal(kg, (E, D, 2 * F), jnp.float32) * 0.1
    w_down_EFD = jax.random.normal(kd, (E, F, D), jnp.float32) * 0.1
    kw = dict(top_k=A, norm_topk_prob=True, backend="tpu", interpret=True,
              token_mask_T=jnp.arange(T) < T - 2)
    want_y, want_stats = moe_ffn(x_TD, logits_TE, w_gate_up_EDF2, w_down_EFD, **kw)

    w_gate_up_EDF2 = _put(w_gate_up_EDF2, ("experts", "embed", "expert_mlp"), mesh)
    w_down_EFD = _put(w_down_EFD, ("experts", "expert_mlp", "embed"), mesh)
    got_y, got_stats = jax.jit(
        lambda *args: sharded_moe_ffn(kernel_mesh(args[2]), *args, **kw)
    )(x_TD, logits_TE, w_gate_up_EDF2, w_down_EFD)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-6)
    assert set(got_stats) == set(want_stats)
    for name in want_stats:
        np.testing.assert_array_equal(got_stats[name], want_stats[name], err_msg=name)


@pytest.mark.parametrize("expert", [2, 3])  # 3 does not divide E: replicated
def test_sharded_moe_stacked_weights_in_a_layer_loop(expert):
    """Stacked [L, E, ...] weights split on E (dim 1), the layer a fori_loop counter:
    each layer's output and stats equal the single-device call on w[layer]."""
    mesh = make_mesh(expert=expert)
    L, T, D, E, F, A = 3, 8, 64, 8, 32, 2
    kx, kl, kg, kd = jax.random.split(jax.random.key(2), 4)
    x_TD = jax.random.normal(kx, (T, D), jnp.float32)
    logits_TE = jax.random.normal(kl, (T, E), jnp.float32)
    w_gate_up = jax.random.normal(kg, (L, E, D, 2 * F), jnp.float32) * 0.1
    w_down = jax.random.normal(kd, (L, E, F, D), jnp.float32) * 0.1
    kw = dict(top_k=A, norm_topk_prob=True, backend="tpu", interpret=True,
              token_mask_T=jnp.arange(T) < T - 1)
    want = [moe_ffn(x_TD, logits_TE, w_gate_up[i], w_down[i], **kw) for i in range(L)]

    w_gate_up = _put(w_gate_up, ("layers", "experts", "embed", "expert_mlp"), mesh)
    w_down = _put(w_down, ("layers", "experts", "expert_mlp", "embed"), mesh)

    def layer_loop(x_TD, logits_TE, w_gate_up, w_down):
        def body(layer, carry):
            ys, bytes_L = carry
            y, stats = sharded_moe_ffn(kernel_mesh(w_gate_up), x_TD, logits_TE, w_gate_up,
                                       w_down, layer=layer, **kw)
            return ys.at[layer].set(y), bytes_L.at[layer].set(stats["expert_bytes_loaded"])

        init = (jnp.zeros((L, T, D), x_TD.dtype), jnp.zeros((L,), jnp.float32))
        return jax.lax.fori_loop(0, L, body, init)

    ys, bytes_L = jax.jit(layer_loop)(x_TD, logits_TE, w_gate_up, w_down)
    for i, (want_y, want_stats) in enumerate(want):
        np.testing.assert_allclose(ys[i], want_y, rtol=1e-5, atol=1e-6)
        assert float(bytes_L[i]) == float(want_stats["expert_bytes_loaded"])


# ---------------------------------------------------------------- end to end
ENGINE_PRESET = "tiny-mlp-only"


@pytest.fixture(scope="module")
def sharded_engine():
    """The engine on a (2, 2) mesh with Pallas MoE and attention, after it has
    generated PROMPTS (its programs compile, in interpret mode, while it does).
    backends="off": no start-up self-test (tests/test_kernel_check.py has it), so
    nothing can fall back; the test below checks what served."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LP_JAX_PALLAS_INTERPRET", "1")
        llm = LLM(str(ensure_tiny(preset=ENGINE_PRESET)), mesh_shape=(2, 2),
                  moe_backend="tpu", attention_backend="gpu", scheduling="chunked",
                  max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16,
                  token_buckets=(2, 16), backends="off", kv_pages=8, warmup=False,
                  log=None)
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return llm, [o.token_ids for o in outputs]


def test_sharded_engine_matches_single_device_xla(sharded_engine):
    stats = sharded_engine[0].stats()
    assert stats["kernel_backends"] == {"moe": "tpu", "attention": "gpu"}
    assert not stats["kernel_fallbacks"]
    xla = KernelBackends(moe="xla", attention="xla")
    model = load_model(ensure_tiny(preset=ENGINE_PRESET))
    rows = max(map(len, PROMPTS))  # one prefill and one decode program for both
    want = [greedy_generate(model, p, NEW_TOKENS, backends=xla, prefill_rows=rows,
                            num_pages=-(-(rows + NEW_TOKENS) // 16)) for p in PROMPTS]
    assert sharded_engine[1] == want


def test_sharded_engine_steps_keep_pool_and_experts_sharded(sharded_engine):
    runner = sharded_engine[0].engine.runner
    assert runner.kv_pages.sharding.spec == P(None, None, "tensor")
    mlp = nnx.merge(runner.graphdef, runner.state).model.layers.mlp
    experts = [w for p in (mlp.experts_gate_up_proj, mlp.experts_down_proj)
               for w in (p[...], p[0])]  # all layers, one layer
    assert set(runner.programs) == {16, 2}  # row buckets: prefill, decode
    for prog in runner.programs.values():
        gathered = _all_gather_shapes(prog.as_text())
        for x in (runner.kv_pages, *experts):
            assert _shape_str(x) not in gathered
        assert prog.output_shardings[0].is_equivalent_to(runner.kv_pages.sharding, 4)


def test_tpu_attention_on_a_mesh_matches_single_device_xla(monkeypatch):
    """The TPU attention kernel (head_dim 128 preset) per head shard, with the TPU
    MoE kernel per expert shard, gives the single-device xla model's tokens: those of
    Hugging Face's golden file, which tests/test_golden_parity.py checks the
    single-device model gives (its 5-token prompt 0: the interpreter's cost grows with
    the tokens), and its prompt logits within the golden tolerance."""
    golden = np.load("tests/golden/tiny-h128.npz")
    monkeypatch.setenv("LP_JAX_PALLAS_INTERPRET", "1")
    model = load_model(ensure_tiny(preset="tiny-h128"), mesh=make_mesh(expert=2, tensor=2))
    got, logits = greedy_generate(model, golden["prompt_0"].tolist(), NEW_TOKENS,
                                  backends=KernelBackends(moe="tpu", attention="tpu"),
                                  return_prompt_logits=True)
    assert got == golden["greedy_0"][:NEW_TOKENS].tolist()
    np.testing.assert_allclose(logits, golden["logits_0"], rtol=0, atol=1e-4)
