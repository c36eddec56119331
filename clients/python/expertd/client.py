"""The synchronous client."""

from __future__ import annotations

import threading
from typing import Iterable, Iterator

import grpc

from expertd import _common as c
from expertd import shm as _shm
from expertd.errors import from_rpc_error
from expertd.v1 import expert_pb2 as pb
from expertd.v1 import expert_pb2_grpc as pb_grpc


class _Base:
    """Arguments and state the sync and asyncio clients share."""

    def __init__(self, target: str, *, tls: bool = False, root_certificates=None,
                 certificate_chain=None, private_key=None, server_name=None, token=None,
                 max_message_bytes: int = c.MAX_MESSAGE_BYTES, options=(), timeout: float = 60.0,
                 widen_bf16: bool = True):
        self.config = c.ChannelConfig(target, tls, root_certificates, certificate_chain, private_key,
                                      server_name, token, max_message_bytes, list(options))
        self.timeout = timeout
        self.widen_bf16 = widen_bf16
        self._regions: dict = {}
        self._lock = threading.Lock()

    def _md(self, metadata):
        return self.config.metadata(metadata)

    def _result(self, resp, like):
        with self._lock:
            regions = dict(self._regions)
        return c.result(resp, like, self.widen_bf16, regions)

    def _remember(self, region):
        with self._lock:
            self._regions[region.name] = region
        return region

    def _forget(self, names):
        with self._lock:
            for n in names:
                self._regions.pop(n, None)

    @staticmethod
    def _cuda_request(name, t):
        handle, offset, size = _shm.cuda_ipc_handle(t)
        return pb.RegisterSharedMemoryRequest(name=name, kind=pb.SHARED_MEMORY_KIND_CUDA_IPC,
                                              cuda_ipc_handle=handle, offset=offset, byte_size=size)

    @staticmethod
    def _posix_request(name, shm, offset, size):
        size = shm.size - offset if size is None else size
        return size, pb.RegisterSharedMemoryRequest(name=name, kind=pb.SHARED_MEMORY_KIND_POSIX,
                                                    key=shm.key, offset=offset, byte_size=size)


