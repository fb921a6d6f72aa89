"""Which kernel each op of a model runs: the one option object the models, the executor
and the ahead-of-time compiler pass down to the layers (hashable, so a static argument
of the step programs)."""

from __future__ import annotations

import dataclasses

from lp_jax.models.expert_dispatch import DISPATCHES


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """Which kernel implementation each op uses ("auto", "xla", "tpu", "gpu"), and how a
    MoE layer with its experts split over the "expert" mesh axis exchanges tokens:
    `moe_dispatch` "allreduce", "all_to_all" or "auto" (see models/expert_dispatch.py)."""

    moe: str = "auto"
    attention: str = "auto"
    moe_dispatch: str = "auto"

    def __post_init__(self):
        if self.moe_dispatch not in DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {DISPATCHES}, "
                             f"got {self.moe_dispatch!r}")
