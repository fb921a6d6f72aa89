"""Device mesh and the one table that maps logical axis names to mesh axes.

Parameters declare *logical* axes where they are created (`embed`, `q_heads`,
`experts`, ...). `LOGICAL_RULES` maps each to a mesh axis (MaxText's idea), so
changing the parallelism layout is a one-line edit here, not a model change.

The mesh has three axes, (data, expert, tensor). A dimension whose size is not
divisible by its mesh axis is replicated instead (e.g. 4 KV heads on 8-way tensor
parallelism), which keeps every mesh shape runnable.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "tensor")

LOGICAL_RULES: dict[str, str | None] = {
    "batch": "data",
    "layers": None,
    "vocab": "tensor",
    "embed": None,
    "q_heads": "tensor",  # N*H columns of q_proj, rows of o_proj
    "kv_heads": "tensor",  # K*H columns of k_proj / v_proj
    "head_dim": None,
    "mlp": "tensor",  # dense MLP width
    "experts": "expert",
    "expert_mlp": None,  # fused [gate | up] must stay whole per shard; see docs
    "kv_pages": None,
    "kv_combined_heads": "tensor",  # J = 2K axis of the KV cache
}

# Logical axes whose shards must hold whole groups of this many entries: the KV pool's
# J axis interleaves K and V of each head, and a shard needs both.
SHARD_UNITS: dict[str, int] = {"kv_combined_heads": 2}


def make_mesh(data: int = 1, expert: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, expert, tensor) mesh over the first data*expert*tensor devices."""
    devices = jax.devices() if devices is None else devices
    n = data * expert * tensor
    if n > len(devices):
        raise ValueError(
            f"mesh data={data} x expert={expert} x tensor={tensor} needs {n} devices, "
            f"only {len(devices)} available"
        )
    return Mesh(np.asarray(devices[:n]).reshape(data, expert, tensor), MESH_AXES)


def parse_mesh_shape(shape) -> dict[str, int]:
    """Accepts None, a dict, or an (expert, tensor) / (data, expert, tensor) tuple."""
    if shape is None:
        return {"data": 1, "expert": 1, "tensor": 1}
    if isinstance(shape, dict):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
        return {a: int(shape.get(a, 1)) for a in MESH_AXES}
    shape = tuple(int(s) for s in shape)
    if len(shape) == 2:
        return {"data": 1, "expert": shape[0], "tensor": shape[1]}
    if len(shape) == 3:
        return dict(zip(MESH_AXES, shape, strict=True))
    raise ValueError(f"mesh shape must be (expert, tensor) or (data, expert, tensor), got {shape}")


def partition_spec(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Logical axes -> PartitionSpec, replicating dims the mesh axis does not divide
    (into whole SHARD_UNITS groups)."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match shape {shape}")
    spec, used = [], set()
    for name, size in zip(logical_axes, shape, strict=True):
        axis = LOGICAL_RULES.get(name) if name is not None else None
        unit = SHARD_UNITS.get(name, 1)
        if axis is None or axis in used or size % (mesh.shape[axis] * unit) != 0:
            spec.append(None)
        else:
            spec.append(axis)
            used.add(axis)
    return PartitionSpec(*spec)


def named_sharding(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

