"""PyTorch integration: RemoteMoE serves a Hugging Face MoE block's routed
experts from expertd.

    block = model.model.layers[5].mlp                     # e.g. Qwen3MoeSparseMoeBlock
    model.model.layers[5].mlp = expertd.torch.RemoteMoE.from_hf(block, client, "qwen3/layer5")

from_hf quantizes the block's expert weights to FP8 E4M3 with one scale per
output channel (exact for weights that are already FP8 with such scales),
uploads them once, and keeps the router (gate) and any shared experts in
this process: forward computes the router logits locally, has the service
run the routed experts, and adds the shared experts' output. Known blocks:
Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3MoE (also Kimi-K2)
and NemotronH's MoE, with experts stored either as a ModuleList of MLPs or
as fused [E, 2N, K] / [E, K, N] parameters.

RemoteMoE picks the fastest path the daemon offers at its first forward
(path="auto"), says which in its path attribute and one log line (logger
"expertd.torch"), and falls back to plain gRPC where a faster one is not
served:

    "gpu"            CUDA tensors in a CUDA IPC region, each call started
                     from torch's current stream through a GPU-ordered lane
                     (docs/gpu-ordered.md): no host thread on the call's
                     path, capturable in a CUDA graph (cuda backend on this
                     GPU, -shared-memory, MPS on both sides; "auto" takes it
                     only under MPS, since without it each call costs a
                     context switch, about 0.3 ms)
    "ring+cuda_ipc"  CUDA tensors in a CUDA IPC region, calls posted into a
                     call ring (cuda backend on this GPU, -shared-memory -ring)
    "cuda_ipc"       the same region, each call a unary gRPC call (no -ring)
    "ring"           host tensors in a POSIX shared-memory region, calls
                     posted into a call ring (same host, -shared-memory -ring)
    "grpc"           tensors inline in unary gRPC calls (any daemon)

CUDA tensors that cannot go through CUDA IPC (a cpu-backend daemon, a GPU
the daemon cannot open) take the host path picked for host tensors.

A lane serves one token count: the "gpu" path opens one per M it sees (up
to MAX_LANES per module, then M takes the next path), on the first forward
of that M, which must therefore run before a CUDA graph captures it.
"""

from __future__ import annotations

import logging
import weakref

import grpc
import torch
import torch.nn.functional as F
from torch import nn

from expertd import _common
from expertd import lane as _lane
from expertd import ring as _ring
from expertd import shm as _shm
from expertd import tensors as _tensors
from expertd.errors import ExpertdError, from_rpc_error
from expertd.v1 import expert_pb2 as pb

FP8_MAX = 448.0

log = logging.getLogger("expertd.torch")

# PATHS are the values of RemoteMoE's path argument besides "auto".
PATHS = ("gpu", "ring+cuda_ipc", "cuda_ipc", "ring", "grpc")

# MAX_LANES bounds one module's lanes (one per token count); each holds a
# slot of the daemon's -lane-max.
MAX_LANES = 8

# _MAX_PREPARED bounds one module's prepared calls per region (one per
# input shape); past it they are made again as needed.
_MAX_PREPARED = 64