class Client(_Base):
    """A connection to an expertd daemon.

    target is a gRPC target ("localhost:50051", "unix:/run/expertd.sock").
    TLS is on with tls=True or any of root_certificates (PEM bytes or a
    path; default: the system roots), certificate_chain and private_key
    (mutual TLS); server_name overrides the name checked in the server's
    certificate. token is sent as `authorization: Bearer <token>` and is
    refused over plaintext to any target that is not loopback. timeout is
    the default deadline of a call in seconds. Outputs in bfloat16 come back
    widened to float32 numpy arrays unless widen_bf16=False (then uint16 bit
    patterns); calls whose hidden states are torch tensors get torch tensors.

    Every failed call raises an expertd.ExpertdError subclass.
    """

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        opts, creds = self.config.channel_args()
        self.channel = (grpc.secure_channel(target, creds, options=opts) if creds
                        else grpc.insecure_channel(target, options=opts))
        self.stub = pb_grpc.ExpertServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout=None, metadata=None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._md(metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # Introspection and the registry.

    def server_info(self, timeout=None, metadata=None) -> pb.ServerInfo:
        return self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout, metadata)

    def list_experts(self, timeout=None, metadata=None) -> list[pb.ExpertSetInfo]:
        return list(self._call(self.stub.ListExperts, pb.ListExpertsRequest(), timeout, metadata).expert_sets)

    def unload_experts(self, name: str, timeout=None, metadata=None) -> int:
        """Unloads a set; returns the bytes freed."""
        return self._call(self.stub.UnloadExperts, pb.UnloadExpertsRequest(name=name), timeout, metadata).freed_bytes

    def load_experts(self, name: str, w13, w2, w13_scale=None, w2_scale=None, a13_scale=None,
                     a2_scale=None, *, activation="silu_gated", block_shape=None, overwrite=False,
                     chunk_bytes=c.CHUNK_BYTES, progress=None, timeout=600,
                     metadata=None, **extra) -> pb.ExpertSetInfo:
        """Uploads a layer in chunks with a SHA-256 the server checks.

        w13 [E, 2N, K] (gated; gate rows first, interleaved for
        "swiglu_oai") or [E, N, K] and w2 [E, K, N] are FP8 E4M3FN: uint8
        code arrays or torch float8_e4m3fn tensors. Scales are float32 of
        the shapes MOE_SPEC.md lists; block_shape [Bn, Bk] names block
        scales. progress(sent, total) follows the chunks. extra takes
        w13_bias, w2_bias, swiglu_limit and swiglu_alpha (see
        expertd.expert_weights).
        """
        reqs = c.load_requests(name, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                               activation, block_shape, overwrite, chunk_bytes, progress, **extra)
        return self._call(self.stub.LoadExperts, reqs, timeout, metadata)

    def load_safetensors(self, name: str, path: str, layer: int = 0, preset="qwen3_moe", *,
                         timeout=600, metadata=None, **fields) -> pb.ExpertSetInfo:
        """Has the daemon read a layer from its -weights-dir (see
        LoadExpertsRequest.SafetensorsSource for the fields)."""
        req = c.safetensors_source(name, path, layer, preset, **fields)
        return self._call(self.stub.LoadExperts, iter([req]), timeout, metadata)

    # The operation.

    def fused_moe(self, hidden, *, expert_set=None, weights=None, router_logits=None, top_k=0,
                  renormalize=False, scoring="softmax", output_dtype="bfloat16", like=None,
                  timeout=None, metadata=None, **kwargs) -> c.FusedMoEResult:
        """Runs one MoE layer (see expertd.fused_moe_request for the
        arguments) and returns a FusedMoEResult."""
        req = c.fused_moe_request(hidden, expert_set=expert_set, weights=weights,
                                  router_logits=router_logits, top_k=top_k, renormalize=renormalize,
                                  scoring=scoring, output_dtype=output_dtype, **kwargs)
        return self._result(self._call(self.stub.FusedMoE, req, timeout, metadata), c.like_of(hidden, like))

    def fused_moe_stream(self, requests: Iterable, *, like="numpy", timeout=None,
                         metadata=None) -> Iterator[c.FusedMoEResult]:
        """Pipelines calls over one FusedMoEStream: requests (FusedMoERequest
        messages, e.g. from expertd.fused_moe_request, or dicts of its
        arguments) are sent as the iterator yields them, while earlier
        answers arrive; one result per request, in order."""
        def msgs():
            for r in requests:
                yield r if isinstance(r, pb.FusedMoERequest) else c.fused_moe_request(**r)

        try:
            call = self.stub.FusedMoEStream(msgs(), timeout=timeout, metadata=self._md(metadata))
            for resp in call:
                yield self._result(resp, like)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # Shared memory.

    def register_shared_memory(self, name: str, shm: _shm.SharedMemory, offset: int = 0,
                               size: int | None = None, timeout=None, metadata=None) -> _shm.Region:
        """Registers size bytes (default: the rest) of a POSIX object at
        offset under name, on this connection."""
        size, req = self._posix_request(name, shm, offset, size)
        resp = self._call(self.stub.RegisterSharedMemory, req, timeout, metadata)
        return self._remember(_shm.Region(name, shm, offset, size, resp.region))

    def register_cuda_tensor(self, name: str, t, timeout=None, metadata=None) -> _shm.CudaRegion:
        """Registers the storage of torch CUDA tensor t through CUDA IPC
        (cuda backend only). Keep t alive while it is registered; views of
        its storage can then be sent with region.tensor(view) and outputs
        written with output_shm=region.ref(view)."""
        resp = self._call(self.stub.RegisterSharedMemory, self._cuda_request(name, t), timeout, metadata)
        return self._remember(_shm.CudaRegion(name, t, resp.region))

    def unregister_shared_memory(self, name: str = "", timeout=None, metadata=None) -> list[str]:
        """Unregisters a region (every region of this connection when name
        is empty); returns the names unregistered."""
        names = list(self._call(self.stub.UnregisterSharedMemory,
                                pb.UnregisterSharedMemoryRequest(name=name), timeout, metadata).names)
        self._forget(names)
        return names

    def list_shared_memory(self, name: str = "", timeout=None, metadata=None) -> list[pb.SharedMemoryRegion]:
        return list(self._call(self.stub.ListSharedMemory, pb.ListSharedMemoryRequest(name=name),
                               timeout, metadata).regions)
