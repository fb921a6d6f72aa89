"""Every TPU kernel through the real TPU compiler (libtpu on this CPU host), v5e and v6e.

Qwen3-30B-A3B shapes in bfloat16: hidden 2048, 128 experts, top-8, expert width 768;
32 query heads, 4 KV heads, head_dim 128. MoE weights are stacked [L=2, E, ...] and the
layer is a traced argument, so the compile sees what a layer loop sees. Checks:

* MoE (fused-gather gate/up + down, and the unfused gate/up + down): compiles; in the
  compiled HLO every weight operand of the two Mosaic calls is a stacked parameter or
  a bitcast of one (no copy, no slice); temporaries stay below one layer's experts.
  The fused gather is issue 12's finding 2: its former single-row bfloat16 DMAs were
  rejected here ("Offsets along tiled dimensions must be aligned to tiles").
* MoE split over 4 chips by `sharded_moe_ffn` (expert parallel, stacked weights split
  on dim 1): compiles, the same weight checks per shard, no all-gather of weights.
* Attention (`attention/tpu.py`, ragged and decode): compiles, and the pool reaches
  the kernel as a bitcast of the parameter (the kernel's [P, S * 2K, H] view is free).
  In the decode kernel's final LLO (libtpu's dump, from a fresh process) the head
  split shuffles no sublanes and little spills: issue 12's finding 3.
* Attention with GPT-OSS-20B's sinks and a traced sliding window (64 query heads, 8 KV
  heads, head_dim 64, the pool packed [P, S, K, 2H]; and head_dim 128): compiles, the
  pool a bitcast of the parameter. An unpacked [P, S, 2K, 64] pool compiles too, but
  XLA lays it out page-minor and copies all of it into the kernel's row-major layout
  on every call, which is why the kernel refuses it and the packed form exists.
* DeepSeek-V3's latent projections (kv_a_proj_with_mqa, kv_b_proj) in a layer loop:
  row-major parameters, no relayout copy of them.
* A dense projection of an FP8 (128 x 128 block) checkpoint on v5p: held in 16 bits,
  its dot has temporaries of the activations' size, not a dequantised weight.

Skipped, with the reason, when libtpu is not installed (`pip install -e '.[tpu]'`).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import compile_targets

pytestmark = pytest.mark.skipif(
    not compile_targets.libtpu_available(),
    reason=f"libtpu is not importable: {compile_targets.LIBTPU_HINT}")

CHIPS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
L, T, D, E, A, F = 2, 64, 2048, 128, 8, 768  # MoE: layers, tokens, ...
N, K, H, S = 32, 4, 128, 16  # attention: q heads, kv heads, head_dim, page size
sd = jax.ShapeDtypeStruct


def _moe_args():
    return (sd((T, D), jnp.bfloat16), sd((T, E), jnp.float32),
            sd((L, E, D, 2 * F), jnp.bfloat16), sd((L, E, F, D), jnp.bfloat16),
            sd((), jnp.int32))


def _instructions(hlo: str) -> dict[str, tuple[str, str, list[str]]]:
    """name -> (result type, opcode, operand names) for every instruction of an HLO
    module text (names are unique across its computations)."""
    out = {}
    pattern = r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+?\[[\d,]*\])\S* ([\w\-]+)\((.*?)\)"
    for m in re.finditer(pattern, hlo, re.M):
        out[m.group(1)] = (m.group(2), m.group(3), re.findall(r"%([\w.\-]+)", m.group(4)))
    return out


def _elements(hlo_type: str) -> int:
    return math.prod(int(d) for d in re.findall(r"\d+", hlo_type.split("[", 1)[1]))


def _kernel_weight_roots(hlo: str, min_elements: int) -> list[tuple[str, str]]:
    """For every operand of a Mosaic call with at least min_elements elements: the
    opcode and type of what it comes from, following bitcasts (free) only."""
    insts = _instructions(hlo)
    roots = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) =", line).group(1)
        for operand in insts[name][2]:
            if _elements(insts[operand][0]) < min_elements:
                continue
            while insts[operand][1] == "bitcast":
                operand = insts[operand][2][0]
            roots.append((insts[operand][1], insts[operand][0]))
    return roots


def _check_weights_reach_kernels_whole(compiled, experts_per_chip: int):
    hlo = compiled.as_text()
    one_layer = experts_per_chip * D * 2 * F
    roots = _kernel_weight_roots(hlo, min_elements=experts_per_chip * F * D)
    gate_up = ("parameter", f"bf16[{L},{experts_per_chip},{D},{2 * F}]")
    down = ("parameter", f"bf16[{L},{experts_per_chip},{F},{D}]")
    assert sorted(roots) == sorted([gate_up, gate_up, down]), roots  # gate, up; down
    assert compiled.memory_analysis().temp_size_in_bytes < one_layer * 2  # bf16 bytes


@pytest.mark.parametrize("fused_gather", [True, False], ids=["fused_gather", "unfused"])
@pytest.mark.parametrize("chip", CHIPS)
def test_moe_kernels_compile_with_stacked_weights(chip, fused_gather):
    from pallas_kernels.moe import tpu

    def fn(x, logits, w_gate_up, w_down, layer):
        return tpu.moe_ffn_tpu(x, logits, w_gate_up, w_down, layer=layer, top_k=A,
                               norm_topk_prob=True, fused_gather=fused_gather)

    compiled = compile_targets.compile_tpu(fn, _moe_args(), topology=CHIPS[chip],
                                           mesh_shape=(1,))
    _check_weights_reach_kernels_whole(compiled, experts_per_chip=E)


def test_expert_parallel_moe_compiles_on_four_chips():
    from lp_jax.models.sharded_kernels import kernel_mesh, sharded_moe_ffn

    def fn(x, logits, w_gate_up, w_down, layer):
        return sharded_moe_ffn(kernel_mesh(w_gate_up), x, logits, w_gate_up, w_down,
                               layer=layer, top_k=A, norm_topk_prob=True, backend="tpu")

    w_spec = P(None, "expert", None, None)
    compiled = compile_targets.compile_tpu(
        fn, _moe_args(), topology=CHIPS["v6e"], mesh_shape=(1, 4, 1),
        axis_names=("data", "expert", "tensor"), in_specs=(P(), P(), w_spec, w_spec, P()))
    _check_weights_reach_kernels_whole(compiled, experts_per_chip=E // 4)
    assert "all-gather" not in compiled.as_text()


def _attention_args(num_tokens: int):
    pages, batch, pages_per_seq = 8192, 8, 16  # a 256 MB pool stays in HBM, as in serving
    return (sd((num_tokens, N, H), jnp.bfloat16), sd((pages, S, 2 * K, H), jnp.bfloat16),
            sd((batch + 1,), jnp.int32), sd((batch,), jnp.int32),
            sd((batch, pages_per_seq), jnp.int32), sd((), jnp.int32))


@pytest.mark.parametrize("chip", CHIPS)
def test_attention_kernels_compile(chip):
    from pallas_kernels.attention import tpu

    ragged = compile_targets.compile_tpu(
        lambda q, kv, qs, lens, pt, n: tpu.ragged_paged_attention(
            q, kv, qs, lens, pt, n, sm_scale=H ** -0.5),
        _attention_args(num_tokens=64), topology=CHIPS[chip], mesh_shape=(1,))
    q, kv, _, lens, pt, _ = _attention_args(num_tokens=8)
    decode = compile_targets.compile_tpu(
        lambda q, kv, lens, pt: tpu.decode_attention(q, kv, lens, pt, sm_scale=H ** -0.5),
        (q, kv, lens, pt), topology=CHIPS[chip], mesh_shape=(1,))
    pool = ("parameter", f"bf16[{','.join(map(str, kv.shape))}]")
    for compiled in (ragged, decode):
        # The kernel views the pool as [P, S * 2K, H]: a bitcast, never a copy.
        assert _kernel_operand_root(compiled.as_text(), 3) == pool


def _gpt_oss_attention(chip: str, head_dim: int, packed: bool, ragged: bool = True):
    """Ragged (unless not `ragged`: None) and decode kernels compiled with sinks [N] (bf16,
    as the checkpoint holds them) and a traced window, at GPT-OSS-20B heads; returns
    (ragged, decode, pool type)."""
    from pallas_kernels.attention import tpu

    n, k, pages, batch, pages_per_seq = 64, 8, 4096, 8, 16
    kv = sd((pages, S, k, 2 * head_dim) if packed else (pages, S, 2 * k, head_dim),
            jnp.bfloat16)
    sinks, window, i32 = sd((n,), jnp.bfloat16), sd((), jnp.int32), jnp.int32
    lens, pt = sd((batch,), i32), sd((batch, pages_per_seq), i32)
    extras = dict(sm_scale=head_dim ** -0.5)
    if ragged:
        ragged = compile_targets.compile_tpu(
            lambda q, kv, qs, lens, pt, n_seqs, sinks, w: tpu.ragged_paged_attention(
                q, kv, qs, lens, pt, n_seqs, sinks_N=sinks, sliding_window=w, **extras),
            (sd((64, n, head_dim), jnp.bfloat16), kv, sd((batch + 1,), i32), lens, pt,
             sd((), i32), sinks, window), topology=CHIPS[chip], mesh_shape=(1,))
    decode = compile_targets.compile_tpu(
        lambda q, kv, lens, pt, sinks, w: tpu.decode_attention(
            q, kv, lens, pt, sinks_N=sinks, sliding_window=w, **extras),
        (sd((batch, n, head_dim), jnp.bfloat16), kv, lens, pt, sinks, window),
        topology=CHIPS[chip], mesh_shape=(1,))
    return ragged, decode, f"bf16[{','.join(map(str, kv.shape))}]"


@pytest.mark.parametrize("chip", CHIPS)
def test_attention_kernels_compile_with_sinks_and_window(chip):
    """GPT-OSS-20B layers, head_dim 64 in a packed pool: the window is scalar-prefetched
    (operand 2), so the pool is operand 4, a bitcast of the parameter ([P, S, K, 128]
    is row-major)."""
    ragged, decode, pool = _gpt_oss_attention(chip, head_dim=64, packed=True)
    for compiled in (ragged, decode):
        assert _kernel_operand_root(compiled.as_text(), 4) == ("parameter", pool)


def test_head_dim_64_unpacked_pool_is_copied_whole(monkeypatch):
    """Why the kernel refuses an unpacked head_dim 64 pool (tpu.check_constraints): it
    compiles, but XLA's layout for a [P, S, 2K, 64] bf16 pool puts the page axis minor
    (64 lanes would be half padding), so a full-size copy into the kernel's row-major
    layout feeds every call. If this ever fails, the packed form may be unnecessary."""
    from pallas_kernels.attention import tpu

    monkeypatch.setattr(tpu, "check_constraints", lambda q, kv: None)
    _, decode, pool = _gpt_oss_attention("v6e", head_dim=64, packed=False, ragged=False)
    opcode, pool_type = _kernel_operand_root(decode.as_text(), 4)
    assert (opcode, pool_type) == ("copy", pool)
    assert decode.memory_analysis().temp_size_in_bytes >= _elements(pool) * 2  # bf16


def _kernel_operand_root(hlo: str, index: int) -> tuple[str, str]:
    """(opcode, type) of what operand `index` of the one Mosaic call comes from,
    following bitcasts (free) only."""
    insts = _instructions(hlo)
    (line,) = [ln for ln in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in ln]
    operand = insts[re.match(r"^\s*(?:ROOT )?%([\w.\-]+) =", line).group(1)][2][index]
    while insts[operand][1] == "bitcast":
        operand = insts[operand][2][0]
    return insts[operand][1], insts[operand][0]


# Decode at 32 sequences x 4096 tokens: the pool (270 MB) stays in HBM, as in serving.
_DECODE_LLO_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from pallas_kernels import compile_targets
from pallas_kernels.attention import tpu
sd = jax.ShapeDtypeStruct
B, C, S, K, N, H = 32, 256, 16, 4, 32, 128
args = (sd((B, N, H), jnp.bfloat16), sd((B * C, S, 2 * K, H), jnp.bfloat16),
        sd((B,), jnp.int32), sd((B, C), jnp.int32))
compile_targets.compile_tpu(
    lambda q, kv, lens, pt: tpu.decode_attention(q, kv, lens, pt, sm_scale=H ** -0.5),
    args, topology=sys.argv[1], mesh_shape=(1,))
"""


