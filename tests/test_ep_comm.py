"""Tests for lp_jax.roofline.ep_comm: hand-computed bytes, the dispatch choice, the
crossover against a brute-force scan of the time model, and the CLI section."""

import dataclasses

import pytest

from lp_jax.roofline import ep_comm
from lp_jax.roofline.__main__ import main
from lp_jax.roofline.ep_comm import (
    Link,
    all_to_all_bytes,
    allreduce_bytes,
    choose_dispatch,
    comm_bytes,
    comm_seconds,
    crossover_tokens,
    mean_hops,
)
from lp_jax.roofline.hardware import HARDWARE, get_hardware

D30, K = 2048, 8  # Qwen3-30B-A3B hidden size and top-k


# ---- bytes -----------------------------------------------------------------------------
def test_allreduce_bytes_hand_computed():
    # ring all-reduce of [64, 2048] f32 over 8 devices: 2 * 7/8 * 64 * 2048 * 4
    assert allreduce_bytes(64, D30, 8) == 917_504
    assert allreduce_bytes(64, D30, 1) == 0


def test_all_to_all_ragged_bytes_hand_computed():
    # T=64, ep=8: t=8 tokens, 64 rows, 7/8 of them remote = 56 rows
    b = all_to_all_bytes(64, D30, K, 8)
    assert b.dispatch == 56 * (2048 * 2 + 4) == 229_600
    assert b.combine == 56 * 2048 * 2 == 229_376
    assert b.all_gather == 7 * 8 * 2048 * 2 == 229_376
    assert b.total == comm_bytes("all_to_all", 64, D30, K, 8) == 688_352


def test_all_to_all_capacity_bytes_hand_computed():
    # C = ceil(2 * 8 * 8 / 8) = 16 rows per destination; (ep-1) * C = 112 cross a link
    b = all_to_all_bytes(64, D30, K, 8, transport="capacity")
    assert ep_comm.capacity_rows(64, K, 8, 2.0) == 16
    assert b.dispatch == 112 * 4100 and b.combine == 112 * 4096
    assert b.all_gather == 7 * 8 * 4096
    # one token per device on 64 devices: C = max(1, ceil(2 * 1 * 8 / 64)) = 1
    assert ep_comm.capacity_rows(64, K, 64, 2.0) == 1
    assert all_to_all_bytes(64, D30, K, 64, transport="capacity").dispatch == 63 * 4100


def test_padding_to_a_multiple_of_ep():
    # T=9 on 8 devices pads to 16: t=2, the same bytes as T=16
    assert ep_comm.tokens_per_device(9, 8) == 2
    assert all_to_all_bytes(9, D30, K, 8) == all_to_all_bytes(16, D30, K, 8)
    assert all_to_all_bytes(0, D30, K, 8).total == 0


def test_act_bytes_scale_the_rows_not_the_ids():
    b4 = all_to_all_bytes(64, D30, K, 8, act_bytes=4)
    assert b4.dispatch == 56 * (2048 * 4 + 4) and b4.all_gather == 7 * 8 * 2048 * 4


def test_invalid_arguments():
    with pytest.raises(ValueError):
        all_to_all_bytes(64, D30, K, 8, transport="nccl")
    with pytest.raises(ValueError):
        comm_bytes("psum", 64, D30, K, 8)
    with pytest.raises(ValueError):
        choose_dispatch(64, D30, K, 0)


# ---- choose_dispatch ---------------------------------------------------------------------
def test_choose_ep1_is_allreduce():
    assert all(choose_dispatch(t, D30, K, 1) == "allreduce" for t in (0, 1, 64, 8192))


def test_choose_small_ep_allreduce_large_ep_all_to_all():
    for t in (1, 64, 1024, 8192):
        assert choose_dispatch(t, D30, K, 2) == "allreduce"
        assert choose_dispatch(t, D30, K, 4) == "allreduce"
    for ep in (8, 16, 32, 64):
        assert choose_dispatch(8192, D30, K, ep) == "all_to_all"
    # one token padded to ep rows: the all-reduce's T=1 wins
    assert choose_dispatch(1, D30, K, 8) == "allreduce"
    # capacity pads to 2x the expected rows: it wins only from ep=16 (4A/3 < ep)
    assert choose_dispatch(8192, D30, K, 8, transport="capacity") == "allreduce"
    assert choose_dispatch(8192, D30, K, 16, transport="capacity") == "all_to_all"


def test_choose_tie_is_allreduce():
    # D=2, A=4, ep=4, 2-byte rows: all-reduce 2*3/4*4*2*4 = 48 B; all_to_all 3 rows * 8 B
    # dispatch + 3 * 4 B return + 3 * 4 B gather = 48 B
    assert allreduce_bytes(4, 2, 4) == comm_bytes("all_to_all", 4, 2, 4, 4) == 48
    assert choose_dispatch(4, 2, 4, 4) == "allreduce"
    assert choose_dispatch(8, 2, 4, 4) == "allreduce"


def test_choose_with_zero_latency_switch_matches_bytes():
    link = Link("bandwidth only", 1e9, 0.0, "switch")
    for ep in (2, 8, 16):
        for t in range(1, 200):
            assert choose_dispatch(t, D30, K, ep, link=link) == choose_dispatch(t, D30, K, ep)


