"""The link a disaggregated deployment moves a prompt's KV cache over, and its cost.

Design note. A prefill instance hands each finished prompt's KV cache to a decode instance
(disagg.py). The cost is `latency + bytes / (chips x one-way bandwidth per chip)`: each of
the `chips` sending chips (the smaller of the two instances' tensor-parallel degrees) moves
its share of the KV heads at the same time. Bandwidths are counted one way: the hardware
table's `interconnect_bw` (lp_jax/roofline/hardware.py) is the vendor's bidirectional
per-chip aggregate, so NVLink and ICI get half of it. Their latency is the table's
`link_latency_s` (ASSUMED there, one collective step).

DCN (a deployment whose prefill and decode instances sit on different hosts) is not in the
hardware table; its figure is documented here: one 400 Gb/s NIC per GPU, one way 50 GB/s
per chip (NVIDIA DGX H100 / H200: eight ConnectX-7 400 Gb/s InfiniBand / Ethernet adapters
for the compute fabric, each mapped to one GPU; NVIDIA DGX H100 User Guide, section 1.2.3
"Network Modules", table 6, https://docs.nvidia.com/dgx/dgxh100-user-guide/). Its 10 us
latency (RDMA verbs message plus a switch hop, plus the transfer engine's setup) is ASSUMED.
That 400 Gb/s is the line rate; protocol overhead is not modelled, so DCN times are a lower
bound. The same per-chip figure is used for TPU hosts (ASSUMED: Google does not print a
per-chip DCN bandwidth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lp_jax.roofline.hardware import Hardware

DCN_BW_PER_CHIP = 400e9 / 8  # B/s one way: one 400 Gb/s NIC per GPU (DGX H100 / H200)
DCN_LATENCY_S = 10e-6  # ASSUMED
DCN_SOURCE = ("NVIDIA DGX H100 User Guide 1.2.3: 8x ConnectX-7 400 Gb/s, one per GPU, compute "
              "fabric; 400 Gb/s line rate one way = 50 GB/s per chip; latency 10 us ASSUMED")
LINKS = ("nvlink", "ici", "dcn")


@dataclass(frozen=True, slots=True)
class KVLink:
    """A KV-transfer link: one-way bytes/s per chip, a fixed latency, and their source."""

    name: str
    bw_per_chip: float  # one way, B/s
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bw_per_chip) and self.bw_per_chip > 0):
            raise ValueError(f"KVLink.bw_per_chip must be > 0 B/s, got {self.bw_per_chip}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"KVLink.latency_s must be >= 0, got {self.latency_s}")
        if not self.name or not self.source:
            raise ValueError("a KVLink needs a name and a source")

    def seconds(self, nbytes: float, chips: int = 1) -> float:
        """Time to move `nbytes` with `chips` chips sending their shares in parallel."""
        if nbytes < 0 or chips < 1:
            raise ValueError(f"need nbytes >= 0 and chips >= 1, got {nbytes}, {chips}")
        return self.latency_s + nbytes / (chips * self.bw_per_chip)


def kv_link(kind: str, hardware: Hardware) -> KVLink:
    """ "nvlink" (GPU entries), "ici" (TPU entries): half the table's bidirectional
    interconnect bandwidth; "dcn": the documented per-chip NIC figure."""
    if kind == "dcn":
        return KVLink("dcn", DCN_BW_PER_CHIP, DCN_LATENCY_S, DCN_SOURCE)
    if kind not in LINKS:
        raise ValueError(f"unknown link {kind!r}; expected one of {LINKS}")
    is_tpu = hardware.link_topology != "switch"
    if (kind == "ici") != is_tpu:
        raise ValueError(f"{hardware.name} has no {kind} ({hardware.link_topology} topology)")
    if not hardware.interconnect_bw > 0:
        raise ValueError(f"{hardware.name} has no interconnect bandwidth in the table")
    return KVLink(kind, hardware.interconnect_bw / 2, hardware.link_latency_s,
                  f"half of {hardware.name}'s bidirectional interconnect_bw "
                  f"({hardware.sources.interconnect_bw}); latency: "
                  f"{hardware.sources.link_latency_s}")
