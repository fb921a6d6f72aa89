"""Disaggregated serving in the simulator (lp_jax/sim/disagg.py, kv_link.py): the KV
transfer is charged to TTFT, decode instances only decode, chip counts match."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lp_jax.core.slo import SLO
from lp_jax.roofline import get_hardware, resolve_model
from lp_jax.sim import Request, SimConfig, Simulator, synthesize
from lp_jax.sim.disagg import DisaggConfig, replicated, run_disaggregated
from lp_jax.sim.kv_link import DCN_BW_PER_CHIP, KVLink, kv_link
from lp_jax.sim.simulator import kv_bytes_per_token

H100 = get_hardware("h100")
QWEN = resolve_model("qwen3-30b-a3b")


def _cfg(link: KVLink | None = None, **prefill) -> DisaggConfig:
    p = SimConfig(shape=QWEN, hardware=H100, **{"policy": "chunked",
                                                "max_num_batched_tokens": 2048, **prefill})
    return DisaggConfig(prefill=p, decode=SimConfig(shape=QWEN, hardware=H100),
                        link=link or kv_link("nvlink", H100))


def test_links_count_one_way():
    assert kv_link("nvlink", H100).bw_per_chip == H100.interconnect_bw / 2
    v5e = get_hardware("v5e")
    assert kv_link("ici", v5e).bw_per_chip == v5e.interconnect_bw / 2
    assert kv_link("dcn", H100).bw_per_chip == DCN_BW_PER_CHIP == 50e9
    with pytest.raises(ValueError, match="no ici"):
        kv_link("ici", H100)
    link = KVLink("x", 1e9, 1e-3, "test")
    assert link.seconds(4e9, chips=2) == pytest.approx(1e-3 + 2.0)


def test_transfer_time_is_charged_to_ttft():
    """One 8k prompt: TTFT = its prefill alone + the predicted transfer, and a slower link
    raises TTFT by exactly the predicted difference."""
    req = [Request(0.0, 8192, 4)]
    fast, slow = _cfg(), _cfg(KVLink("slow", 5e9, 2e-3, "test"))
    predicted = 8192 * kv_bytes_per_token(QWEN, tp=1)
    assert fast.kv_bytes(8192) == predicted
    assert slow.transfer_s(8192) == pytest.approx(2e-3 + predicted / 5e9)
    alone = Simulator(fast.prefill).run([replace(req[0], output_len=1)]).metrics[0].ttft
    t_fast = run_disaggregated(fast, req).result.metrics[0].ttft
    t_slow = run_disaggregated(slow, req).result.metrics[0].ttft
    assert t_fast == pytest.approx(alone + fast.transfer_s(8192), rel=1e-9)
    assert t_slow - t_fast == pytest.approx(slow.transfer_s(8192) - fast.transfer_s(8192),
                                            rel=1e-9)
    assert slow.transfer_s(8192) - fast.transfer_s(8192) > 0.1  # a visible difference


def test_link_is_fifo():
    """Two prompts finishing in one prefill step share the link: the second waits."""
    cfg = _cfg(KVLink("slow", 1e9, 0.0, "test"), policy="orca")
    out = run_disaggregated(cfg, [Request(0.0, 1000, 2), Request(0.0, 1000, 2)])
    assert out.prefill_done_s[0] == out.prefill_done_s[1]
    assert sorted(out.link_wait_s) == pytest.approx([0.0, out.transfer_s[0]])


def test_decode_instances_never_prefill_and_every_token_comes_out():
    cfg = _cfg()
    reqs = synthesize("sharegpt", 60, 3.0, seed=1)
    out = run_disaggregated(cfg, reqs, keep_plans=True)
    assert out.decode_plans and all(not p.prefill and p.decode for p in out.decode_plans)
    stats = out.result.scheduler_stats  # the prefill instances' schedulers
    assert stats["iterations_decode"] == stats["iterations_hybrid"] == 0
    assert stats["decode_tokens"] == 0
    assert [m.num_tokens for m in out.result.metrics] == [r.output_len for r in reqs]
    for i, m in enumerate(out.result.metrics):  # the first token waits for the transfer
        assert m.first_token_time == pytest.approx(
            out.prefill_done_s[i] + out.link_wait_s[i] + out.transfer_s[i], rel=1e-12)
    # decode tokens counted by the decode plans: output - 1 per request
    assert sum(len(p.decode) for p in out.decode_plans) == sum(r.output_len - 1 for r in reqs)


def test_chip_count_matches_the_colocated_run():
    colocated = SimConfig(shape=QWEN, hardware=H100, policy="layered", tp=2)
    two = _cfg()
    assert two.chips == colocated.tp * colocated.ep == 2
    four = DisaggConfig(prefill=replace(two.prefill, tp=2), decode=replace(two.decode, tp=2),
                        link=two.link)
    assert four.chips == 4 and four.transfer_chips == 2
    assert four.transfer_s(4096) < two.transfer_s(4096)  # two chips send in parallel
    reqs = synthesize("sharegpt", 20, 2.0, seed=0)
    assert replicated(colocated, 2, reqs).extra["chips"] == four.chips


def test_prefill_slo_leaves_room_for_the_transfer():
    slow = _cfg(KVLink("slow", 5e9, 0.0, "test"), policy="flowprefill")
    req = Request(0.0, 4096, 2, SLO(1.0, None, "chat"), "chat")
    out = run_disaggregated(slow, [req])
    assert out.result.ttft_attainment() == {"chat": float(out.result.metrics[0].ttft <= 1.0),
                                            "all": float(out.result.metrics[0].ttft <= 1.0)}
    from lp_jax.sim.disagg import _prefill_request

    seen = _prefill_request(req, slow)
    assert seen.output_len == 1
    assert seen.slo.ttft_s == pytest.approx(1.0 - slow.transfer_s(4096))
    assert _prefill_request(req, replace(slow, deduct_transfer=False)).slo.ttft_s == 1.0


def test_bench_deployments_use_the_same_chips():
    """launch/bench_disagg_sim.py: every deployment of a chip count uses that many chips,
    and a layout that does not is refused."""
    from launch.bench_disagg_sim import deployment, parse_args, select_workloads

    args = parse_args([])
    wl = next(w for w in select_workloads("gpt-sharegpt")[0])
    for chips, layout in ((2, "1x1:1x1"), (4, "1x2:1x2"), (4, "2x1:1x2")):
        assert deployment(wl, "layered", chips, layout, args)[2] == chips
        assert deployment(wl, "pd-chunked/nvlink", chips, layout, args)[2] == chips
    with pytest.raises(ValueError, match="3 chips, not 2"):
        deployment(wl, "pd-chunked/nvlink", 2, "1x1:1x2", args)