# A ring's slots carry requests and responses whose tensors are region
# references: a few hundred bytes each, so small slots suffice.
_RING_SLOTS, _RING_SLOT_BYTES = 4, 16 << 10
_ALIGN = 256


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes of w [..., rows, cols] with one float32 scale per row
    (amax / 448), as compressed-tensors' per-channel scheme does."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-10)
    codes = (w / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.unsqueeze(-1)


def _first(objs, names, default=None):
    for o in objs:
        if o is None:
            continue
        for n in names:
            v = getattr(o, n, None)
            if v is not None:
                return v
    return default


def _expert_weights(experts, k: int):
    """(w13 [E, rows, K] with gate rows first, w2 [E, K, N], gated) of a
    ModuleList of MLPs or fused expert parameters."""
    if isinstance(experts, nn.ModuleList):
        first = experts[0]
        names = next((ns for ns in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
                      if all(hasattr(first, n) for n in ns)), None)
        if names is not None:
            w13 = torch.stack([torch.cat([getattr(x, names[0]).weight, getattr(x, names[1]).weight]) for x in experts])
            return w13, torch.stack([getattr(x, names[2]).weight for x in experts]), True
        if hasattr(first, "up_proj") and hasattr(first, "down_proj"):  # Nemotron-H: relu2, no gate
            return (torch.stack([x.up_proj.weight for x in experts]),
                    torch.stack([x.down_proj.weight for x in experts]), False)
        raise TypeError(f"experts of {type(first).__name__}: no gate_proj/up_proj/down_proj or w1/w3/w2")
    gu = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    gated = gu is not None
    if gu is None:
        gu = getattr(experts, "up_proj", None)
    if gu is None or down is None or not isinstance(down, torch.Tensor):
        raise TypeError(f"{type(experts).__name__}: want gate_up_proj (or up_proj) and down_proj parameters")
    # Fused layouts store [E, rows, K] (weights as rows) or [E, K, rows].
    if gu.shape[-1] != k:
        gu = gu.transpose(1, 2)
    if down.shape[1] != k:
        down = down.transpose(1, 2)
    return gu, down, gated


def _device_index(device) -> int:
    """A CUDA torch.device's index; "cuda" alone means torch's current one."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _layout(*sizes: int) -> tuple[list[int], int]:
    """Offsets of buffers of sizes bytes laid out in order on _ALIGN
    boundaries, and the bytes they span."""
    offs, end = [], 0
    for n in sizes:
        offs.append(end)
        end += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return offs, end


class _Link:
    """What one RemoteMoE holds on the daemon's side of its client's
    connection: a call ring, a POSIX region for host tensors and a CUDA IPC
    region for CUDA tensors, each made on first use. close releases them;
    it runs when the module is closed or collected."""

    def __init__(self, client, name: str):
        self.client = client
        # Region names are bounded (128 bytes); the suffix keeps them
        # unique per module.
        self.prefix = f"{name[:96]}/{id(self):x}"
        self.ring = None
        self._attached = None
        self._shms: dict[str, _shm.SharedMemory] = {}
        self._regions: dict[str, object] = {}
        # lanes by (device, M): the lane and its region's tensors.
        self.lanes: dict[tuple[str, int], _GpuLane] = {}
        # Calls by region ("host", "cuda") and shape: views of the region's
        # buffers and the request naming them, made once (building them is
        # most of a small call's Python time); they go with the region.
        self.calls: dict[str, dict[tuple, tuple]] = {"host": {}, "cuda": {}}

    def _register_posix(self, what: str, size: int):
        shm = _shm.SharedMemory.create(size)
        try:
            region = self.client.register_shared_memory(f"{self.prefix}/{what}", shm)
        except BaseException:
            shm.close()
            raise
        shm.unlink()
        self._shms[what], self._regions[what] = shm, region
        return shm, region

    def prepared(self, what: str, key: tuple):
        """The call prepared for key's shape on region what, or None."""
        return self.calls[what].get(key)

    def prepare(self, what: str, key: tuple, views, req: pb.FusedMoERequest) -> tuple:
        """Keeps a call prepared on region what (views of its buffers and
        the request naming them) for key's shape, and returns it."""
        calls = self.calls[what]
        if len(calls) >= _MAX_PREPARED:
            calls.clear()
        calls[key] = views, req
        return calls[key]

    def _drop(self, what: str) -> None:
        if what in self.calls:
            # Views of a POSIX mapping keep it from closing, and a new
            # region of either kind has buffers of its own.
            self.calls[what].clear()
        region, shm = self._regions.pop(what, None), self._shms.pop(what, None)
        try:
            if region is not None:
                self.client.unregister_shared_memory(region.name)
        except (ExpertdError, ValueError):
            pass  # the connection (or the channel) is gone, and the daemon forgot the region with it
        finally:
            if shm is not None:
                shm.close()

    def open_ring(self) -> None:
        """Attaches a call ring; raises where the daemon cannot map this
        process's shared memory (another host) or serves no rings."""
        if self.ring is not None:
            return
        shm, region = self._register_posix("ring", _ring.size(_RING_SLOTS, _RING_SLOT_BYTES))
        r = _ring.Ring(shm._buf, 0, slots=_RING_SLOTS, slot_size=_RING_SLOT_BYTES)
        try:
            self._attached = _ring.attach(self.client.stub, region.name, r, metadata=self.client._md(None))
        except grpc.RpcError as e:
            r.drop_memory()
            self._drop("ring")
            raise from_rpc_error(e) from None
        self.ring = r

    def host(self, size: int):
        """A registered POSIX region of at least size bytes."""
        region = self._regions.get("host")
        if region is None or region.size < size:
            self._drop("host")
            region = self._register_posix("host", max(2 * size, 1 << 20))[1]
        return region

    def cuda(self, device, size: int):
        """A CUDA IPC region of at least size bytes on device."""
        region = self._regions.get("cuda")
        if region is None or region.size < size or region.base.device != device:
            self._drop("cuda")
            arena = torch.empty(max(2 * size, 1 << 20), dtype=torch.uint8, device=device)
            region = self.client.register_cuda_tensor(f"{self.prefix}/cuda", arena)
            self._regions["cuda"] = region
        return region

    def lane(self, device, m: int, k: int, e: int, expert_set: str, routing: pb.Routing) -> "_GpuLane":
        """Opens a lane for M = m calls on device, over a CUDA IPC region
        of its own (a lane fixes its buffers' addresses)."""
        need = [m * k * 2, m * e * 4, m * k * 2]
        offs, size = _layout(*need)
        arena = torch.empty(size, dtype=torch.uint8, device=device)
        # Region names take [A-Za-z0-9._/-] only.
        what = f"lane{m}-cuda{_device_index(device)}"
        region = self.client.register_cuda_tensor(f"{self.prefix}/{what}", arena)
        self._regions[what] = region
        h = arena[offs[0]:offs[0] + need[0]].view(torch.bfloat16).view(m, k)
        lg = arena[offs[1]:offs[1] + need[1]].view(torch.float32).view(m, e)
        out = arena[offs[2]:offs[2] + need[2]].view(torch.bfloat16).view(m, k)
        call = _common.fused_moe_request(region.tensor(h), expert_set=expert_set, router_logits=region.tensor(lg),
                                         routing_message=routing, output_shm=region.ref(out))
        try:
            lane = _lane.open_lane(self.client, call, _device_index(device))
        except BaseException:
            self._drop(what)
            raise
        gl = _GpuLane(lane, what, h, lg, out)
        self.lanes[(str(device), m)] = gl
        return gl

    def close_lane(self, key) -> None:
        gl = self.lanes.pop(key, None)
        if gl is None:
            return
        # A call still waiting on the caller's stream ends before the lane.
        torch.cuda.synchronize(gl.out.device)
        try:
            gl.lane.close()
        finally:
            self._drop(gl.region)

    def call(self, req: pb.FusedMoERequest, ring: bool) -> pb.FusedMoEResponse:
        if ring:
            return self.ring.fused_moe(req, timeout_s=self.client.timeout)
        return self.client._call(self.client.stub.FusedMoE, req)

    def close(self) -> None:
        for key in list(self.lanes):
            self.close_lane(key)
        if self._attached is not None:
            self._attached.cancel()
            self._attached = None
        if self.ring is not None:
            self.ring.drop_memory()
            self.ring = None
        for what in list(self._regions):
            self._drop(what)


def _on_gpu(path: str) -> bool:
    """Whether path takes CUDA tensors where they are."""
    return path == "gpu" or path.endswith("cuda_ipc")


class _GpuLane:
    """An open lane and the tensors of its region: the call reads h and lg
    and writes out."""

    def __init__(self, lane, region: str, h, lg, out):
        self.lane, self.region, self.h, self.lg, self.out = lane, region, h, lg, out


class RemoteMoE(nn.Module):
    """A MoE block whose routed experts run in expertd.

    gate_weight [E, K] makes router logits from the hidden states here;
    routing is a Routing message (or expertd.routing(...)); shared is an
    optional module added to the output (DeepSeek-V3 and Nemotron-H shared
    experts); output_dtype is the service's output dtype on the host paths
    (default float32 for float32 hidden states, else bfloat16; the paths
    that take CUDA tensors where they are, gpu and the CUDA IPC ones, return
    bfloat16). path is "auto" (the fastest the daemon serves
    for the inputs' device) or one of PATHS, which must then be served.
    After a forward, the path attribute names the path it took. close()
    releases the ring and regions (the module's collection does too). Use
    from_hf to build one from a transformers block.
    """

    def __init__(self, client, name: str, gate_weight: torch.Tensor, routing: pb.Routing,
                 shared: nn.Module | None = None, returns_router_logits: bool = False,
                 output_dtype: str | None = None, path: str = "auto"):
        super().__init__()
        if path != "auto" and path not in PATHS:
            raise ValueError(f"path {path!r}: want 'auto' or one of {', '.join(PATHS)}")
        self.client, self.name, self.routing = client, name, routing
        self.gate_weight = nn.Parameter(gate_weight.detach().clone(), requires_grad=False)
        self.shared = shared
        self.returns_router_logits = returns_router_logits
        self.output_dtype = output_dtype
        self.requested_path = path
        self.path: str | None = None
        self._paths: dict[str, str] = {}
        self._why: dict[str, str | None] = {}
        # lane_mps: whether the daemon reported MPS for this module's last
        # lane (None before one opened).
        self.lane_mps: bool | None = None
        self._info = None
        self._link = _Link(client, name)
        weakref.finalize(self, self._link.close)

    def close(self) -> None:
        self._link.close()
        self._paths.clear()
        self._why.clear()

    @classmethod
    def from_hf(cls, block: nn.Module, client, name: str, config=None, overwrite: bool = True,
                path: str = "auto", chunk_bytes: int = _common.CHUNK_BYTES) -> "RemoteMoE":
        """Uploads block's experts as expert set name and returns the module
        that serves the block. config is the model's config when the block
        does not keep one (block.config is used otherwise)."""
        config = config if config is not None else getattr(block, "config", None)
        gate = block.gate
        gate_w = gate.weight if isinstance(gate.weight, torch.Tensor) else gate.weight()
        e, k = gate_w.shape
        kind = type(block).__name__
        if not isinstance(getattr(block, "fc1_latent_proj", nn.Identity()), nn.Identity):
            raise TypeError(f"{kind}: experts behind a latent projection (moe_latent_size) are not supported")
        w13, w2, gated = _expert_weights(block.experts, k)
        sigmoid = "Deepseek" in kind or "NemotronH" in kind or "Kimi" in kind or \
            getattr(gate, "e_score_correction_bias", None) is not None
        top_k = _first((block, gate, config), ("top_k", "num_experts_per_tok"))
        if top_k is None:
            raise ValueError(f"{kind}: cannot find top_k (pass config=)")
        norm = _first((block, gate, config), ("norm_topk_prob",), default=None)
        if "Mixtral" in kind:
            norm = True  # Mixtral renormalizes its top-k softmax weights always
        if norm is None:
            norm = sigmoid
        routing = pb.Routing(top_k=int(top_k), renormalize=bool(norm),
                             scoring=pb.SCORING_SIGMOID if sigmoid else pb.SCORING_SOFTMAX)
        if sigmoid:
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                routing.correction_bias.CopyFrom(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[e],
                                                           data=bias.detach().float().cpu().numpy().tobytes()))
            n_group = _first((block, gate, config), ("n_group", "num_group"), default=0) or 0
            if n_group:
                routing.num_expert_groups = int(n_group)
                routing.topk_groups = int(_first((block, gate, config), ("topk_group",), default=n_group))
            sf = _first((block, gate, config), ("routed_scaling_factor",), default=0.0)
            routing.routed_scaling_factor = float(sf or 0.0)
        c13, s13 = quantize_fp8_rows(w13)
        c2, s2 = quantize_fp8_rows(w2)
        client.load_experts(name, c13.cpu(), c2.cpu(), s13.cpu(), s2.cpu(),
                            activation="silu_gated" if gated else "relu2", overwrite=overwrite,
                            chunk_bytes=chunk_bytes)
        # Whether the block returns (hidden, router_logits) differs across
        # transformers versions; one token through it says.
        with torch.no_grad():
            probe = block(torch.zeros(1, 1, k, dtype=gate_w.dtype, device=gate_w.device))
        returns = isinstance(probe, tuple)
        return cls(client, name, gate_w, routing, shared=getattr(block, "shared_experts", None),
                   returns_router_logits=returns, path=path)

    # Path choice: each reason is None where the means is served, else why
    # not; each is found out once.

    def _server(self):
        if self._info is None:
            self._info = self.client.server_info()
        return self._info

    def _ring_why(self) -> str | None:
        if "ring" not in self._why:
            info = self._server()
            if not info.limits.max_shm_regions:
                why = "the daemon serves no shared memory (-shared-memory)"
            elif not info.ring.enabled:
                why = "the daemon serves no call rings (-ring)"
            else:
                try:
                    self._link.open_ring()
                    why = None
                except (ExpertdError, OSError) as e:  # another host cannot map this process's memory
                    why = f"attaching a ring failed: {e}"
            self._why["ring"] = why
        return self._why["ring"]

    def _cuda_why(self, device) -> str | None:
        key = f"cuda:{device}"
        if key not in self._why:
            info = self._server()
            backend = info.backends[0].name if info.backends else ""
            if not info.limits.max_shm_regions:
                why = "the daemon serves no shared memory (-shared-memory)"
            elif backend != "cuda":
                why = f"the daemon runs the {backend or 'unknown'} backend, not cuda"
            else:
                try:
                    self._link.cuda(device, 1 << 20)
                    why = None
                except (ExpertdError, ValueError) as e:  # another host, or a GPU the daemon cannot open
                    why = f"registering a CUDA IPC region on {device} failed: {e}"
            self._why[key] = why
        return self._why[key]

    def _lane_why(self, device) -> str | None:
        key = f"lane:{device}"
        if key not in self._why:
            why = None
            if not self._server().lane.enabled:
                why = "the daemon serves no GPU-ordered lanes (-lanes with -shared-memory, cuda backend)"
            else:
                try:
                    mps = _lane.mps_enabled(_device_index(device))
                except OSError as e:
                    why = f"libcuda: {e}"
                else:
                    if not mps and self.requested_path == "auto":
                        why = "this process's GPU contexts are not shared through MPS (a lane call would cost a context switch)"
            self._why[key] = why
        return self._why[key]

    def _why_not(self, path: str, device) -> str | None:
        cuda = _on_gpu(path)
        if cuda and device.type != "cuda":
            return "the tensors are not on a CUDA device"
        reasons = [self._cuda_why(device) if cuda else None, self._ring_why() if path.startswith("ring") else None,
                   self._lane_why(device) if path == "gpu" else None]
        return next((r for r in reasons if r is not None), None)

    def _choose(self, device, m: int | None = None) -> str:
        """The path for calls on device; with m, for M = m calls, which
        the "gpu" path may have refused (no lane for that M)."""
        key = str(device) if m is None or self._paths.get(str(device)) != "gpu" else f"{device}/m={m}"
        if key in self._paths:
            return self._paths[key]
        if m is not None and key != str(device):
            why = self._why.get(f"nolane:{device}") or self._gpu_lane(device, m)
            if why is None:
                self._paths[key] = "gpu"
                return "gpu"
            path = next(p for p in PATHS[1:] if self._why_not(p, device) is None or p == "grpc")
            self._paths[key] = path
            log.info("RemoteMoE %s on %s, M=%d: path %s (gpu unavailable: %s)", self.name, device, m, path, why)
            return path
        if self.requested_path != "auto":
            why = self._why_not(self.requested_path, device)
            if why is not None:
                raise ValueError(f"RemoteMoE {self.name}: path {self.requested_path} is not available: {why}")
            path, skipped = self.requested_path, []
        else:
            skipped = []
            for path in PATHS:
                if _on_gpu(path) and device.type != "cuda":
                    continue
                why = self._why_not(path, device) if path != "grpc" else None
                if why is None:
                    break
                skipped.append(f"{path} unavailable: {why}")
        self._paths[key] = path
        log.info("RemoteMoE %s on %s: path %s%s", self.name, key, path,
                 f" ({'; '.join(skipped)})" if skipped else "")
        if path == "gpu" and m is not None:
            return self._choose(device, m)
        return path

    def _gpu_lane(self, device, m: int) -> str | None:
        """Opens the lane for M = m calls on device; None when it serves,
        else why not (path="gpu" raises instead)."""
        try:
            if len(self._link.lanes) >= MAX_LANES:
                raise ValueError(f"this module already has {MAX_LANES} lanes (MAX_LANES)")
            gl = self._link.lane(device, m, self.gate_weight.shape[1], self.gate_weight.shape[0], self.name, self.routing)
        except (ExpertdError, ValueError, OSError, RuntimeError) as e:
            if self.requested_path == "gpu":
                raise
            return f"opening a lane failed: {e}"
        self.lane_mps = gl.lane.mps
        if gl.lane.mps:
            return None
        if self.requested_path == "gpu":
            log.warning("RemoteMoE %s: the daemon's GPU contexts are not shared through MPS: each lane call costs a "
                        "context switch (about 0.3 ms); start the MPS control daemon for both processes", self.name)
            return None
        self._link.close_lane((str(device), m))
        why = "the daemon's GPU contexts are not shared through MPS (a lane call would cost a context switch)"
        self._why[f"nolane:{device}"] = why
        return why

    # Calls.

    def _call_gpu(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        gl = self._link.lanes[(str(x.device), x.shape[0])]
        gl.h.copy_(x)
        gl.lg.copy_(logits)
        gl.lane.enqueue(torch.cuda.current_stream(x.device).cuda_stream)
        return gl.out.clone()

    def _call_cuda(self, x: torch.Tensor, logits: torch.Tensor, ring: bool) -> torch.Tensor:
        m, k = x.shape
        need = [m * k * 2, m * logits.shape[1] * 4, m * k * 2]
        offs, size = _layout(*need)
        region = self._link.cuda(x.device, size)
        call = self._link.prepared("cuda", (m, k, logits.shape[1]))
        if call is None:
            a = region.base
            h = a[offs[0]:offs[0] + need[0]].view(torch.bfloat16).view(m, k)
            lg = a[offs[1]:offs[1] + need[1]].view(torch.float32).view(m, -1)
            out = a[offs[2]:offs[2] + need[2]].view(torch.bfloat16).view(m, k)
            req = _common.fused_moe_request(region.tensor(h), expert_set=self.name, router_logits=region.tensor(lg),
                                            routing_message=self.routing, output_shm=region.ref(out))
            call = self._link.prepare("cuda", (m, k, logits.shape[1]), (h, lg, out), req)
        (h, lg, out), req = call
        h.copy_(x)
        lg.copy_(logits)
        torch.cuda.current_stream(x.device).synchronize()
        self._link.call(req, ring)
        return out.clone()

    def _call_host(self, x: torch.Tensor, logits: torch.Tensor, output_dtype: str, ring: bool) -> torch.Tensor:
        # BF16 travels as itself; any other dtype as float32, which holds it.
        h = x.detach().to("cpu", torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
        logits = logits.detach().cpu()
        if not ring:
            return self.client.fused_moe(h, expert_set=self.name, router_logits=logits,
                                         routing_message=self.routing, output_dtype=output_dtype,
                                         like="torch").output
        m, k = h.shape
        need = [h.numel() * h.element_size(), logits.numel() * 4, m * k * (4 if output_dtype == "float32" else 2)]
        offs, size = _layout(*need)
        region = self._link.host(size)
        key = (h.dtype, m, k, logits.shape[1], output_dtype)
        call = self._link.prepared("host", key)
        if call is None:
            hname = "bfloat16" if h.dtype == torch.bfloat16 else "float32"
            views = [region.read(off, _tensors.DTYPES[name], shape, like="torch", widen=False)
                     for off, name, shape in ((offs[0], hname, (m, k)), (offs[1], "float32", tuple(logits.shape)),
                                              (offs[2], output_dtype, (m, k)))]
            req = _common.fused_moe_request(
                region.tensor(hname, (m, k), offs[0]), expert_set=self.name,
                router_logits=region.tensor("float32", tuple(logits.shape), offs[1]), routing_message=self.routing,
                output_dtype=output_dtype, output_shm=region.ref(offs[2], need[2]))
            call = self._link.prepare("host", key, views, req)
        (hv, lv, out), req = call
        hv.copy_(h)
        lv.copy_(logits)
        self._link.call(req, ring=True)
        # The output is a view of the region, which the next call reuses.
        return out.clone()

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate_weight.float())
        self.path = self._choose(x.device, x.shape[0])
        if self.path == "gpu":
            y = self._call_gpu(x.to(torch.bfloat16), logits)
        elif self.path.endswith("cuda_ipc"):
            y = self._call_cuda(x.to(torch.bfloat16), logits, ring=self.path.startswith("ring"))
        else:
            out = self.output_dtype or ("float32" if hidden_states.dtype == torch.float32 else "bfloat16")
            y = self._call_host(x, logits, out, ring=self.path == "ring")
        y = y.to(hidden_states.device, hidden_states.dtype).reshape(shape)
        if self.shared is not None:
            y = y + self.shared(hidden_states)
        if self.returns_router_logits:
            return y, logits.to(hidden_states.dtype)
        return y
