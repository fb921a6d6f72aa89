"""Communication of one expert-parallel MoE layer: all-reduce vs all-to-all dispatch.

Design note. Attention is tensor-parallel and replicated over the mesh's "expert" axis of
`ep` devices, so every device holds the same T tokens [T, D] before and after the MoE.
Two schemes get the expert outputs back to every device:

- "allreduce": every device routes all T tokens, computes the (token, slot) rows of its
  own E/ep experts, and a psum of y_TD in float32 over the expert axis sums the partial
  outputs. Ring all-reduce: each device sends 2 (ep-1)/ep x T x D x 4 bytes.
- "all_to_all": T is padded to T_pad = ep * t; device i routes its t tokens, sends each
  of its t*A rows (D values at the activation width plus a 4-byte expert id) to the
  device owning that expert, the owner computes and returns D activation-width values
  per row, the source combines per token in float32 and all-gathers its [t, D] output
  (activation width) so every device holds all T outputs again.
  Transport "ragged" (GPU/TPU, `jax.lax.ragged_all_to_all`) moves exactly the routed
  rows; transport "capacity" (CPU, `lax.all_to_all`) moves a fixed C rows to each of
  the ep destinations per round, C = max(1, ceil(capacity_factor * t * A / ep)).

Bytes are counted per device per MoE layer, as bytes a device sends (egress); a
collective's bytes received are the same by symmetry. Assumptions, for every formula:
- routing is uniform: a row's expert, hence its owner, is uniform over the ep devices,
  so (ep-1)/ep of a device's t*A rows leave it (the ragged figures are expectations;
  the slowest device of a real, skewed batch sends more);
- the capacity transport's bytes are for one round: ep*C rows per device, (ep-1)*C
  of them cross a link (the own-device slot does not); with capacity_factor >= 1 one
  round holds a uniform batch in expectation, and a skewed one takes more rounds;
- all-reduce and all-gather are ring collectives (no NVLS / in-switch reduction);
- the all-gather moves the t*D outputs at the activation width (its (ep-1)*t*D*a).

Time model. Each collective costs bytes / bandwidth plus steps x step latency, where the
bandwidth is one direction of the chip's link (`interconnect_bw` / 2, the table's figure
being bidirectional) and the step latency is `Hardware.link_latency_s`. Steps: a ring
all-reduce 2(ep-1), a ring all-gather ep-1, an all-to-all ep-1 (one message per peer);
"ragged" first exchanges its row counts (one more all-to-all, tiny), so all_to_all costs
4(ep-1) steps ("capacity": 3(ep-1) per round) against the all-reduce's 2(ep-1).
On a torus (TPU ICI) an all-to-all's rows travel several hops: the dispatch and return
bytes are multiplied by the mean hop count between the ep chips of a torus sub-slice,
while ring collectives move between neighbours only.

With bandwidth alone both schemes are linear in T, so their ratio does not depend on T
(except through padding T to a multiple of ep): all_to_all wins at every large T or at
none. For Qwen3-MoE (A = 8, a = 2 bytes) its per-token bytes beat the all-reduce's once
ep > 2A/3 (ep >= 8) for "ragged", ep > 4A/3 (ep >= 16) for "capacity" with factor 2.
A crossover in tokens exists only because all_to_all takes more collective steps: below
it the all-reduce's fewer steps win, above it all_to_all's fewer bytes do. Its value is
therefore only as good as the step latency, which is an assumption (see hardware.py).

The all-reduce's width. The source sums the partial outputs in float32, and so does
XLA for GPU and CPU; TPU's compiler moves the cast to bf16 ahead of the all-reduce and
reduces in bf16 (read from the compiled HLO: launch/bench_ep_comm.py). `reduce_bytes`
(and `Link.reduce_bytes`, 2 for TPU links) says which: with bf16 the all-reduce's bytes
halve, and on TPU all_to_all no longer wins for Qwen3-MoE at any ep in the table.

`choose_dispatch` picks by bytes (the scheme `auto` uses, as specified); given a `Link`
it picks by the time model instead.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from lp_jax.models.dispatch_bytes import (  # the byte model: the engine's "auto" uses it
    DEFAULT_CAPACITY_FACTOR,
    EXPERT_ID_BYTES,
    F32_BYTES,
    SCHEMES,
    TRANSPORTS,
    AllToAllBytes,
    _check,
    all_to_all_bytes,
    allreduce_bytes,
    capacity_rows,
    comm_bytes,
    fewer_bytes,
    tokens_per_device,
)
from lp_jax.roofline.hardware import Hardware

TOPOLOGIES = ("switch", "torus2d", "torus3d")
_MAX_SCAN_BLOCKS = 10_000_000  # crossover search bound, far above any real crossover


# ---- time model ----------------------------------------------------------------------
def torus_dims(ep: int, ndim: int) -> tuple[int, ...]:
    """The most even ndim-dimensional sub-slice holding ep chips (ASSUMED placement)."""
    dims = [1] * ndim
    remaining = ep
    for p in _prime_factors_descending(ep):
        dims[dims.index(min(dims))] *= p
        remaining //= p
    return tuple(sorted(dims, reverse=True))


def _prime_factors_descending(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return sorted(factors, reverse=True)


@functools.cache
def mean_hops(ep: int, topology: str) -> float:
    """Mean shortest-path hops from a device to the other ep-1 devices of the expert axis.

    switch: 1 (NVSwitch: every peer one hop). torus2d / torus3d: the ep chips form the
    most even sub-slice (`torus_dims`) with wraparound links, dimension-ordered routing.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if ep == 1:
        return 0.0
    if topology == "switch":
        return 1.0
    dims = torus_dims(ep, 2 if topology == "torus2d" else 3)
    total = sum(
        sum(min(c, n - c) for c, n in zip(coords, dims, strict=True))
        for coords in itertools.product(*(range(n) for n in dims))
    )
    return total / (ep - 1)


