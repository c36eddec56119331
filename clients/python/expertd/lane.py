"""GPU-ordered lanes (docs/gpu-ordered.md): a caller whose tensors live on
the daemon's GPU starts each MoE call from its own CUDA stream, and the
stream resumes when the output is written, with no host thread of either
process on the call's path, so the call can be captured in a CUDA graph.

    lane = expertd.lane.open_lane(client, call, device)   # call: a FusedMoERequest on CUDA IPC regions
    lane.enqueue(torch.cuda.current_stream().cuda_stream) # inputs written before, output read after, on that stream
    lane.close()

The lane fixes one call shape and its buffers (hidden states, router
logits, output in CUDA IPC regions registered on client's connection);
each enqueue is three stream memory operations through libcuda (ctypes):
done = 0, doorbell = 1, wait for done == 1. The fast case needs MPS on
both sides (lane.mps says whether the daemon's GPU contexts are shared
through it; mps_enabled(device) whether this process's are): without it
each call costs a context switch of the time-sliced GPU (about 0.3 ms).
"""

from __future__ import annotations

import ctypes
import threading

import grpc

from expertd.errors import from_rpc_error
from expertd.v1 import expert_pb2 as pb

# CUDA driver API constants (cuda.h).
_CU_STREAM_WAIT_VALUE_EQ = 0x1
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
_CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133


class _IpcHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array stops at the handle's first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def _ipc_handle(handle: bytes) -> _IpcHandle:
    """The driver's handle struct holding all of handle's 64 bytes."""
    if len(handle) != 64:
        raise ValueError(f"CUDA IPC handle of {len(handle)} bytes, want 64")
    return _IpcHandle.from_buffer_copy(handle)