def _decode_kernel_llo(topology: str, dump_dir) -> str:
    """The final LLO bundles of the decode kernel: libtpu dumps them only when told at
    start-up (LIBTPU_INIT_ARGS), so the compile runs in a fresh process."""
    flags = (f"--xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text=true "
             "--xla_jf_dump_llo_pass_label_regex=final_bundles")
    env = {**os.environ, "LIBTPU_INIT_ARGS": flags, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", _DECODE_LLO_SCRIPT, topology], env=env,
                   check=True, timeout=600, capture_output=True,
                   cwd=pathlib.Path(__file__).parents[1])
    (path,) = pathlib.Path(dump_dir).glob("*lp_tpu_ragged_paged_attention*-final_bundles.txt")
    return path.read_text()


@pytest.mark.parametrize("chip", CHIPS)
def test_decode_attention_llo_splits_heads_without_shuffles_or_spills(chip, tmp_path):
    """Issue 12's finding 3: slicing one head out of a loaded [X, 2K, H] page block made
    Mosaic shuffle sublanes (1,792 vrot.slane) and spill ~2,000 vregs per 256-key
    block. Strided loads per head, and acc, m, l in VMEM scratch, leave a few dozen."""
    llo = _decode_kernel_llo(CHIPS[chip], tmp_path)
    assert llo.count("vrot.slane") < 64
    assert llo.count("_spill]") < 256  # each a vld or vst of a spill slot