# ---- time model and crossover ------------------------------------------------------------
def test_mean_hops():
    assert mean_hops(1, "torus2d") == 0 and mean_hops(64, "switch") == 1
    assert mean_hops(4, "torus2d") == pytest.approx(4 / 3)  # 2x2: 1, 1, 2 hops
    assert mean_hops(16, "torus2d") == pytest.approx(32 / 15)  # 4x4 with wraparound
    assert ep_comm.torus_dims(64, 2) == (8, 8) and ep_comm.torus_dims(32, 3) == (4, 4, 2)


def test_comm_seconds_hand_computed():
    link = Link("test", 100e9, 2e-6, "switch")
    expected = 917_504 / 100e9 + 2 * 7 * 2e-6
    assert comm_seconds("allreduce", 64, D30, K, 8, link) == pytest.approx(expected)
    expected = 688_352 / 100e9 + 4 * 7 * 2e-6  # ragged: count exchange, 2 x a2a, gather
    assert comm_seconds("all_to_all", 64, D30, K, 8, link) == pytest.approx(expected)


def _brute_force(hidden, top_k, ep, link, transport, scan_to):
    """Smallest T after the last T in [1, scan_to] where all_to_all is not faster."""
    last = 0
    for t in range(1, scan_to + 1):
        a2a = comm_seconds("all_to_all", t, hidden, top_k, ep, link, transport=transport)
        if a2a >= comm_seconds("allreduce", t, hidden, top_k, ep, link):
            last = t
    return last + 1, last == scan_to


CASES = [
    (D30, K, 8, Link.from_hardware(get_hardware("H100 SXM")), "ragged"),
    # TPU links with a float32 all-reduce (from_hardware gives TPU the bf16 one its
    # compiler runs, against which all_to_all never wins at these sizes; see below).
    (D30, K, 16, dataclasses.replace(Link.from_hardware(get_hardware("TPU v5e")),
                                     reduce_bytes=4), "ragged"),
    (4096, K, 64, dataclasses.replace(Link.from_hardware(get_hardware("TPU v6e")),
                                      reduce_bytes=4), "capacity"),
    (64, 4, 8, Link("small", 1e9, 1e-7, "switch"), "ragged"),
    (64, 2, 6, Link("odd ep", 1e9, 1e-7, "torus2d"), "capacity"),
    (D30, K, 8, Link("no latency", 1e9, 0.0, "switch"), "ragged"),
]


@pytest.mark.parametrize("hidden, top_k, ep, link, transport", CASES)
def test_crossover_matches_brute_force(hidden, top_k, ep, link, transport):
    found = crossover_tokens(hidden, top_k, ep, link, transport=transport)
    assert found is not None
    scan_to = 2 * found + 10 * ep
    expected, never = _brute_force(hidden, top_k, ep, link, transport, scan_to)
    assert not never and found == expected


@pytest.mark.parametrize("ep", [8, 16, 64])
def test_tpu_bf16_allreduce_beats_all_to_all_at_every_size(ep):
    link = Link.from_hardware(get_hardware("TPU v6e"))
    assert link.reduce_bytes == 2
    assert crossover_tokens(D30, K, ep, link) is None
    _, never = _brute_force(D30, K, ep, link, "ragged", 5000)
    assert never


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_no_crossover_when_allreduce_always_wins(ep):
    link = Link.from_hardware(get_hardware("H100 SXM"))
    assert crossover_tokens(D30, K, ep, link) is None
    if ep > 1:
        _, never = _brute_force(D30, K, ep, link, "ragged", 5000)
        assert never  # the all-reduce is at least as fast at every scanned T


def test_zero_latency_crossover_is_the_padding_bound():
    # with bandwidth alone the only T-dependence is padding: all_to_all (0.75x the bytes)
    # loses only where T_pad / T > 4/3, i.e. below 3 (ep - 1) = 21 tokens
    link = Link("no latency", 1e9, 0.0, "switch")
    assert crossover_tokens(D30, K, 8, link) <= 21


def test_hardware_links():
    for hw in HARDWARE.values():
        assert hw.link_latency_s > 0 and hw.sources.link_latency_s.startswith("ASSUMED")
    assert get_hardware("h100").link_topology == "switch"
    assert get_hardware("v5e").link_topology == get_hardware("v6e").link_topology == "torus2d"
    link = Link.from_hardware(get_hardware("h200"))
    assert link.bandwidth == 450e9 and link.step_latency_s == pytest.approx(1.9e-6)


# ---- CLI ------------------------------------------------------------------------------------
def test_cli_ep_comm_section(capsys):
    assert main(["--ep-comm"]) == 0
    out = capsys.readouterr().out
    for name in ("Qwen3-30B-A3B", "Qwen3-235B-A22B", "H100 SXM", "H200 SXM", "TPU v5e"):
        assert name in out
    assert "TPU v6e" in out and "none: AR" in out and "A2A >" in out
    assert "D=4096" in out and "MoE layers 94" in out


def test_the_allreduce_width_decides_at_ep_8():
    """float32 partial sums (the source) vs bf16 (what TPU's compiler reduces in): at
    EP 8 and top-8 the ragged all_to_all beats the former and loses to the latter."""
    args = (4096, 2048, 8, 8)
    assert ep_comm.choose_dispatch(*args) == "all_to_all"
    assert ep_comm.choose_dispatch(*args, reduce_bytes=2) == "allreduce"
    assert ep_comm.allreduce_bytes(4096, 2048, 8, reduce_bytes=2) * 2 == \
        ep_comm.allreduce_bytes(4096, 2048, 8)
