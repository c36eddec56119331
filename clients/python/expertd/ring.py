"""Call rings: the same-host fast path (docs/ring.md, layout version 1).

A ring lives in a POSIX shared-memory region registered on the caller's
grpcio channel; once the daemon (run with -shared-memory -ring) attaches it,
FusedMoE calls are posted into its slots and completed in place, with no
gRPC message per call:

    shm = expertd.SharedMemory.create(64 << 20)
    region = client.register_shared_memory("ring", shm)
    ring = Ring(shm._buf, offset=0, slots=4, slot_size=64 << 10)   # lays it out
    attached = attach(client.stub, "ring", ring)                   # keep it: the ring lives as long as it
    resp = ring.fused_moe(request_pb)                              # expert_pb2.FusedMoEResponse

This module needs only the standard library for the ring itself (mmap,
ctypes, struct); fused_moe and attach use the generated stubs. Limits: one
process posts into a ring (the doorbell increment is atomic only among this
process's threads), and plain Python stores are ordered on x86-64 (TSO) but
not on arm64, where a C helper with __atomic builtins should do the stores.
CPU cost: a waiting call polls for spin seconds (one core), then sleeps on a
futex.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time

MAGIC = 0x47525845  # b"EXRG"
VERSION = 1
HEADER_SIZE = 256
SLOT_HEADER_SIZE = 64
ALIGN = 64
MIN_SLOT_SIZE = SLOT_HEADER_SIZE + 64
MAX_SLOTS = 1024

FREE, POSTED, RUNNING, DONE = 0, 1, 2, 3
KIND_RESPONSE, KIND_STATUS = 1, 2

# Header word offsets (bytes).
_MAGIC, _VERSION, _SLOT_COUNT, _SLOT_SIZE, _FLAGS = 0, 4, 8, 12, 16
_DOORBELL, _SLEEPING, _CLOSED = 64, 128, 192
# Slot word offsets (bytes).
_STATE, _WAITING, _SEQ, _REQ_LEN, _RESP_LEN, _RESP_KIND, _TIMEOUT, _RESP_SEQ = 0, 4, 8, 16, 20, 24, 32, 40
# The same as indexes of 32- and 64-bit words from the slot's start, for
# the per-call stores and loads.
_W_STATE, _W_WAITING, _W_REQ_LEN, _W_RESP_LEN, _W_RESP_KIND = (o // 4 for o in (
    _STATE, _WAITING, _REQ_LEN, _RESP_LEN, _RESP_KIND))
_Q_SEQ, _Q_TIMEOUT, _Q_RESP_SEQ = (o // 8 for o in (_SEQ, _TIMEOUT, _RESP_SEQ))

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared, not FUTEX_PRIVATE_FLAG: two processes
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def size(slots: int, slot_size: int) -> int:
    """Bytes a ring of slots slots of slot_size bytes takes."""
    return HEADER_SIZE + slots * slot_size


class RingClosed(Exception):
    """The daemon detached the ring (drain, or the attach call ended)."""


class Ring:
    """A call ring at offset of buf (a writable shared mapping, such as an
    mmap of the registered object). init lays it out (zeroes it and writes
    the header, the magic last); the daemon attaches it afterwards."""

    def __init__(self, buf, offset: int = 0, slots: int = 4, slot_size: int = 64 << 10, init: bool = True):
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots {slots}: want 1 to {MAX_SLOTS}")
        if slot_size < MIN_SLOT_SIZE or slot_size % ALIGN:
            raise ValueError(f"slot_size {slot_size}: want a multiple of {ALIGN}, at least {MIN_SLOT_SIZE}")
        n = size(slots, slot_size)
        mv = memoryview(buf).cast("B")
        if offset < 0 or offset + n > len(mv):
            raise ValueError(f"a ring of {n} bytes at offset {offset} does not fit in {len(mv)} bytes")
        self.slots, self.slot_size, self.payload = slots, slot_size, slot_size - SLOT_HEADER_SIZE
        self._mem = mv[offset:offset + n]
        self._u32 = self._mem.cast("I")
        self._u64 = self._mem.cast("Q")
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        # Each slot's first byte: its words are at start // 4 + _W_*
        # (start // 8 + _Q_*), its payload at start + SLOT_HEADER_SIZE.
        self._start = [HEADER_SIZE + i * slot_size for i in range(slots)]
        if self._base % ALIGN:
            raise ValueError(f"the ring must start on a {ALIGN}-byte boundary of its object")
        self._bell = threading.Lock()
        self._free = list(range(slots))
        self._free_cv = threading.Condition()
        # _abandoned are slots of timed-out calls, free once DONE.
        self._abandoned: list[int] = []
        self._seq = 0
        if init:
            self._mem[:] = bytes(n)
            self._u32[_VERSION // 4] = VERSION
            self._u32[_SLOT_COUNT // 4] = slots
            self._u32[_SLOT_SIZE // 4] = slot_size
            self._u32[_MAGIC // 4] = MAGIC

    def drop_memory(self) -> None:
        """Releases the ring's views of its buffer, so that the mapping
        (SharedMemory.close) can be closed; the ring is unusable after.
        Detach it first (cancel the AttachRing call)."""
        for v in (self._u32, self._u64, self._mem):
            v.release()

    # --- words ---
    def _slot(self, i: int, off: int) -> int:
        return self._start[i] + off

    def _futex(self, byte_off: int, op: int, val: int, timeout_s: float | None) -> None:
        if _SYS_FUTEX is None or _libc is None:
            time.sleep(50e-6 if timeout_s is None else min(timeout_s, 50e-6))
            return
        ts = None
        if timeout_s is not None:
            ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1) * 1e9)))
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + byte_off), op, ctypes.c_uint32(val), ts, None, 0)

    @property
    def closed(self) -> bool:
        return self._u32[_CLOSED // 4] != 0

    def state(self, i: int) -> int:
        return self._u32[self._start[i] // 4 + _W_STATE]

    # --- the caller's protocol ---
    def post(self, i: int, seq: int, request: bytes, timeout_ns: int = 0) -> None:
        """Publishes request in slot i (FREE, or DONE and read) and rings
        the doorbell, waking the daemon's poller only if it sleeps."""
        if len(request) > self.payload:
            raise ValueError(f"request of {len(request)} bytes exceeds the slot payload of {self.payload}")
        start, u32, u64 = self._start[i], self._u32, self._u64
        p, w, q = start + SLOT_HEADER_SIZE, start // 4, start // 8
        self._mem[p:p + len(request)] = request
        u32[w + _W_REQ_LEN] = len(request)
        u32[w + _W_RESP_LEN] = 0
        u32[w + _W_RESP_KIND] = 0
        u32[w + _W_WAITING] = 0
        u64[q + _Q_SEQ] = seq
        u64[q + _Q_TIMEOUT] = max(timeout_ns, 0)
        # The state last: the daemon reads the rest once it sees POSTED.
        u32[w + _W_STATE] = POSTED
        with self._bell:
            d = _DOORBELL // 4
            self._u32[d] = (self._u32[d] + 1) & 0xFFFFFFFF
        if self._u32[_SLEEPING // 4]:
            self._futex(_DOORBELL, _FUTEX_WAKE, 1, None)

    def wait_done(self, i: int, spin_s: float = 1e-3, tick_s: float = 2e-3, deadline: float | None = None) -> bool:
        """Waits for slot i to be DONE: polls for spin_s, then sleeps on its
        state word in ticks. False if the ring closed or time.monotonic()
        passed deadline first."""
        w, u32, now = self._start[i] // 4, self._u32, time.monotonic
        st = w + _W_STATE
        end = now() + spin_s
        while now() < end:
            if u32[st] == DONE:
                return True
        while True:
            u32[w + _W_WAITING] = 1
            s = u32[st]
            if s == DONE:
                return True
            if self.closed or (deadline is not None and time.monotonic() > deadline):
                return False
            self._futex(self._slot(i, _STATE), _FUTEX_WAIT, s, tick_s)

    def response(self, i: int) -> tuple[int, int, bytes]:
        """Slot i's completion: (kind, echoed seq, payload bytes copied)."""
        start = self._start[i]
        w = start // 4
        n = self._u32[w + _W_RESP_LEN]
        if n > self.payload:
            raise ValueError(f"response length {n} exceeds the slot payload of {self.payload}")
        p = start + SLOT_HEADER_SIZE
        return self._u32[w + _W_RESP_KIND], self._u64[start // 8 + _Q_RESP_SEQ], bytes(self._mem[p:p + n])

    def release(self, i: int) -> None:
        self._u32[self._start[i] // 4 + _W_STATE] = FREE

    # --- calls ---
    def call(self, request: bytes, timeout_s: float | None = None, spin_s: float = 1e-3) -> tuple[int, bytes]:
        """Posts one serialized request and returns (kind, payload) of its
        completion. A call that times out leaves its slot to the daemon; it
        is reused once the daemon completes it."""
        with self._free_cv:
            while not self._free:
                self._reclaim()
                self._free_cv.wait(1e-3)
            i = self._free.pop()
            self._seq += 1
            seq = self._seq
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.post(i, seq, request, 0 if timeout_s is None else int(timeout_s * 1e9))
        if not self.wait_done(i, spin_s=spin_s, deadline=deadline):
            with self._free_cv:
                self._abandoned.append(i)
            if self.closed:
                raise RingClosed("the daemon detached the ring")
            raise TimeoutError("ring call timed out")
        kind, got, payload = self.response(i)
        self.release(i)
        with self._free_cv:
            self._free.append(i)
            self._free_cv.notify()
        if got != seq:
            raise RuntimeError(f"completion of call {got} in the slot of call {seq}")
        return kind, payload

    def _reclaim(self) -> None:
        keep = []
        for i in self._abandoned:
            if self.state(i) == DONE:
                self.release(i)
                self._free.append(i)
            else:
                keep.append(i)
        self._abandoned = keep

    def fused_moe(self, request, timeout_s: float | None = None, spin_s: float = 1e-3):
        """Runs an expert_pb2.FusedMoERequest through the ring and returns
        the expert_pb2.FusedMoEResponse; an error completion raises the
        expertd.ExpertdError subclass of its gRPC code, as a unary call
        does."""
        from_status, response, status = _messages()
        kind, payload = self.call(request.SerializeToString(), timeout_s=timeout_s, spin_s=spin_s)
        if kind == KIND_STATUS:
            raise from_status(status.FromString(payload))
        return response.FromString(payload)


_message_types = None


def _messages():
    """What fused_moe parses completions with, imported on first use (the
    ring itself needs only the standard library) and kept: an import
    statement costs about a microsecond even when the module is loaded."""
    global _message_types
    if _message_types is None:
        from expertd.errors import from_status
        from expertd.v1 import expert_pb2  # the package's generated stubs
        from google.rpc import status_pb2  # googleapis-common-protos

        _message_types = from_status, expert_pb2.FusedMoEResponse, status_pb2.Status
    return _message_types


def attach(stub, region_name: str, ring: Ring, offset: int = 0, metadata=None):
    """Has the daemon attach ring (laid out at offset of the registered
    region region_name) over stub, an ExpertServiceStub on the channel
    that registered the region, and waits for it to be served. Keep the
    returned call: cancelling it (call.cancel()) detaches the ring."""
    from expertd.v1 import expert_pb2

    call = stub.AttachRing(expert_pb2.AttachRingRequest(
        region_name=region_name, offset=offset, slot_count=ring.slots, slot_size=ring.slot_size), metadata=metadata)
    next(call)
    return call
