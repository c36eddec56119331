"""expertd.lane and RemoteMoE's "gpu" path without a GPU: the stream
operations a lane call enqueues, in order, through a recording stand-in for
libcuda; closing; the daemon's refusals typed; and RemoteMoE's choice of
the path (MPS on both sides under "auto")."""

import ctypes
import logging
import re
import threading
import types

import grpc
import pytest

import needs

import expertd
from expertd import lane as el
from expertd.v1 import expert_pb2 as pb


class FakeDriver:
    """Records what a caller's stream would be asked to do."""

    def __init__(self, mps=True):
        self.ops, self.mps, self.open = [], mps, {}

    def write(self, stream, addr, value):
        self.ops.append(("write", stream, addr, value))

    def wait_eq(self, stream, addr, value):
        self.ops.append(("wait==", stream, addr, value))

    def ipc_open(self, handle):
        assert len(handle) == 64
        self.open[handle] = 0x7F0000001000
        return 0x7F0000001000

    def ipc_close(self, ptr):
        self.ops.append(("ipc_close", ptr))

    def mps_enabled(self, device):
        return self.mps

    def context(self, device):
        self.ops.append(("context", device))
        return 0xC0

    def release_context(self, device):
        self.ops.append(("release", device))

    def enter(self, ctx):
        assert ctx == 0xC0
        return None

    def leave(self, prev):
        assert prev is None


class FakeCall:
    """The OpenLane call: its responses, then cancel."""

    def __init__(self, responses):
        self._it, self.cancelled = iter(responses), 0

    def __next__(self):
        r = next(self._it)
        if isinstance(r, Exception):
            raise r
        return r

    def __iter__(self):
        return self

    def cancel(self):
        self.cancelled += 1


