"""Conversions between numpy arrays or torch tensors and expertd.v1.Tensor.

Tensors travel row-major and little-endian. numpy has no bfloat16 or FP8
dtype of its own, so those are carried as bit patterns: uint8 arrays are FP8
E4M3FN codes, and uint16 arrays are bfloat16 when dtype="bfloat16" is given.
Arrays of ml_dtypes' bfloat16 / float8_e4m3fn dtypes and torch tensors of
those dtypes are recognised by their dtype.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from expertd.v1 import expert_pb2 as pb

DTYPES = {
    "float32": pb.DATA_TYPE_FLOAT32,
    "bfloat16": pb.DATA_TYPE_BFLOAT16,
    "float16": pb.DATA_TYPE_FLOAT16,
    "float8_e4m3fn": pb.DATA_TYPE_FLOAT8_E4M3FN,
    "float8_e5m2": pb.DATA_TYPE_FLOAT8_E5M2,
    "int32": pb.DATA_TYPE_INT32,
}
NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4}
# The numpy dtype holding each wire dtype's bytes.
_CARRIER = {"float32": "<f4", "bfloat16": "<u2", "float16": "<f2", "float8_e4m3fn": "u1",
            "float8_e5m2": "u1", "int32": "<i4"}


def dtype_enum(dtype: str | int) -> int:
    """The DataType enum value of a dtype name (or the value itself)."""
    if isinstance(dtype, int):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: want one of {sorted(DTYPES)}") from None


def is_torch(x: Any) -> bool:
    """Whether x is a torch.Tensor, without importing torch."""
    return type(x).__module__.startswith("torch") and "torch" in sys.modules and isinstance(
        x, sys.modules["torch"].Tensor)


def _torch_dtype_name(t) -> str:
    torch = sys.modules["torch"]
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.int32: "int32", torch.uint8: "float8_e4m3fn"}
    for attr, name in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2")):
        if hasattr(torch, attr):
            names[getattr(torch, attr)] = name
    if t.dtype == torch.float64:
        return "float64"
    try:
        return names[t.dtype]
    except KeyError:
        raise ValueError(f"torch dtype {t.dtype} has no expertd DataType") from None


def torch_to_numpy(t, dtype: str | None = None) -> tuple[np.ndarray, str]:
    """The bytes of a CPU torch tensor as a contiguous numpy carrier array,
    with the wire dtype name. float64 is narrowed to float32."""
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise ValueError(f"tensor on {t.device}: send device tensors through a CUDA IPC region "
                         "(Client.register_cuda_tensor), or move it to the CPU")
    name = _torch_dtype_name(t)
    t = t.detach().contiguous()
    if name == "float64":
        t, name = t.to(torch.float32), "float32"
    if dtype is not None and dtype != name:
        raise ValueError(f"torch tensor of {t.dtype} cannot be sent as {dtype}")
    bits = {2: torch.int16, 1: torch.uint8, 4: None}[ITEMSIZE[name]]
    if bits is not None and t.dtype != bits:
        t = t.view(bits)
    return t.numpy().view(_CARRIER[name]), name


def as_carrier(x: Any, dtype: str | None = None) -> tuple[np.ndarray, str]:
    """x (numpy array, torch tensor or nested list) as a C-contiguous
    little-endian numpy array holding the wire bytes, and its dtype name."""
    if is_torch(x):
        return torch_to_numpy(x, dtype)
    a = np.asarray(x)
    name = a.dtype.name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):  # ml_dtypes
        if dtype is not None and dtype != name:
            raise ValueError(f"array of {name} cannot be sent as {dtype}")
        return np.ascontiguousarray(a).view(_CARRIER[name]), name
    if dtype is None:
        dtype = {"float32": "float32", "float64": "float32", "float16": "float16", "int32": "int32",
                 "int64": "int32", "uint8": "float8_e4m3fn"}.get(name)
        if dtype is None:
            hint = " (dtype='bfloat16' for bfloat16 bit patterns)" if name == "uint16" else ""
            raise ValueError(f"numpy dtype {a.dtype} has no default expertd dtype; pass dtype={hint}")
    if dtype not in _CARRIER:
        raise ValueError(f"dtype {dtype!r}: want one of {sorted(_CARRIER)}")
    carrier = np.dtype(_CARRIER[dtype])
    if ITEMSIZE[dtype] != a.dtype.itemsize or a.dtype.kind != carrier.kind:
        if dtype in ("float32", "float16", "int32") and a.dtype.kind in "fiu":
            a = a.astype(carrier)
        else:
            raise ValueError(f"numpy {a.dtype} array cannot carry {dtype} (want {carrier})")
    return np.ascontiguousarray(a, dtype=carrier), dtype


def encode(x: Any, dtype: str | None = None) -> pb.Tensor:
    """An expertd.v1.Tensor carrying x's bytes inline. A Tensor message is
    returned as is."""
    if isinstance(x, pb.Tensor):
        return x
    a, name = as_carrier(x, dtype)
    return pb.Tensor(dtype=DTYPES[name], shape=list(a.shape), data=a.tobytes())


def describe(x: Any, dtype: str | None = None) -> tuple[pb.Tensor, np.ndarray]:
    """A Tensor message with x's dtype and shape but no data, and x's bytes
    as a flat uint8 array (what LoadExperts chunks are cut from)."""
    a, name = as_carrier(x, dtype)
    return pb.Tensor(dtype=DTYPES[name], shape=list(a.shape)), a.reshape(-1).view(np.uint8)


def from_buffer(buf, dtype: int, shape, like: str = "numpy", widen: bool = True):
    """Views buf (bytes, memoryview, mmap slice) as a tensor of the wire
    dtype and shape without copying where possible.

    like="numpy" returns numpy; bfloat16 is widened to float32 when widen
    (numpy has no bfloat16), else the uint16 bit patterns. like="torch"
    returns a torch tensor of the matching torch dtype.
    """
    name = NAMES.get(dtype)
    if name is None:
        raise ValueError(f"unknown DataType {dtype}")
    shape = tuple(int(d) for d in shape)
    a = np.frombuffer(buf, dtype=_CARRIER[name])
    if a.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{a.nbytes} bytes do not hold {name}{list(shape)}")
    a = a.reshape(shape)
    if like == "torch":
        torch = _import_torch()
        target = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "int32": torch.int32, "float8_e4m3fn": getattr(torch, "float8_e4m3fn", torch.uint8),
                  "float8_e5m2": getattr(torch, "float8_e5m2", torch.uint8)}[name]
        if not a.flags.writeable:
            a = a.copy()
        t = torch.from_numpy(a.view({2: np.int16, 1: np.uint8, 4: a.dtype}[a.dtype.itemsize]))
        return t.view(target)
    if name == "bfloat16" and widen:
        return bf16_to_f32(a)
    return a


def decode(t: pb.Tensor, like: str = "numpy", widen: bool = True):
    """The tensor an inline Tensor message carries (see from_buffer)."""
    if t.WhichOneof("source") != "data":
        raise ValueError("tensor is a shared-memory reference; read it from its region")
    return from_buffer(t.data, t.dtype, t.shape, like=like, widen=widen)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) widened to float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 bit patterns (uint16), nearest-even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + 0x7FFF
    out = ((u + r) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = 0x7FC0
    return out


def nbytes(dtype: str | int, shape) -> int:
    """Byte size of a tensor of dtype and shape."""
    name = dtype if isinstance(dtype, str) else NAMES[dtype]
    return ITEMSIZE[name] * int(np.prod([int(d) for d in shape], dtype=np.int64))


def _import_torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this needs torch: pip install 'expertd[torch]'") from e
    return torch
