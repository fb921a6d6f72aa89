"""Compile for accelerators this host does not have: TPU and NVIDIA GPU, for real.

TPU. libtpu (`pip install -e '.[tpu]'`) brings the TPU compiler to a CPU host. A
named slice ("v6e:2x2", "v5e:4x4", ...) gives compile-only TPU devices; jit(f).lower()
over ShapeDtypeStructs sharded on a mesh of them, then .compile(), runs XLA:TPU and
Mosaic, the compile a TPU host would run. The Compiled answers `memory_analysis()`
and `as_text()`. Pallas TPU reads the chip generation from the abstract mesh in
context, so `compile_tpu` lowers under `jax.set_mesh` of that mesh, whose abstract
device is the TPU's ("TPU v6 lite", ...). A slice needs at least 2x2 chips ("1x1"
is refused); `compile_tpu` can use a sub-mesh of it (`mesh_shape=(1,)`).

CUDA. The CUDA PJRT plugin and ptxas (`pip install -e '.[gpu-compile]'`: the
jax-cuda13 plugin and pjrt wheels and nvidia-cuda-nvcc, no GPU and no CUDA libraries
needed) do the same for one NVIDIA GPU described by an XLA `GpuTargetConfig`
(`lp_jax/aot/gpu_targets/{h200,h100}.txtpb`): `cuda_topology_devices("h200")` is one
compile-only "NVIDIA H200 141GB HBM3e" device (sm_90a) (`count=8`: one host's eight, for
the AOT's meshes), and `compile_cuda` lowers
under `jax.set_mesh` of it (Pallas Triton and Mosaic GPU read the GPU kind from there)
and compiles: XLA:GPU, XLA's Triton, the Mosaic GPU passes and ptxas all run here.
Autotuning needs a device, so it is off. `cuda_compiler_missing()` says what is absent;
`export_cuda` (`jax.export(platforms=["cuda"])` under an abstract H200: Mosaic lowering
only, no ptxas) needs no plugin. `mosaic_gpu_modules` captures the lowered Mosaic GPU
modules of a lowering as text, for inspection; `lp_jax.aot.resources` reads each
compiled kernel's registers, spills, shared memory and launch shape from the dumps.

Audits on the text of what was lowered, small enough to read:
* `custom_call_operand_shapes` / `sliced_shapes` (StableHLO): a Pallas kernel should
  take a stacked weight whole, never a slice of it.
* `wgmma_refill_check` (a lowered Mosaic GPU module): a pipelined loop whose WGMMAs
  read shared memory must wait for them before TMA overwrites that memory.

Importing this module is cheap; libtpu loads at the first `tpu_topology_devices`, the
CUDA plugin at the first `cuda_topology_devices`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import pathlib
import re
import shutil
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Compile-only devices own no chip, so several processes may load libtpu at once (its
# lockfile would otherwise fail a second compiling process: tests beside a CLI run).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
LIBTPU_HINT = "install libtpu for TPU compiles on this host: pip install -e '.[tpu]'"
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
CUDA_HINT = ("install the CUDA compiler (no GPU needed): pip install -e '.[gpu-compile]' "
             "(jax-cuda13-plugin, jax-cuda13-pjrt 0.11.2 and nvidia-cuda-nvcc 13.0)")
GPU_TARGETS = ("h200", "h100")  # lp_jax/aot/gpu_targets/{gpu}.txtpb
# lp_jax/aot/gpu_targets: beside this package in a source checkout, its parent in a wheel
# (which installs pallas_kernels as lp_jax.pallas_kernels; lp_jax/paths.py).
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TARGETS_DIR = next((d for d in (_ROOT / "lp_jax/aot/gpu_targets", _ROOT / "aot/gpu_targets")
                     if d.is_dir()), _ROOT / "lp_jax/aot/gpu_targets")
TPU_DEVICE_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}  # as libtpu names them


def libtpu_available() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.get_tpu_library_path() is not None


@functools.cache
def tpu_topology_devices(topology: str) -> tuple:
    """Compile-only TPU devices of a slice, e.g. "v6e:2x2", "v5e:2x2", "v5e:4x4"."""
    if not libtpu_available():
        raise RuntimeError(f"no libtpu, so no TPU compiler: {LIBTPU_HINT}")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu's errors are JaxRuntimeError / RuntimeError
        raise ValueError(f"TPU topology {topology!r}: {e}") from e
    return tuple(desc.devices)


def tpu_mesh(topology: str, mesh_shape: Sequence[int] | None = None,
             axis_names: Sequence[str] = ("x",)) -> Mesh:
    """A mesh over the first prod(mesh_shape) devices of the slice (default: all, 1-D)."""
    devices = tpu_topology_devices(topology)
    mesh_shape = tuple(mesh_shape or (len(devices),))
    n = int(np.prod(mesh_shape))
    if n > len(devices):
        raise ValueError(f"mesh {mesh_shape} needs {n} devices; {topology} has {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(mesh_shape), tuple(axis_names))


@contextlib.contextmanager
def pallas_target(device_kind: str, *, platform: str, num_cores: int = 1,
                  axis_names: Sequence[str] = ("x",), axis_sizes: Sequence[int] = (1,)):
    """An abstract mesh whose device is the target accelerator, for lowering Pallas
    calls on a host without it (e.g. "TPU v6 lite"/"tpu", "NVIDIA H200"/"gpu")."""
    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform)
    mesh = AbstractMesh(tuple(axis_sizes), tuple(axis_names),
                        axis_types=(AxisType.Auto,) * len(axis_names), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield mesh


def tpu_target(chip: str):
    """pallas_target for a TPU chip ("v5e", "v6e"; a topology such as "v6e:2x2" works
    too): lowers Pallas TPU calls for it without libtpu (e.g. for jax.export)."""
    return pallas_target(TPU_DEVICE_KINDS[chip.split(":")[0]], platform="tpu")


def _shard_args(args, mesh: Mesh, in_specs):
    """ShapeDtypeStructs of args placed on mesh; in_specs: one PartitionSpec per leaf
    (a pytree like args), or None: replicated."""
    leaves, tree = jax.tree.flatten(args)
    specs = [P()] * len(leaves) if in_specs is None else jax.tree.leaves(
        in_specs, is_leaf=lambda s: isinstance(s, P))
    if len(specs) != len(leaves):
        raise ValueError(f"{len(specs)} in_specs for {len(leaves)} arguments")
    return tree.unflatten([
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
        for a, s in zip(leaves, specs, strict=True)])


def compile_tpu(fn, args, *, topology: str, mesh_shape: Sequence[int] | None = None,
                axis_names: Sequence[str] = ("x",), in_specs=None, donate_argnums=()):
    """jax.jit(fn).lower(args).compile() by the real TPU compiler for `topology`.

    args: a tuple (fn's positional arguments) of pytrees of arrays or ShapeDtypeStructs
    (only shapes and dtypes are read), placed on tpu_mesh(topology, mesh_shape,
    axis_names) with in_specs (default replicated). Returns the jax Compiled
    (memory_analysis(), as_text(), ...).
    """
    mesh = tpu_mesh(topology, mesh_shape, axis_names)
    sharded = _shard_args(args, mesh, in_specs)
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*sharded)
        return lowered.compile()


# ------------------------------------------------------------------------- CUDA
def gpu_target_config(gpu: str) -> str:
    """The GpuTargetConfig text of a GPU we ship one for ("h200", "h100")."""
    if gpu not in GPU_TARGETS:
        raise ValueError(f"no GPU target config for {gpu!r}; known: {sorted(GPU_TARGETS)}")
    return (_TARGETS_DIR / f"{gpu}.txtpb").read_text()


def gpu_target_field(gpu: str, field: str) -> str:
    """One scalar field of a target config's gpu_device_info (e.g. "device_memory_size")."""
    m = re.search(rf"^\s*{field}: (.+)$", gpu_target_config(gpu), re.M)
    if m is None:
        raise ValueError(f"{gpu}.txtpb has no {field}")
    return m.group(1).strip().strip('"')


def ptxas_path() -> str | None:
    """The ptxas the GPU compiles use: $CUDA_ROOT/bin, the nvidia-cuda-nvcc wheel's, or
    one on PATH; None if there is none."""
    roots = [os.environ.get("CUDA_ROOT")]
    for name in ("nvidia.cu13", "nvidia.cuda_nvcc"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        roots += list(spec.submodule_search_locations or []) if spec else []
    for root in filter(None, roots):
        if os.access(os.path.join(root, "bin", "ptxas"), os.X_OK):
            return os.path.join(root, "bin", "ptxas")
    return shutil.which("ptxas")


def cuda_compiler_missing() -> str | None:
    """None if this host can compile for CUDA, else what is missing (and how to get it)."""
    missing = [pkg for pkg, module in (("jax-cuda13-pjrt", "jax_plugins.xla_cuda13"),
                                       ("jax-cuda13-plugin", "jax_cuda13_plugin"))
               if not _find(module)]
    if ptxas_path() is None:
        missing.append("ptxas (nvidia-cuda-nvcc)")
    if not missing:
        return None
    return f"no CUDA compiler here (missing {', '.join(missing)}): {CUDA_HINT}"


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fix_cuda_root() -> str:
    """Points Mosaic GPU at the CUDA directory holding ptxas, and returns it.

    jax picks its CUDA path when it is imported: $CUDA_ROOT, else the `nvidia.cu13`
    package's directory. With an nvidia wheel installed but not nvidia-cuda-nvcc, that
    namespace package has no bin/ptxas and jax records the string 'None', which Mosaic
    copies into MOSAIC_GPU_CUDA_ROOT; the first Mosaic kernel then fails to find ptxas.
    """
    ptxas = ptxas_path()
    if ptxas is None:
        raise RuntimeError(cuda_compiler_missing() or "no ptxas")
    root = os.path.dirname(os.path.dirname(ptxas))
    current = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "")
    if not os.access(os.path.join(current, "bin", "ptxas"), os.X_OK):
        os.environ["MOSAIC_GPU_CUDA_ROOT"] = root
    return root


@functools.cache
def cuda_topology_devices(gpu: str = "h200", count: int = 1) -> tuple:
    """`count` compile-only devices of `gpu` ("h200", "h100") on one host (an 8-GPU node
    at most), from its target config."""
    missing = cuda_compiler_missing()
    if missing:
        raise RuntimeError(missing)
    if not 1 <= count <= 8:
        raise ValueError(f"a cuda topology is one host of 1 to 8 GPUs, got {count}")
    fix_cuda_root()
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="cuda", topology_name="",
                                        target_config=gpu_target_config(gpu),
                                        topology=f"1x1x{count}")
    return tuple(desc.devices)