def test_mla_decode_reads_the_padded_latent_pool_in_place():
    """The MLA decode kernel at DeepSeek-V3's heads (128, latent 512 + 64) on v6e: the
    pool, its rows padded to 640 values (kv_cache.packs_kv), reaches the Mosaic call as
    the parameter (a 576-wide pool is laid out page-minor and copied whole every call:
    launch/compile_mla_kernels.py --unpadded-tpu)."""
    from pallas_kernels.attention import mla_tpu

    B, C, n, A, R = 8, 16, 128, 512, 64
    pool = sd((4096, S, 1, 640), jnp.bfloat16)
    args = (sd((B, n, A), jnp.bfloat16), sd((B, n, R), jnp.bfloat16), pool,
            sd((B + 1,), jnp.int32), sd((B,), jnp.int32), sd((B, C), jnp.int32),
            sd((), jnp.int32))
    compiled = compile_targets.compile_tpu(
        lambda *a: mla_tpu.mla_decode_attention(*a, sm_scale=0.1), args,
        topology=CHIPS["v6e"], mesh_shape=(1,))
    # 3 scalar-prefetch operands, q_lat, q_pe, then the pool
    assert _kernel_operand_root(compiled.as_text(), 5) == ("parameter", "bf16[4096,16,1,640]")


