"""Python client for expertd, a gRPC service that runs Mixture-of-Experts
layers (service expertd.v1.ExpertService).

    import expertd
    with expertd.Client("localhost:50051") as c:
        c.load_experts("layer0", w13, w2, w13_scale=s13, w2_scale=s2)
        out = c.fused_moe(hidden, expert_set="layer0", router_logits=logits, top_k=2).output

expertd.aio.Client is the asyncio twin; expertd.SharedMemory and
Client.register_shared_memory / register_cuda_tensor keep tensors out of
messages for callers on the daemon's host; expertd.torch.RemoteMoE serves a
Hugging Face MoE block. The generated stubs are expertd.v1.expert_pb2 and
expertd.v1.expert_pb2_grpc.
"""

from expertd import aio, errors, tensors
from expertd._common import (FusedMoEResult, expert_weights, fused_moe_request, is_loopback_target,
                             routing, safetensors_source)
from expertd.client import Client
from expertd.errors import *  # noqa: F401,F403 - the typed errors
from expertd.errors import ExpertdError
from expertd.shm import CudaRegion, Region, SharedMemory, cuda_ipc_handle
from expertd.v1 import expert_pb2 as pb

__version__ = "0.1.0"

__all__ = ["Client", "ExpertdError", "FusedMoEResult", "SharedMemory", "Region", "CudaRegion",
           "cuda_ipc_handle", "expert_weights", "fused_moe_request", "routing", "safetensors_source",
           "is_loopback_target", "aio", "errors", "tensors", "pb"] + [n for n in dir(errors) if n.endswith("Error")]
