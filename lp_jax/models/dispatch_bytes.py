"""Bytes of one expert-parallel MoE layer's communication: all-reduce vs all-to-all.

The engine's moe_dispatch="auto" (expert_dispatch.py) picks the scheme that sends fewer
bytes per device (`fewer_bytes`); lp_jax/roofline/ep_comm.py adds the time model (link
bandwidth, step latency, torus hops) and states the design and its assumptions.

Bytes are counted per device per MoE layer, as bytes a device sends (egress), with routing
uniform over the ep devices (the ragged figures are expectations), ring all-reduce and
all-gather, and one round of the capacity transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEMES = ("allreduce", "all_to_all")
TRANSPORTS = ("ragged", "capacity")
F32_BYTES = 4  # the all-reduce sums y_TD in float32
EXPERT_ID_BYTES = 4  # int32 expert id sent with each dispatched row
DEFAULT_CAPACITY_FACTOR = 2.0


def _check(tokens: int, hidden: int, top_k: int, ep: int, act_bytes: int, transport: str):
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if hidden < 1 or top_k < 1 or ep < 1 or act_bytes < 1:
        raise ValueError("hidden, top_k, ep and act_bytes must be >= 1")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def tokens_per_device(tokens: int, ep: int) -> int:
    """t: each device's share of T once T is padded to a multiple of ep."""
    return -(-tokens // ep)


def capacity_rows(tokens: int, top_k: int, ep: int, capacity_factor: float) -> int:
    """C: rows per destination per round of the capacity transport."""
    t = tokens_per_device(tokens, ep)
    return max(1, math.ceil(capacity_factor * t * top_k / ep))


def allreduce_bytes(tokens: int, hidden: int, ep: int, *, reduce_bytes: int = F32_BYTES) -> float:
    """Bytes one device sends in a ring all-reduce of y_TD: 2(ep-1)/ep T D reduce_bytes.

    The source sums in float32 (reduce_bytes 4). TPU's compiler moves the cast to the
    activation dtype before the all-reduce and reduces in bf16 (2 bytes; read from the
    compiled HLO by launch/bench_ep_comm.py): pass reduce_bytes=2 for TPU."""
    _check(tokens, hidden, 1, ep, reduce_bytes, "ragged")
    return 2 * (ep - 1) / ep * tokens * hidden * reduce_bytes


@dataclass(frozen=True, slots=True)
class AllToAllBytes:
    """Bytes one device sends in each phase of the all_to_all scheme, one MoE layer."""

    dispatch: float  # routed rows to the experts' owners: D x act_bytes + expert id each
    combine: float  # expert outputs back to the rows' sources: D x act_bytes each
    all_gather: float  # the [t, D] combined outputs to the other ep-1 devices

    @property
    def total(self) -> float:
        return self.dispatch + self.combine + self.all_gather


def all_to_all_bytes(
    tokens: int,
    hidden: int,
    top_k: int,
    ep: int,
    *,
    act_bytes: int = 2,
    transport: str = "ragged",
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> AllToAllBytes:
    """Per-device bytes of the all_to_all scheme (module docstring for the assumptions).

    ragged:   rows sent = t A (ep-1)/ep (expected, uniform routing);
    capacity: rows sent = (ep-1) C (one round, padded slots included).
    """
    _check(tokens, hidden, top_k, ep, act_bytes, transport)
    t = tokens_per_device(tokens, ep)
    if transport == "ragged":
        rows_sent = t * top_k * (ep - 1) / ep
    else:
        rows_sent = (ep - 1) * capacity_rows(tokens, top_k, ep, capacity_factor)
    row_bytes = hidden * act_bytes
    return AllToAllBytes(
        dispatch=rows_sent * (row_bytes + EXPERT_ID_BYTES),
        combine=rows_sent * row_bytes,
        all_gather=(ep - 1) * t * row_bytes,
    )


def comm_bytes(
    scheme: str,
    tokens: int,
    hidden: int,
    top_k: int,
    ep: int,
    *,
    act_bytes: int = 2,
    transport: str = "ragged",
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
    reduce_bytes: int = F32_BYTES,
) -> float:
    """Bytes one device sends for one MoE layer under `scheme`."""
    if scheme == "allreduce":
        return allreduce_bytes(tokens, hidden, ep, reduce_bytes=reduce_bytes)
    if scheme == "all_to_all":
        return all_to_all_bytes(
            tokens,
            hidden,
            top_k,
            ep,
            act_bytes=act_bytes,
            transport=transport,
            capacity_factor=capacity_factor,
        ).total
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def fewer_bytes(tokens: int, hidden: int, top_k: int, ep: int, *, act_bytes: int = 2,
                transport: str = "ragged", reduce_bytes: int = F32_BYTES) -> str:
    """"allreduce" or "all_to_all", whichever sends fewer bytes per device per layer;
    ties and ep == 1 -> "allreduce"."""
    _check(tokens, hidden, top_k, ep, act_bytes, transport)
    if ep == 1:
        return "allreduce"
    cost = [comm_bytes(scheme, tokens, hidden, top_k, ep, act_bytes=act_bytes,
                       transport=transport, reduce_bytes=reduce_bytes)
            for scheme in ("all_to_all", "allreduce")]
    return "all_to_all" if cost[0] < cost[1] else "allreduce"