def test_fp8_checkpoint_dense_projections_hold_no_per_step_weight_copy():
    """A DeepSeek-V3 FP8 checkpoint (128 x 128 blocks) on v5p: the dense MLP's up_proj,
    as the model runs it for 64 tokens, compiles with temporaries of the activations'
    size. Held as e4m3 with its block scales (the format the checkpoint stores), the
    compiled dot would build the dequantised weight, and the scale expanded to the
    weight's shape, in float32 on every call (v5p has no FP8 matmul): the model holds
    it dequantised to 16 bits instead (lp_jax.quant.served_scheme)."""
    from flax import nnx

    from checkpoints import make_tiny
    from lp_jax.config import ModelConfig
    from lp_jax.models import model_class

    D, F = 512, 2048
    hf = {**make_tiny.build_config("tiny-deepseek"), "hidden_size": D, "intermediate_size": F,
          "torch_dtype": "bfloat16", "quantization_config": {
              "quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}}
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.quantization.method == "fp8_block" and 0 in cfg.dense_layers
    model = nnx.eval_shape(lambda: model_class(cfg.model_type)(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model.model.layers.dense_mlp)

    def up_proj(state, x_TD):
        mlp = nnx.merge(graphdef, state)
        return model._proj(mlp, "dense_mlp", "up_proj", 0, x_TD)

    compiled = compile_targets.compile_tpu(up_proj, (state, sd((64, D), jnp.bfloat16)),
                                           topology="v5p:2x2x1", mesh_shape=(1,))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < D * F * 2 // 4, f"temporaries {temp} B: a per-step copy of [{D}, {F}]"


def test_mla_latent_projections_are_read_without_relayout_copies():
    """DeepSeek-V3's attention (its latent 512 + 64, heads of 128 + 128; 8 heads, hidden
    1024, 2 layers) in a layer loop on v5p: kv_a_proj_with_mqa and kv_b_proj are
    parameters in the row-major layout, and no copy or transpose in the compiled HLO has
    the size of either, stacked or one layer's. Held as the checkpoint lays them out
    ([L, D, 576], [L, A, N * (H + O)]), kv_b_proj is relaid out whole before the loop
    and again each layer, and the 576-wide stack gets a column-minor layout, which the
    engine's data-parallel step copies whole before its loop (~1 GB of temporaries at
    61 layers): MlaAttention holds them in the layouts the step reads instead."""
    from flax import nnx

    from checkpoints import make_tiny
    from lp_jax.config import ModelConfig
    from lp_jax.models import model_class
    from lp_jax.models.metadata import AttentionMetadata

    Lm, D, n, A, R, Hn = 2, 1024, 8, 512, 64, 128
    hf = {**make_tiny.build_config("tiny-deepseek"), "num_hidden_layers": Lm,
          "hidden_size": D, "num_attention_heads": n, "num_key_value_heads": n,
          "kv_lora_rank": A, "qk_rope_head_dim": R, "qk_nope_head_dim": Hn,
          "v_head_dim": Hn, "q_lora_rank": None, "first_k_dense_replace": Lm,
          "torch_dtype": "bfloat16"}
    cfg = ModelConfig.from_hf_dict(hf)
    model = nnx.eval_shape(lambda: model_class(cfg.model_type)(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    Tn, B, C, pages = 16, 8, 4, 64
    meta = AttentionMetadata(sd((Tn,), jnp.int32), sd((Tn,), jnp.int32),
                             sd((B + 1,), jnp.int32), sd((B,), jnp.int32),
                             sd((B, C), jnp.int32), sd((), jnp.int32))

    def layers(state, x_TD, kv, meta, decode_only):
        m = nnx.merge(graphdef, state)
        return jax.lax.fori_loop(0, Lm, lambda i, c: m._attention(
            i, *c, meta, decode_only, "xla"), (x_TD, kv))

    args = (state, sd((Tn, D), jnp.bfloat16), sd((pages * Lm, S, 1, 640), jnp.bfloat16),
            meta, sd((), jnp.bool_))
    compiled = compile_targets.compile_tpu(layers, args, topology="v5p:2x2x1",
                                           mesh_shape=(1,), donate_argnums=(2,))
    hlo = compiled.as_text()
    one_layer = {D * (A + R), D * 640, A * n * 2 * Hn}  # kv_a (checkpoint's, padded), kv_b
    weighty = one_layer | {Lm * e for e in one_layer}
    # Both held row-major: a 576-wide one is laid out column-minor on TPU (the whole-stack
    # copy before the loop appears where the dot picks the row-major layout, as in the
    # engine's data-parallel step; this program's dot happens to read either).
    params = re.findall(r"%\S*(kv_a_proj_with_mqa|kv_b_proj)\S* = \w+\[([\d,]*)\]\{([\d,]*)"
                        r"[^}]*\} parameter\(", hlo)
    assert sorted(p[0] for p in params) == ["kv_a_proj_with_mqa", "kv_b_proj"], params
    for name, dims, layout in params:
        rank = dims.count(",") + 1
        assert layout == ",".join(map(str, range(rank - 1, -1, -1))), (name, dims, layout)
    copies = [(op, t) for t, op, _ in _instructions(hlo).values()
              if op in ("copy", "copy-start", "transpose") and _elements(t) in weighty]
    assert not copies, f"relayout copies of the latent projections: {copies}"