class Driver:
    """The libcuda entry points a lane's caller uses. Loaded once per
    process (driver()); tests put a recording stand-in in its place."""

    def __init__(self, lib=None):
        cu = lib if lib is not None else ctypes.CDLL("libcuda.so.1")

        def fn(*names):
            for n in names:
                f = getattr(cu, n, None)
                if f is not None:
                    f.restype = ctypes.c_int
                    return f
            raise OSError(f"libcuda has none of {names}")
        self._write = fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self._wait = fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        for f in (self._write, self._wait):
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._open = fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        self._close = fn("cuIpcCloseMemHandle")
        self._close.argtypes = [ctypes.c_uint64]
        self._attr = fn("cuDeviceGetAttribute")
        self._attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self._get_ctx = fn("cuCtxGetCurrent")
        self._get_ctx.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._set_ctx = fn("cuCtxSetCurrent")
        self._set_ctx.argtypes = [ctypes.c_void_p]
        self._init = fn("cuInit")
        self._init.argtypes = [ctypes.c_uint]
        self._retain = fn("cuDevicePrimaryCtxRetain")
        self._retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._release = fn("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")
        self._release.argtypes = [ctypes.c_int]

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUresult {rc}")

    def write(self, stream: int, addr: int, value: int) -> None:
        self._check(self._write(stream, addr, value, _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def wait_eq(self, stream: int, addr: int, value: int) -> None:
        self._check(self._wait(stream, addr, value, _CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_uint64(0)
        self._check(self._open(ctypes.byref(ptr), _ipc_handle(handle), _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._check(self._close(ptr), "cuIpcCloseMemHandle")

    def _current(self) -> int:
        cur = ctypes.c_void_p()
        self._check(self._get_ctx(ctypes.byref(cur)), "cuCtxGetCurrent")
        return cur.value or 0

    def context(self, device: int | None) -> int:
        """The context a lane's driver calls run in: device's primary
        context (the one the CUDA runtime, and so torch, uses), retained
        until release_context; with device None, the calling thread's
        current one."""
        if device is None:
            cur = self._current()
            if not cur:
                raise RuntimeError("no CUDA context is current on this thread: pass the device index of the lane's "
                                   "regions (open_lane's device)")
            return cur
        ctx = ctypes.c_void_p()
        self._check(self._init(0), "cuInit")
        self._check(self._retain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        return ctx.value

    def release_context(self, device: int) -> None:
        self._check(self._release(device), "cuDevicePrimaryCtxRelease")

    def enter(self, ctx: int) -> int | None:
        """Makes ctx current on this thread for the driver calls that
        follow (a thread that has touched no CUDA has none, and one may
        hold another device's) and returns what leave restores: None when
        ctx already was current."""
        cur = self._current()
        if cur == ctx:
            return None
        self._check(self._set_ctx(ctx), "cuCtxSetCurrent")
        return cur

    def leave(self, prev: int | None) -> None:
        if prev is not None:
            self._check(self._set_ctx(prev or None), "cuCtxSetCurrent")

    def mps_enabled(self, device: int) -> bool:
        v = ctypes.c_int(0)
        if self._attr(ctypes.byref(v), _CU_DEVICE_ATTRIBUTE_MPS_ENABLED, device) != 0:
            return False  # a driver that predates the attribute
        return bool(v.value)


_driver: Driver | None = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's Driver; raises OSError where libcuda is missing."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver


def mps_enabled(device_index: int) -> bool:
    """Whether this process's contexts on the device are MPS clients."""
    return driver().mps_enabled(device_index)


class Lane:
    """An open lane: call enqueue(stream) for each call. The lane's
    buffers and regions must stay allocated and registered until close()
    returns; close ends the OpenLane call, after which the daemon releases
    the calls it had enqueued."""

    def __init__(self, rpc, resp: pb.OpenLaneResponse, drv: Driver, device: int | None):
        self._rpc, self._drv = rpc, drv
        self.depth, self.mps, self.skips_on_close = resp.depth, resp.mps, resp.skips_on_close
        # The flags are mapped into one context, the regions' device's;
        # every driver call of the lane runs in it, from any thread.
        self._ctx, self._device = drv.context(device), device
        prev = drv.enter(self._ctx)
        try:
            self._base = drv.ipc_open(resp.flags_cuda_ipc_handle)
        except BaseException:
            self._release()
            raise
        finally:
            drv.leave(prev)
        self.doorbell = self._base + resp.doorbell_offset
        self.done = self._base + resp.done_offset

    def enqueue(self, stream: int) -> None:
        """Enqueues one call on stream (a cudaStream_t as an int, e.g.
        torch.cuda.current_stream().cuda_stream): what the stream did
        before is the call's input, what it does after sees the output.
        Capturable in a CUDA graph."""
        prev = self._drv.enter(self._ctx)
        try:
            self._drv.write(stream, self.done, 0)
            self._drv.write(stream, self.doorbell, 1)
            self._drv.wait_eq(stream, self.done, 1)
        finally:
            self._drv.leave(prev)

    def close(self) -> None:
        """Ends the lane. Streams must not ring it afterwards; synchronize
        those that did first."""
        if self._rpc is None:
            return
        rpc, self._rpc = self._rpc, None
        prev = self._drv.enter(self._ctx)
        try:
            self._drv.ipc_close(self._base)
        finally:
            self._drv.leave(prev)
            self._release()
            rpc.cancel()

    def _release(self) -> None:
        if self._device is not None:
            self._drv.release_context(self._device)


def open_lane(client, call: pb.FusedMoERequest, device: int | None = None, *, depth: int = 0,
              drv: Driver | None = None) -> Lane:
    """Opens a lane on client's connection for call, whose hidden states,
    router logits and output reference CUDA IPC regions client registered
    on GPU device (an index; None: the device of the context current on
    this thread);
    depth is how many calls the daemon keeps enqueued (0: its default).
    Raises the typed ExpertdError the daemon answers with."""
    drv = drv if drv is not None else driver()
    rpc = client.stub.OpenLane(pb.OpenLaneRequest(call=call, depth=depth), metadata=client._md(None))
    try:
        resp = next(rpc)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    try:
        return Lane(rpc, resp, drv, device)
    except BaseException:
        rpc.cancel()
        raise