class Refused(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return None


class FakeClient:
    def __init__(self, call):
        self.call, self.requests = call, []
        outer = self

        class Stub:
            def OpenLane(self, req, metadata=None):
                outer.requests.append(req)
                return outer.call
        self.stub = Stub()

    def _md(self, metadata):
        return metadata


RESP = pb.OpenLaneResponse(flags_cuda_ipc_handle=b"h" * 64, flags_byte_size=256, doorbell_offset=0,
                           done_offset=128, depth=2, mps=True, skips_on_close=True)


def test_lane_call_is_three_stream_operations():
    drv, call = FakeDriver(), FakeCall([RESP])
    client = FakeClient(call)
    lane = el.open_lane(client, pb.FusedMoERequest(expert_set="layer"), depth=3, drv=drv)
    assert client.requests[0].depth == 3 and client.requests[0].call.expert_set == "layer"
    assert (lane.mps, lane.skips_on_close, lane.depth) == (True, True, 2)
    lane.enqueue(0x1234)
    lane.enqueue(0x1234)
    base = 0x7F0000001000
    one = [("write", 0x1234, base + 128, 0), ("write", 0x1234, base, 1), ("wait==", 0x1234, base + 128, 1)]
    assert drv.ops == [("context", None)] + one + one
    lane.close()
    lane.close()
    assert drv.ops[-1] == ("ipc_close", base) and call.cancelled == 1


def test_open_lane_refusals_are_typed():
    call = FakeCall([Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server already serves 8 lanes (-lane-max 8)")])
    with pytest.raises(expertd.ResourceExhaustedError, match="-lane-max"):
        el.open_lane(FakeClient(call), pb.FusedMoERequest(), drv=FakeDriver())


def test_open_lane_cancels_when_the_flags_do_not_map():
    class NoIPC(FakeDriver):
        def ipc_open(self, handle):
            raise RuntimeError("cuIpcOpenMemHandle: CUresult 201")
    call = FakeCall([RESP])
    with pytest.raises(RuntimeError, match="cuIpcOpenMemHandle"):
        el.open_lane(FakeClient(call), pb.FusedMoERequest(), drv=NoIPC())
    assert call.cancelled == 1


torch = needs.module("torch")
import expertd.torch as et  # noqa: E402


class FakeLink:
    """RemoteMoE's _Link with lanes that answer with the given MPS."""

    def __init__(self, mps):
        self.mps, self.lanes, self.closed = mps, {}, []

    def lane(self, device, m, k, e, expert_set, routing):
        class L:
            pass
        gl = L()
        gl.lane = L()
        gl.lane.mps = self.mps
        self.lanes[(str(device), m)] = gl
        return gl

    def close_lane(self, key):
        self.closed.append(key)
        self.lanes.pop(key)

    def close(self):
        pass


def _module(path, daemon_mps, caller_mps=True, lane_enabled=True):
    remote = et.RemoteMoE(None, "layer", torch.zeros(4, 8), expertd.routing(top_k=1), path=path)
    info = pb.ServerInfo(backends=[pb.ServerInfo.BackendInfo(name="cuda")])
    info.lane.enabled = lane_enabled
    info.limits.max_shm_regions = 1
    remote._info = info
    remote._link = FakeLink(daemon_mps)
    # The CUDA IPC region registers and no ring is served.
    remote._why["cuda:cuda:0"] = None
    remote._why["ring"] = "the daemon serves no call rings (-ring)"
    return remote


@pytest.fixture
def caller_mps(monkeypatch):
    state = {"mps": True}
    monkeypatch.setattr(el, "mps_enabled", lambda device: state["mps"])
    return state


def test_auto_takes_gpu_under_mps(caller_mps, caplog):
    remote = _module("auto", daemon_mps=True)
    dev = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="expertd.torch"):
        assert remote._choose(dev, 1) == "gpu"
        assert remote._choose(dev, 4) == "gpu"
        assert remote._choose(dev, 1) == "gpu"
    assert sorted(remote._link.lanes) == [("cuda:0", 1), ("cuda:0", 4)]
    assert remote.lane_mps is True
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "path gpu" in msgs[0], msgs


def test_auto_skips_gpu_without_mps(caller_mps, caplog):
    dev = torch.device("cuda", 0)
    # The daemon is no MPS client: its lane is closed, and M's calls take
    # the next path; no other lane is tried.
    remote = _module("auto", daemon_mps=False)
    with caplog.at_level(logging.INFO, logger="expertd.torch"):
        assert remote._choose(dev, 1) == "cuda_ipc"
        assert remote._choose(dev, 2) == "cuda_ipc"
    assert remote._link.closed == [("cuda:0", 1)] and remote._link.lanes == {}
    assert any("not shared through MPS" in r.getMessage() for r in caplog.records)
    # This process is none: the lane is not even opened.
    caller_mps["mps"] = False
    remote = _module("auto", daemon_mps=True)
    with caplog.at_level(logging.INFO, logger="expertd.torch"):
        assert remote._choose(dev, 1) == "cuda_ipc"
    assert remote._link.lanes == {}
    # Asked for, the path serves without MPS, with a warning.
    remote = _module("gpu", daemon_mps=False)
    with caplog.at_level(logging.WARNING, logger="expertd.torch"):
        assert remote._choose(dev, 1) == "gpu"
    assert any("context switch" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_gpu_path_refusals(caller_mps):
    dev = torch.device("cuda", 0)
    remote = _module("gpu", daemon_mps=True, lane_enabled=False)
    with pytest.raises(ValueError, match="path gpu is not available: the daemon serves no GPU-ordered lanes"):
        remote._choose(dev, 1)
    remote = _module("gpu", daemon_mps=True)
    with pytest.raises(ValueError, match="path gpu is not available: the tensors are not on a CUDA device"):
        remote._choose(torch.device("cpu"), 1)
    # Past MAX_LANES token counts, auto takes the next path for new ones.
    remote = _module("auto", daemon_mps=True)
    for m in range(1, et.MAX_LANES + 1):
        assert remote._choose(dev, m) == "gpu"
    assert remote._choose(dev, et.MAX_LANES + 1) == "cuda_ipc"


class FakeLibcuda:
    """libcuda's context entry points, with the current context per thread
    as the driver keeps it; the lane's own calls record the context current
    when they are made and refuse a thread without one (CUresult 201,
    CUDA_ERROR_INVALID_CONTEXT), as the driver does."""

    def __init__(self):
        self.local, self.calls, self.retained = threading.local(), [], {0: 0, 1: 0}
        self.primary = {0: 0xA0, 1: 0xA1}
        lib = self

        class Fn:
            def __init__(self, name, body):
                self.name, self.body = name, body
                self.restype, self.argtypes = None, None

            def __call__(self, *args):
                return self.body(*args)

        def cur():
            return getattr(lib.local, "ctx", None)

        def in_ctx(name, result=None):
            def body(*args):
                if not cur():
                    return 201
                lib.calls.append((name, cur()))
                if result is not None:
                    args[0]._obj.value = result
                return 0
            return body

        def get_ctx(p):
            p._obj.value = cur()
            return 0

        def set_ctx(c):
            lib.local.ctx = c.value if isinstance(c, ctypes.c_void_p) else c
            return 0

        def retain(p, dev):
            lib.retained[dev] += 1
            p._obj.value = lib.primary[dev]
            return 0

        def release(dev):
            lib.retained[dev] -= 1
            return 0

        self.fns = {
            "cuStreamWriteValue32_v2": Fn("write", in_ctx("write")), "cuStreamWaitValue32_v2": Fn("wait", in_ctx("wait")),
            "cuIpcOpenMemHandle_v2": Fn("ipc_open", in_ctx("ipc_open", 0x7F0000002000)),
            "cuIpcCloseMemHandle": Fn("ipc_close", in_ctx("ipc_close")),
            "cuDeviceGetAttribute": Fn("attr", lambda *a: 0), "cuCtxGetCurrent": Fn("get", get_ctx),
            "cuCtxSetCurrent": Fn("set", set_ctx), "cuInit": Fn("init", lambda flags: 0),
            "cuDevicePrimaryCtxRetain": Fn("retain", retain), "cuDevicePrimaryCtxRelease_v2": Fn("release", release),
        }

    def __getattr__(self, name):
        try:
            return self.__dict__["fns"][name]
        except KeyError:
            raise AttributeError(name) from None


def _on_thread(f):
    got = {}

    def run():
        try:
            got["v"] = f()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            got["e"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in got:
        raise got["e"]
    return got.get("v")


def test_lane_runs_in_its_devices_context_from_any_thread():
    lib = FakeLibcuda()
    drv = el.Driver(lib)

    def opened(device):
        return el.open_lane(FakeClient(FakeCall([RESP])), pb.FusedMoERequest(), device, drv=drv)
    # Opened, rung and closed each from a thread that has touched no
    # CUDA: every driver call runs in device 1's primary context, which
    # the lane holds while it is open.
    lane = _on_thread(lambda: opened(1))
    assert lane.doorbell == 0x7F0000002000 and lib.retained[1] == 1
    _on_thread(lambda: lane.enqueue(0x1234))
    _on_thread(lane.close)
    assert lib.calls == [("ipc_open", 0xA1), ("write", 0xA1), ("write", 0xA1), ("wait", 0xA1), ("ipc_close", 0xA1)]
    assert lib.retained[1] == 0

    # A thread holding another device's context: the lane's calls run in
    # the lane's, and the thread's own is current again after each.
    def other():
        lib.local.ctx = 0xA1
        lane = opened(0)
        lane.enqueue(7)
        after = lib.local.ctx
        lane.close()
        return after, lib.local.ctx
    lib.calls.clear()
    assert _on_thread(other) == (0xA1, 0xA1)
    assert {c for _, c in lib.calls} == {0xA0} and lib.retained[0] == 0

    # Without a device the thread's current context serves; a bare thread
    # is told what to pass.
    def own():
        lib.local.ctx = 0xB0
        return opened(None)._ctx
    assert _on_thread(own) == 0xB0
    with pytest.raises(RuntimeError, match="pass the device index"):
        _on_thread(lambda: opened(None))


def test_ipc_handle_keeps_every_byte():
    # A handle is binary: zeros inside it must reach the driver too.
    h = bytes([7, 0, 0, 3] + [0] * 58 + [5, 0])
    assert bytes(el._ipc_handle(h)) == h
    with pytest.raises(ValueError):
        el._ipc_handle(h[:63])


def test_link_region_names_follow_the_daemons_rule(monkeypatch):
    """The names of the regions a _Link registers, its lanes' among them
    (which otherwise only a GPU run reaches), pass the daemon's rule for
    names: 1-128 of [A-Za-z0-9._/-] (service's checkName)."""
    from expertd import shm

    rule = re.compile(r"[A-Za-z0-9._/-]{1,128}")
    names = []

    class Client:
        def register_cuda_tensor(self, name, t):
            names.append(name)
            return shm.CudaRegion(name, t)

        def register_shared_memory(self, name, region):
            names.append(name)
            return types.SimpleNamespace(name=name, size=region.size)

        def unregister_shared_memory(self, name):
            pass

    empty = torch.empty
    # Host tensors stand in for the GPU's.
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: empty(*a, **kw))
    monkeypatch.setattr(et._lane, "open_lane", lambda client, call, device, **kw: object())
    link = et._Link(Client(), "layer-" + "x" * 200)
    dev = torch.device("cuda", 3)
    try:
        for m in (1, 64, 8192):
            link.lane(dev, m, 16, 8, "layer", expertd.routing(top_k=1))
        link.cuda(dev, 1 << 10)
        link.host(1 << 10)
    finally:
        link._drop("host")
    assert len(names) == 5 and all(rule.fullmatch(n) for n in names), names
