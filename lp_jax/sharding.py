"""Device mesh and the one table that maps logical axis names to mesh axes.

Parameters declare *logical* axes where they are created (`embed`, `q_heads`,
`experts`, ...). `LOGICAL_RULES` maps each to a mesh axis (MaxText's idea), so
changing the parallelism layout is a one-line edit here, not a model change.

The mesh has three axes, (data, expert, tensor). Attention heads, the vocabulary and
the dense MLPs split over "tensor"; the experts over all three axes together, so one
mesh of t chips on "tensor" holds tensor-parallel attention and t-way expert
parallelism over the same chips (vLLM's TP with expert parallelism), (1, e, 1) keeps
attention whole on every chip and splits only the experts, and (d, 1, t) is
data-parallel attention: d ranks of t-way attention, the experts over all d t chips
(EP = DP x TP, docs/data_parallel.md). A rule naming several
axes keeps those of size above 1 (`mesh_axes`), so the usual meshes see one axis name.

A dimension whose size is not divisible by its mesh axes is replicated instead, which
keeps every mesh shape runnable. The KV heads are the exception that matters: with
more tensor chips t than KV heads K (Qwen3-30B-A3B: K = 4 on 8 chips) the pool keeps
t / K copies of each head (`kv_head_replicas`), so each chip stores the one head its
query heads read rather than all K; the k/v projections' columns hold the same copies
(`kv_head_columns`), so each chip computes that whole head itself.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "layers": None,
    "vocab": "tensor",
    "embed": None,
    "q_heads": "tensor",  # N*H columns of q_proj, rows of o_proj
    "kv_heads": "tensor",  # K*H columns of k_proj / v_proj
    "head_dim": None,
    "mlp": "tensor",  # dense MLP width
    "experts": ("data", "expert", "tensor"),  # expert parallelism over every chip
    "expert_mlp": None,  # fused [gate | up] must stay whole per shard; see docs
    "kv_pages": "data",  # a rank-major pool's rows (kv_cache.kv_cache_axes)
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


def mesh_axes(logical: str | None, mesh) -> str | tuple[str, ...] | None:
    """The mesh axes LOGICAL_RULES maps `logical` to, keeping those of size above 1 (a
    mesh without an axis, e.g. a one-axis ("expert",) mesh, has it of size 1): one axis
    name, a tuple of several, or None (nothing to split over)."""
    rule = LOGICAL_RULES.get(logical) if logical is not None else None
    names = () if rule is None else (rule,) if isinstance(rule, str) else rule
    names = tuple(a for a in names if dict(mesh.shape).get(a, 1) > 1)  # absent: size 1
    return None if not names else names[0] if len(names) == 1 else names


def axes_size(axes: str | tuple[str, ...] | None, mesh) -> int:
    """Devices along `axes` (a `mesh_axes` result): the product of their sizes."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in names], dtype=np.int64))


def axis_dividing(logical: str, size: int, mesh) -> str | tuple[str, ...] | None:
    """`mesh_axes(logical)` if they split `size` into whole SHARD_UNITS groups, else the
    first of them alone that does (E = 12 experts on (1, 2, 4): "expert"); None when
    none does (the dimension is replicated)."""
    axes = mesh_axes(logical, mesh)
    unit = SHARD_UNITS.get(logical, 1)
    several = () if axes is None or isinstance(axes, str) else axes
    for candidate in (axes, *several):
        if candidate is not None and size % (axes_size(candidate, mesh) * unit) == 0:
            return candidate
    return None


def kv_head_replicas(num_kv_heads: int, num_q_heads: int, mesh) -> int:
    """Copies of each KV head the pool keeps: t / K when the heads' t devices outnumber
    the K KV heads and both K and the query heads divide evenly (each device then stores
    exactly the one KV head its N / t query heads read); 1 otherwise."""
    t = axes_size(mesh_axes("kv_combined_heads", mesh), mesh)
    K, N = num_kv_heads, num_q_heads
    return t // K if t > K and t % K == 0 and N % t == 0 else 1