@dataclass(frozen=True, slots=True)
class Link:
    """One device's link to the rest of the expert axis, as the time model sees it."""

    name: str
    bandwidth: float  # B/s, one direction (a device's egress)
    step_latency_s: float  # fixed cost of one collective step
    topology: str  # "switch" or "torus2d" / "torus3d"
    # The all-reduce's element width: float32 as the source sums; TPU's compiler casts to
    # the activation dtype first (compiled HLO, launch/bench_ep_comm.py).
    reduce_bytes: int = F32_BYTES

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.step_latency_s >= 0):
            raise ValueError("Link needs bandwidth > 0 and step_latency_s >= 0")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")

    @classmethod
    def from_hardware(cls, hw: Hardware) -> Link:
        if hw.interconnect_bw <= 0:
            raise ValueError(f"{hw.name} has no interconnect bandwidth in the table")
        reduce_bytes = 2 if hw.name.startswith("TPU") else F32_BYTES
        return cls(hw.name, hw.interconnect_bw / 2, hw.link_latency_s, hw.link_topology,
                   reduce_bytes)


def collective_steps(scheme: str, ep: int, *, transport: str = "ragged") -> int:
    """Latency-bearing steps of one MoE layer's collectives (module docstring)."""
    if scheme == "allreduce":
        return 2 * (ep - 1)
    if scheme == "all_to_all":
        all_to_alls = 3 if transport == "ragged" else 2  # ragged: + the row-count exchange
        return (all_to_alls + 1) * (ep - 1)  # + the all-gather
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def comm_seconds(
    scheme: str,
    tokens: int,
    hidden: int,
    top_k: int,
    ep: int,
    link: Link,
    *,
    act_bytes: int = 2,
    transport: str = "ragged",
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> float:
    """Modelled seconds of one MoE layer's communication on `link` (module docstring)."""
    latency = collective_steps(scheme, ep, transport=transport) * link.step_latency_s
    if scheme == "allreduce":
        return (allreduce_bytes(tokens, hidden, ep, reduce_bytes=link.reduce_bytes)
                / link.bandwidth + latency)
    b = all_to_all_bytes(
        tokens,
        hidden,
        top_k,
        ep,
        act_bytes=act_bytes,
        transport=transport,
        capacity_factor=capacity_factor,
    )
    hops = mean_hops(ep, link.topology)
    return ((b.dispatch + b.combine) * hops + b.all_gather) / link.bandwidth + latency


def choose_dispatch(
    tokens: int,
    hidden: int,
    top_k: int,
    ep: int,
    *,
    act_bytes: int = 2,
    transport: str = "ragged",
    link: Link | None = None,
    reduce_bytes: int = F32_BYTES,
) -> str:
    """Returns "allreduce" or "all_to_all": the scheme with fewer bytes per device per layer, or
    with `link`, the faster one under the time model. Ties and ep == 1 -> "allreduce".
    `reduce_bytes`: the all-reduce's element width (see allreduce_bytes)."""
    if link is None:
        return fewer_bytes(tokens, hidden, top_k, ep, act_bytes=act_bytes, transport=transport,
                           reduce_bytes=reduce_bytes)
    _check(tokens, hidden, top_k, ep, act_bytes, transport)
    if ep == 1:
        return "allreduce"
    cost = lambda scheme: comm_seconds(  # noqa: E731
        scheme, tokens, hidden, top_k, ep, link, act_bytes=act_bytes, transport=transport
    )
    return "all_to_all" if cost("all_to_all") < cost("allreduce") else "allreduce"


def crossover_tokens(
    hidden: int,
    top_k: int,
    ep: int,
    link: Link,
    *,
    act_bytes: int = 2,
    transport: str = "ragged",
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
) -> int | None:
    """Smallest T from which all_to_all is faster at every T' >= T under the time model;
    None when it never is for good (the all-reduce wins, or ties, at every large T).

    all_to_all's time is constant over each block of T with the same t = ceil(T/ep)
    (padding), and the all-reduce's grows linearly with T, so the search bounds the last
    block where the all-reduce can still win and walks down from it.
    """
    _check(1, hidden, top_k, ep, act_bytes, transport)
    if ep == 1:
        return None

    def a2a(tokens: int) -> float:
        return comm_seconds(
            "all_to_all",
            tokens,
            hidden,
            top_k,
            ep,
            link,
            act_bytes=act_bytes,
            transport=transport,
            capacity_factor=capacity_factor,
        )

    def ar(tokens: int) -> float:
        return comm_seconds("allreduce", tokens, hidden, top_k, ep, link)

    # a2a(T) <= per_t * t + intercept over the block t = ceil(T / ep): exact for ragged;
    # capacity's C = max(1, ceil(f t A / ep)) is at most f t A / ep + 1 rows per peer.
    row, hops, bw = hidden * act_bytes, mean_hops(ep, link.topology), link.bandwidth
    if transport == "ragged":
        rows_per_t, spare_rows = top_k * (ep - 1) / ep, 0
    else:
        rows_per_t, spare_rows = (ep - 1) * capacity_factor * top_k / ep, ep - 1
    per_t = (rows_per_t * (2 * row + EXPERT_ID_BYTES) * hops + (ep - 1) * row) / bw
    intercept = (
        collective_steps("all_to_all", ep, transport=transport) * link.step_latency_s
        + spare_rows * (2 * row + EXPERT_ID_BYTES) * hops / bw
    )
    ar_per_token = ar(1) - ar(0)
    if per_t >= ar_per_token * ep:
        # a2a >= per_t t + its latency >= the all-reduce's time at every T <= t ep,
        # since all_to_all never has fewer steps.
        return None
    # The all-reduce wins somewhere in block t only if it does at T = (t-1) ep + 1.
    t_bound = (intercept - ar(0) + ar_per_token * (ep - 1)) / (ar_per_token * ep - per_t)
    t_last = max(0, math.floor(t_bound) + 1)
    if t_last > _MAX_SCAN_BLOCKS:
        raise ValueError(f"crossover beyond {_MAX_SCAN_BLOCKS * ep:,} tokens")
    for t in range(t_last, 0, -1):
        first = (t - 1) * ep + 1
        if a2a(first) < ar(first):
            continue  # a2a constant over the block, the all-reduce rising: a2a wins it all
        return 1 + next(n for n in range(t * ep, first - 1, -1) if a2a(n) >= ar(n))
    return 1


__all__ = ["AllToAllBytes", "DEFAULT_CAPACITY_FACTOR", "EXPERT_ID_BYTES", "F32_BYTES", "Link",
           "SCHEMES", "TOPOLOGIES", "TRANSPORTS", "all_to_all_bytes", "allreduce_bytes",
           "capacity_rows", "choose_dispatch", "collective_steps", "comm_bytes",
           "comm_seconds", "crossover_tokens", "mean_hops", "tokens_per_device",
           "torus_dims"]
