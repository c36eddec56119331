"""The asyncio client (grpc.aio): the same methods as expertd.Client, as
coroutines; fused_moe_stream is an async iterator.

    async with expertd.aio.Client("localhost:50051") as c:
        res = await c.fused_moe(hidden, expert_set="layer0", router_logits=logits, top_k=2)
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import grpc.aio

from expertd import _common as c
from expertd import shm as _shm
from expertd.client import _Base
from expertd.errors import from_rpc_error
from expertd.v1 import expert_pb2 as pb
from expertd.v1 import expert_pb2_grpc as pb_grpc


class Client(_Base):
    """An asyncio connection to an expertd daemon; the arguments are
    expertd.Client's. Make it inside the running event loop."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        opts, creds = self.config.channel_args()
        self.channel = (grpc.aio.secure_channel(target, creds, options=opts) if creds
                        else grpc.aio.insecure_channel(target, options=opts))
        self.stub = pb_grpc.ExpertServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, method, request, timeout=None, metadata=None):
        try:
            return await method(request, timeout=timeout or self.timeout, metadata=self._md(metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def server_info(self, timeout=None, metadata=None) -> pb.ServerInfo:
        return await self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout, metadata)

    async def list_experts(self, timeout=None, metadata=None) -> list[pb.ExpertSetInfo]:
        resp = await self._call(self.stub.ListExperts, pb.ListExpertsRequest(), timeout, metadata)
        return list(resp.expert_sets)

    async def unload_experts(self, name: str, timeout=None, metadata=None) -> int:
        resp = await self._call(self.stub.UnloadExperts, pb.UnloadExpertsRequest(name=name), timeout, metadata)
        return resp.freed_bytes

    async def load_experts(self, name: str, w13, w2, w13_scale=None, w2_scale=None, a13_scale=None,
                           a2_scale=None, *, activation="silu_gated", block_shape=None, overwrite=False,
                           chunk_bytes=c.CHUNK_BYTES, progress=None, timeout=600,
                           metadata=None, **extra) -> pb.ExpertSetInfo:
        reqs = c.load_requests(name, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                               activation, block_shape, overwrite, chunk_bytes, progress, **extra)
        return await self._call(self.stub.LoadExperts, reqs, timeout, metadata)

    async def load_safetensors(self, name: str, path: str, layer: int = 0, preset="qwen3_moe", *,
                               timeout=600, metadata=None, **fields) -> pb.ExpertSetInfo:
        req = c.safetensors_source(name, path, layer, preset, **fields)
        return await self._call(self.stub.LoadExperts, iter([req]), timeout, metadata)

    async def fused_moe(self, hidden, *, expert_set=None, weights=None, router_logits=None, top_k=0,
                        renormalize=False, scoring="softmax", output_dtype="bfloat16", like=None,
                        timeout=None, metadata=None, **kwargs) -> c.FusedMoEResult:
        req = c.fused_moe_request(hidden, expert_set=expert_set, weights=weights,
                                  router_logits=router_logits, top_k=top_k, renormalize=renormalize,
                                  scoring=scoring, output_dtype=output_dtype, **kwargs)
        resp = await self._call(self.stub.FusedMoE, req, timeout, metadata)
        return self._result(resp, c.like_of(hidden, like))

    async def fused_moe_stream(self, requests, *, like="numpy", timeout=None,
                               metadata=None) -> AsyncIterator[c.FusedMoEResult]:
        """Pipelines calls over one FusedMoEStream; requests is a sync or
        async iterable of FusedMoERequest messages or argument dicts."""
        def conv(r):
            return r if isinstance(r, pb.FusedMoERequest) else c.fused_moe_request(**r)

        async def msgs():
            if hasattr(requests, "__aiter__"):
                async for r in requests:
                    yield conv(r)
            else:
                for r in requests:
                    yield conv(r)

        try:
            call = self.stub.FusedMoEStream(msgs(), timeout=timeout, metadata=self._md(metadata))
            async for resp in call:
                yield self._result(resp, like)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def register_shared_memory(self, name: str, shm: _shm.SharedMemory, offset: int = 0,
                                     size: int | None = None, timeout=None, metadata=None) -> _shm.Region:
        size, req = self._posix_request(name, shm, offset, size)
        resp = await self._call(self.stub.RegisterSharedMemory, req, timeout, metadata)
        return self._remember(_shm.Region(name, shm, offset, size, resp.region))

    async def register_cuda_tensor(self, name: str, t, timeout=None, metadata=None) -> _shm.CudaRegion:
        resp = await self._call(self.stub.RegisterSharedMemory, self._cuda_request(name, t), timeout, metadata)
        return self._remember(_shm.CudaRegion(name, t, resp.region))

    async def unregister_shared_memory(self, name: str = "", timeout=None, metadata=None) -> list[str]:
        resp = await self._call(self.stub.UnregisterSharedMemory, pb.UnregisterSharedMemoryRequest(name=name),
                                timeout, metadata)
        self._forget(resp.names)
        return list(resp.names)

    async def list_shared_memory(self, name: str = "", timeout=None, metadata=None) -> list[pb.SharedMemoryRegion]:
        resp = await self._call(self.stub.ListSharedMemory, pb.ListSharedMemoryRequest(name=name), timeout, metadata)
        return list(resp.regions)