def kv_head_columns(K: int, H: int, r: int, block: int = 1) -> np.ndarray | None:
    """Which column of K heads of H each column of the same K r heads reads (copy j of
    head k at k r + j, as the pool holds them); with `block` > 1, which column block
    (of `block` columns, the last one partial) each block reads: a block-quantized
    weight's scales. None when a block of the copies would read from two blocks (the
    blocks do not align with the heads). r = 1 gives the identity."""
    new_C = np.arange(K * r * H)
    source_C = new_C // (H * r) * H + new_C % H
    source_block_C = source_C // block
    first = source_block_C[::block]
    if not np.array_equal(source_block_C, np.repeat(first, block)[: len(new_C)]):
        return None
    return first


def parallel_mesh_shape(*, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                        enable_expert_parallel: bool = False, mesh_shape=None,
                        has_experts: bool | None = True) -> dict[str, int]:
    """vLLM's parallel sizes as a mesh shape {data, expert, tensor} (`parse_mesh_shape`'s
    form); an explicit `mesh_shape` when the sizes are left at their defaults.

    tensor_parallel_size t with enable_expert_parallel is (1, 1, t): attention heads,
    vocabulary and dense MLPs split t ways and, by LOGICAL_RULES, the experts over the
    same t chips. lp_jax splits experts only whole (expert parallelism), so an MoE model
    with t > 1 needs enable_expert_parallel: vLLM's other reading, each expert's width
    split t ways, is not built. data_parallel_size d > 1 with enable_expert_parallel is
    data-parallel attention, (d, 1, t): d attention ranks of t chips, the experts over
    all d t. Without expert parallelism (vLLM's independent replicas) or on a model
    without experts, d > 1 is refused. `has_experts` None: the model is not known yet
    (EngineConfig's own check), so only the model-free conflicts are refused. Raises
    ValueError naming the conflict."""
    for name, v in (("tensor_parallel_size", tensor_parallel_size),
                    ("data_parallel_size", data_parallel_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(enable_expert_parallel, bool):
        raise ValueError(f"enable_expert_parallel must be a bool, got {enable_expert_parallel!r}")
    sized = tensor_parallel_size > 1 or data_parallel_size > 1 or enable_expert_parallel
    if mesh_shape is not None:
        if sized:
            raise ValueError(
                f"mesh_shape={mesh_shape!r} names the layout itself; it cannot be combined "
                "with tensor_parallel_size / data_parallel_size / enable_expert_parallel")
        return parse_mesh_shape(mesh_shape)
    if data_parallel_size > 1 and (not enable_expert_parallel or has_experts is False):
        why = ("data-parallel attention needs experts to spread over the ranks; this "
               "model has none" if enable_expert_parallel else
               "data_parallel_size without enable_expert_parallel means independent "
               "replicas, which one engine does not serve")
        raise ValueError(f"data_parallel_size={data_parallel_size}: {why}; run one engine "
                         "per replica, or add --enable-expert-parallel (docs/data_parallel.md)")
    if tensor_parallel_size > 1 and has_experts and not enable_expert_parallel:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} on an MoE model needs "
            "enable_expert_parallel: lp_jax splits the experts whole over the same chips "
            "(expert parallelism), not each expert's width")
    return {"data": data_parallel_size, "expert": 1, "tensor": tensor_parallel_size}


def partition_spec(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Logical axes -> PartitionSpec, replicating dims their mesh axes do not divide
    (into whole SHARD_UNITS groups) or that a mesh axis already split."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match shape {shape}")
    spec, used = [], set()
    for name, size in zip(logical_axes, shape, strict=True):
        axes = axis_dividing(name, size, mesh) if name is not None else None
        names = set() if axes is None else {axes} if isinstance(axes, str) else set(axes)
        if axes is None or names & used:
            spec.append(None)
        else:
            spec.append(axes)
            used |= names
    return PartitionSpec(*spec)


def named_sharding(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical_axes, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