def cuda_mesh(gpu: str = "h200", axis_names: Sequence[str] = ("x",)) -> Mesh:
    """A one-device mesh of the compile-only `gpu`, with len(axis_names) axes of size 1."""
    devices = cuda_topology_devices(gpu)
    return Mesh(np.array(devices[:1]).reshape((1,) * len(axis_names)), tuple(axis_names))


def compile_cuda(fn, args, *, gpu: str = "h200", in_specs=None, donate_argnums=()):
    """jax.jit(fn).lower(args).compile() by XLA:GPU (with Triton, Mosaic GPU and ptxas)
    for one compile-only `gpu`. args as in `compile_tpu`. Returns the jax Compiled."""
    mesh = cuda_mesh(gpu)
    sharded = _shard_args(args, mesh, in_specs)
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*sharded)
        return lowered.compile()


def export_cuda(fn, args, *, device: AbstractDevice = H200, disabled_checks=()):
    """jax.export of fn for platforms=["cuda"] under an abstract one-device mesh of
    `device` (default an H200, 132 SMs). Mosaic GPU custom calls are allowed. Returns
    the Exported (`.mlir_module()` is the StableHLO text)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"), *disabled_checks]
    with pallas_target(device.device_kind, platform=device.platform,
                       num_cores=device.num_cores):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=checks)(*args)


@contextlib.contextmanager
def mosaic_gpu_modules():
    """Collects, as text, every Mosaic GPU module lowered inside the block (after
    Mosaic's own lowering: nvvm ops, inline PTX such as wgmma.wait_group).

    jax caches lowerings per function: export a function not lowered before in this
    process (e.g. a fresh lambda), or the block sees nothing.
    """
    from jax.experimental.mosaic.gpu import core as mgpu_core

    modules: list[str] = []
    rule = mgpu_core._mosaic_gpu_lowering_rule  # the hook every Pallas MGPU call takes

    def spy(ctx, *args, module, **kwargs):
        modules.append(str(module))
        return rule(ctx, *args, module=module, **kwargs)

    mgpu_core._mosaic_gpu_lowering_rule = spy
    try:
        yield modules
    finally:
        mgpu_core._mosaic_gpu_lowering_rule = rule


# ------------------------------------------------------------------------- audits
_TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-z]\w*>")


def _tensor_shapes(signature: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split("x") if d) for dims in _TENSOR.findall(signature)]


def custom_call_operand_shapes(stablehlo: str, target: str) -> list[list[tuple[int, ...]]]:
    """Operand shapes of every `stablehlo.custom_call @target` (e.g. "tpu_custom_call",
    "mosaic_gpu_v2"), one list per call."""
    calls = []
    for line in stablehlo.splitlines():
        if f"stablehlo.custom_call @{target}(" in line:
            operands = line.rsplit(": (", 1)[1].split(") ->", 1)[0]
            calls.append(_tensor_shapes(operands))
    return calls


def sliced_shapes(stablehlo: str) -> list[tuple[int, ...]]:
    """Result shapes of every slice, dynamic_slice and gather in StableHLO text."""
    ops = ("stablehlo.slice ", "stablehlo.dynamic_slice ", "stablehlo.gather")
    return [_tensor_shapes(line.rsplit("->", 1)[1])[0] for line in stablehlo.splitlines()
            if any(op in line for op in ops) and "->" in line]


def num_elements(shape) -> int:
    return math.prod(shape)


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_WGMMA_WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned (\d+);")


def _loop_bodies(module: str):
    """The lines of every scf.for body of an MLIR module (nested loops included)."""
    lines = module.splitlines()
    for i, line in enumerate(lines):
        if "scf.for " not in line:
            continue
        depth, j = 0, i
        for j in range(i, len(lines)):
            code = _QUOTED.sub('""', lines[j])  # inline PTX strings hold braces
            depth += code.count("{") - code.count("}")
            if depth <= 0:
                break
        yield lines[i + 1:j]


def wgmma_refill_check(module: str) -> tuple[int, int]:
    """(loops that issue WGMMAs, those of them that refill shared memory unsafely).

    A refill (a TMA load global -> shared) after a WGMMA in the same loop body is safe
    only behind a `wgmma.wait_group N` that leaves at most the groups committed since
    the body began in flight: then every WGMMA of the previous iteration, the reader
    of the slot being refilled, has finished.
    """
    loops = unsafe = 0
    for body in _loop_bodies(module):
        if not any("wgmma.mma_async" in line for line in body):
            continue
        loops += 1
        commits, mma_pending = 0, False
        for line in body:
            if "wgmma.mma_async" in line:
                mma_pending = True
            elif "wgmma.commit_group" in line:
                commits += 1
            elif (wait := _WGMMA_WAIT.search(line)) and int(wait.group(1)) <= commits:
                mma_pending = False
            elif "cp.async.bulk.tensor.shared" in line and mma_pending:
                unsafe += 1
                break
    return loops, unsafe
