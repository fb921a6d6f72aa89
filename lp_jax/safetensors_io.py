"""A minimal, lazy safetensors reader over numpy memmaps.

Why not the `safetensors` package's numpy API: it cannot return bfloat16, the
dtype of every real Qwen3 checkpoint. The format is simple (8-byte header length,
a JSON header of {name: {dtype, shape, data_offsets}}, then raw little-endian
data), so we read it ourselves, map the file, and hand out zero-copy views;
only the slices a device shard needs are ever copied. Every structural problem
raises CheckpointError naming the file and tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    # Hugging Face fine-grained FP8 checkpoints (quantization_config quant_method "fp8")
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}
# Dtypes the format names but lp_jax does not read, each with the reason.
UNSUPPORTED_DTYPES = {
    "F8_E5M2": "e5m2 FP8 weights are not supported (only e4m3, HF fine-grained FP8)",
    "F8_E8M0": "e8m0 tensors are not supported (MXFP4 scales ship as U8)",
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or of the wrong shape."""


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: file not found")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{self.path}: corrupt safetensors header (file too short)")
            header_len = int.from_bytes(raw_len, "little")
            if header_len <= 0 or header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{self.path}: corrupt safetensors header (header length {header_len}, "
                    f"file size {size})"
                )
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self._data_start = 8 + header_len
        data_size = size - self._data_start
        self.tensors: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype_name = info.get("dtype") if isinstance(info, dict) else None
            if isinstance(dtype_name, str) and dtype_name not in DTYPES:
                why = UNSUPPORTED_DTYPES.get(dtype_name, "not a dtype lp_jax reads; "
                                             f"supported: {', '.join(DTYPES)}")
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has dtype {dtype_name}: {why}")
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(
                    f"{self.path}: corrupt safetensors header entry for tensor {name!r} ({e!r})"
                ) from None
            size_ok = end - begin == math.prod(shape) * dtype.itemsize
            if not size_ok or not 0 <= begin <= end <= data_size:
                raise CheckpointError(
                    f"{self.path}: corrupt safetensors header: tensor {name!r} offsets "
                    f"[{begin}, {end}) do not match shape {shape} {info['dtype']} "
                    f"or the data size {data_size}"
                )
            self.tensors[name] = (dtype, shape, begin)
        self._mmap = None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of one tensor."""
        dtype, shape, begin = self.tensors[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        count = math.prod(shape)
        start = self._data_start + begin
        flat = self._mmap[start : start + count * dtype.itemsize].view(dtype)
        return flat.reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict | None = None):
    """Writes a safetensors file (used by tests to build broken checkpoints)."""
    inverse = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[name] = {"dtype": inverse[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
