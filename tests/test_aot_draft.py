"""`python -m lp_jax.aot --speculative-config '{"method": "mtp", ...}'`: the MTP layer built
abstractly into the programs (lp_jax/aot/draft.py), and the audit telling the layer's own
one-layer expert stack from a copy of one of the target's layers. Nothing is compiled here
(docs/benchmarks/dp_mtp.md has the compiled runs); the builds are abstract."""

import pytest

from lp_jax.aot import AotConfig, build, load_config
from lp_jax.aot.audit import audit_program
from pallas_kernels.compile_targets import libtpu_available

REDUCED = "checkpoints/configs/deepseek-v3-reduced.json"  # 4 layers, 16 experts, one MTP layer
MTP = {"method": "mtp", "num_speculative_tokens": 3}
DP4_TP2 = dict(platform="tpu", topology="v6e:2x4", mesh_shape=(4, 1, 2), max_num_seqs=16,
               max_model_len=2048, scheduling="chunked", max_num_batched_tokens=16,
               token_buckets=(4, 16))
needs_libtpu = pytest.mark.skipif(not libtpu_available(),
                                  reason="libtpu is not installed: pip install -e '.[tpu]'")


def test_only_mtp_drafts_are_compiled():
    with pytest.raises(ValueError, match="MTP drafts only"):
        AotConfig(platform="tpu", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AotConfig(platform="tpu", speculative_config={"method": "mtp",
                                                      "num_speculative_tokens": 0})


@needs_libtpu
def test_the_audit_tells_the_mtp_layers_own_experts_from_a_copy():
    """Under DP 4 x TP 2 the MTP layer's experts are a [1, E, D, 2F] stack (E / 8 a device)
    that the MoE kernels reshape (a bitcast) to [E, D, 2F]: one layer's shape. With the
    draft, that reshape and its view are no violation; a slice or a copy of one layer's
    shape in the optimized HLO still is. Without the draft the reshape is one (nothing
    else in a step has that shape). The draft's weights and pool join the HBM plan; a
    model without next-token layers is refused."""
    cfg = load_config(REDUCED)
    with_mtp = build(cfg, AotConfig(**DP4_TP2, speculative_config=MTP))
    plain = build(cfg, AotConfig(**DP4_TP2))
    assert with_mtp.spec.draft_k == 3 and plain.draft_bytes_per_device == 0
    kv = with_mtp.draft_args[1]["kv"]  # the draft's pool: split over the data ranks
    assert kv.sharding.shard_shape(kv.shape)[0] == kv.shape[0] // 4
    assert with_mtp.draft_bytes_per_device > 0
    w = with_mtp.draft_args[0].state["model"]["layers"]["mlp"]["experts_gate_up_proj"]
    whole = w.sharding.shard_shape(w.shape)  # (1, E / 8, D, 2F)
    one = "x".join(map(str, whole[1:]))
    stablehlo = (f"%0 = stablehlo.reshape %arg90 : (tensor<{'x'.join(map(str, whole))}xbf16>)"
                 f" -> tensor<{one}xbf16>")
    dims = ",".join(map(str, whole[1:]))
    view = f"  %bitcast.1 = bf16[{dims}]{{2,1,0}} bitcast(%get-tuple-element.3)"
    copies = [f"  %copy.2 = bf16[{dims}]{{2,1,0}} copy(%get-tuple-element.4)",
              f"  %dynamic-slice.3 = bf16[1,{dims}]{{3,2,1,0}} dynamic-slice(%p, %i, %c)"]

    def expert_violations(b, hlo_lines):
        rec = {"rows": 4, "stablehlo": stablehlo,
               "optimized_hlo": "ENTRY %main {\n" + "\n".join(hlo_lines) + "\n}"}
        return [v for v in audit_program(rec, b)["violations"] if "experts" in v]

    assert expert_violations(with_mtp, [view]) == []
    assert len(expert_violations(with_mtp, [view, *copies])) == 2
    assert expert_violations(plain, [])  # the reshape alone
    with pytest.raises(ValueError, match="no next-token"):
        build(load_config("qwen3-30b-a3b"), AotConfig(
            platform="tpu", topology="v6e:2x4", mesh_shape=(1, 8, 1), speculative_config=MTP))
