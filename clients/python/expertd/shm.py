"""Shared memory for callers on the daemon's host (daemon run with
-shared-memory): POSIX objects in /dev/shm, and GPU memory of torch tensors
through CUDA IPC.

    shm = expertd.SharedMemory.create(64 << 20)      # /dev/shm/expertd-<pid>-<random>
    region = client.register_shared_memory("acts", shm)
    shm.unlink()                                      # nothing left behind if either side dies
    hidden = region.put(0, h)                         # numpy or CPU torch
    res = client.fused_moe(hidden, expert_set="layer0", router_logits=region.put(1 << 20, logits),
                           top_k=2, output_shm=region.ref(2 << 20, M * K * 2))
    res.output                                        # a view of the region, no copy

Regions belong to the client's connection: the daemon forgets them when it
closes, so keep the client open while using them.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

from expertd import tensors
from expertd.v1 import expert_pb2 as pb


class SharedMemory:
    """A POSIX shared-memory object this process created and maps
    read-write (as shm_open with O_CREAT|O_EXCL and mode 0600, then
    ftruncate), for the daemon to map too."""

    def __init__(self, key: str, size: int, buf: mmap.mmap):
        self.key, self.size, self._buf = key, size, buf
        self._unlinked = False

    @classmethod
    def create(cls, size: int, key: str = "") -> "SharedMemory":
        """Creates /dev/shm/<key> of size bytes; an empty key picks a fresh
        random one. Only this user may open it, so the daemon must run as
        the same user."""
        if not key:
            key = f"expertd-{os.getpid()}-{secrets.token_hex(8)}"
        key = key.lstrip("/")
        if not key or "/" in key or "\0" in key or ".." in key:
            raise ValueError(f"key {key!r}: want one file name under /dev/shm")
        if size < 1:
            raise ValueError(f"size {size}: want >= 1")
        fd = os.open("/dev/shm/" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink("/dev/shm/" + key)
            raise
        finally:
            os.close(fd)
        return cls(key, size, buf)

    @property
    def buf(self) -> memoryview:
        """The mapping's bytes."""
        if self._buf is None:
            raise ValueError(f"shared memory {self.key} is closed")
        return memoryview(self._buf)

    def unlink(self) -> None:
        """Removes the name, as shm_unlink does; mappings (this one, the
        daemon's) stay valid. Call it once the regions are registered."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink("/dev/shm/" + self.key)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlinks (if not yet) and unmaps. Views into the mapping must be
        dropped first; the daemon keeps its own mapping until its regions
        are unregistered or the connection closes."""
        self.unlink()
        if self._buf is not None:
            buf, self._buf = self._buf, None
            buf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Region:
    """A slice of a SharedMemory registered on a client's connection."""

    kind = "posix"

    def __init__(self, name: str, shm: SharedMemory, offset: int, size: int, info=None):
        self.name, self.shm, self.offset, self.size, self.info = name, shm, offset, size, info

    def _span(self, offset: int, n: int) -> memoryview:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"region {self.name}: {n} bytes at offset {offset} do not fit in its {self.size} bytes")
        return self.shm.buf[self.offset + offset:self.offset + offset + n]

    def ref(self, offset: int, size: int) -> pb.SharedMemoryRef:
        """A reference to size bytes at offset, e.g. for output_shm."""
        self._span(offset, size)
        return pb.SharedMemoryRef(region_name=self.name, offset=offset, byte_size=size)

    def tensor(self, dtype: str, shape, offset: int) -> pb.Tensor:
        """A Tensor message referencing bytes already at offset."""
        n = tensors.nbytes(dtype, shape)
        return pb.Tensor(dtype=tensors.dtype_enum(dtype), shape=[int(d) for d in shape],
                         shm=self.ref(offset, n))

    def array(self, dtype: str, shape, offset: int) -> np.ndarray:
        """A writable numpy view of the carrier bytes at offset (uint8 for
        FP8, uint16 for bfloat16), to fill inputs in place."""
        n = tensors.nbytes(dtype, shape)
        return np.frombuffer(self._span(offset, n), dtype=tensors._CARRIER[dtype]).reshape(shape)

    def put(self, offset: int, x, dtype: str | None = None) -> pb.Tensor:
        """Copies x (numpy array or CPU torch tensor) to offset and returns
        the Tensor message referencing it there."""
        a, name = tensors.as_carrier(x, dtype)
        dst = self._span(offset, a.nbytes)
        dst[:] = memoryview(a.reshape(-1)).cast("B")
        return self.tensor(name, a.shape, offset)

    def read(self, offset: int, dtype: int, shape, like: str = "numpy", widen: bool = True):
        """The tensor at offset, viewed in place (bfloat16 widened to a new
        float32 array when widen and like is numpy)."""
        return tensors.from_buffer(self._span(offset, tensors.nbytes(dtype, shape)), dtype, shape,
                                   like=like, widen=widen)


