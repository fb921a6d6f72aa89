"""Prefill policies, by name, and `resolve_policy` for the ones users write.

    orca         whole prompts next to the decodes (orca.py)
    chunked      Sarathi-Serve chunked prefill within a shared token budget (chunked.py)
    layered      the paper's layered prefill (layered.py)
    flowprefill  preemptible prefill under slack-aware EDF (flowprefill.py)

The interface a policy implements is `Policy` (base.py); docs/custom_policy.md writes one.
"""

from __future__ import annotations

import importlib

from lp_jax.core.plan import PrefillChunk
from lp_jax.core.policies.base import Policy, PrefillPart
from lp_jax.core.policies.chunked import ChunkedPolicy
from lp_jax.core.policies.flowprefill import FlowPrefillPolicy
from lp_jax.core.policies.layered import LayeredPolicy
from lp_jax.core.policies.orca import OrcaPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (OrcaPolicy, ChunkedPolicy, LayeredPolicy, FlowPrefillPolicy)
}


def resolve_policy(spec: str | type[Policy]) -> type[Policy]:
    """A Policy class from a class, a registered name, or a dotted path:
    "package.module:Class" or "package.module.Class" (vLLM's --scheduler-cls form).
    Raises ValueError naming what is wrong."""
    if isinstance(spec, type):
        if not issubclass(spec, Policy):
            raise ValueError(f"{spec.__module__}.{spec.__qualname__} is not a subclass of "
                             "lp_jax.core.policies.Policy")
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"scheduling must be a policy name, a dotted path or a Policy "
                         f"class, got {spec!r}")
    if spec in POLICIES:
        return POLICIES[spec]
    if ":" not in spec and "." not in spec:
        raise ValueError(f"unknown scheduling policy {spec!r}: choose one of "
                         f"{sorted(POLICIES)}, or give package.module:Class")
    module, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"scheduling {spec!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"scheduling {spec!r}: module {module!r} has no {attr!r}") from None
    if not isinstance(cls, type):
        raise ValueError(f"scheduling {spec!r} is {type(cls).__name__}, not a Policy class")
    return resolve_policy(cls)


def policy_name(spec: str | type[Policy]) -> str:
    """How logs name a policy: its registry name, else its dotted path."""
    cls = resolve_policy(spec)
    return cls.name or f"{cls.__module__}:{cls.__qualname__}"


__all__ = ["POLICIES", "ChunkedPolicy", "FlowPrefillPolicy", "LayeredPolicy", "OrcaPolicy",
           "Policy", "PrefillChunk", "PrefillPart", "policy_name", "resolve_policy"]