def cuda_ipc_handle(t) -> tuple[bytes, int, int]:
    """The cudaIpcMemHandle_t of the allocation holding torch CUDA tensor
    t's storage, with the storage's byte offset in that allocation and its
    byte size (what RegisterSharedMemory takes)."""
    if not tensors.is_torch(t) or t.device.type != "cuda":
        raise ValueError("want a torch tensor on a CUDA device")
    _, handle, size, offset, *_ = t.untyped_storage()._share_cuda_()
    # torch prefixes the 64-byte cudaIpcMemHandle_t with a version byte and
    # a type: b"c" is a cudaMalloc block, b"e" an expandable segment, which
    # has no cudaIpcMemHandle_t.
    if len(handle) >= 66 and handle[1:2] == b"e":
        raise ValueError("tensor is in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
                         "which CUDA IPC cannot share; allocate it with expandable segments off")
    return bytes(handle[-64:]), int(offset), int(size)


class CudaRegion:
    """A torch CUDA tensor's storage registered through CUDA IPC: tensors
    viewing that storage can be sent as references and outputs written into
    it, so neither travels through a host."""

    kind = "cuda_ipc"

    def __init__(self, name: str, base, info=None):
        self.name, self.base, self.info = name, base, info
        self._storage = base.untyped_storage()
        self.size = self._storage.nbytes()

    def _offset_of(self, t) -> int:
        if not tensors.is_torch(t) or t.device != self.base.device:
            raise ValueError(f"region {self.name}: want a tensor on {self.base.device}")
        if t.untyped_storage().data_ptr() != self._storage.data_ptr():
            raise ValueError(f"region {self.name}: tensor is not a view of the registered storage")
        if not t.is_contiguous():
            raise ValueError(f"region {self.name}: tensor must be contiguous")
        return t.storage_offset() * t.element_size()

    def tensor(self, t) -> pb.Tensor:
        """The reference to t, a contiguous view of the registered storage.
        Synchronize the stream that wrote it before the call."""
        name = tensors._torch_dtype_name(t)
        return pb.Tensor(dtype=tensors.DTYPES[name], shape=list(t.shape), shm=pb.SharedMemoryRef(
            region_name=self.name, offset=self._offset_of(t), byte_size=t.numel() * t.element_size()))

    def ref(self, t) -> pb.SharedMemoryRef:
        """The output_shm reference to t, a contiguous view of the storage
        the output is written into."""
        return self.tensor(t).shm

    def read(self, offset: int, dtype: int, shape, like: str = "torch", widen: bool = True):
        """The output at offset: a torch view of the registered storage."""
        import torch

        name = tensors.NAMES[dtype]
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "int32": torch.int32}[name]
        item = tensors.ITEMSIZE[name]
        if offset % item:
            raise ValueError(f"region {self.name}: offset {offset} is not a multiple of {name}'s size")
        out = torch.empty(0, dtype=tdt, device=self.base.device)
        return out.set_(self._storage, offset // item, tuple(int(d) for d in shape))
