"""CUDA IPC regions: hidden states, logits and the output stay in this
process's GPU memory. Needs torch with CUDA and a daemon on the same GPU
running the cuda backend with -shared-memory (EXPERTD_CUDA=1)."""

import os

import pytest

import expertd
from moeref import rel_l2

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    os.environ.get("EXPERTD_CUDA") != "1" or not torch.cuda.is_available(),
    reason="needs a GPU, torch with CUDA and a cuda-backend daemon (EXPERTD_CUDA=1)")


def test_cuda_ipc_round_trip(client, loaded):
    name, layer = loaded
    dev = torch.device("cuda")
    # One allocation holding inputs and output; views of it are sent.
    arena = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    region = client.register_cuda_tensor("pytest-gpu", arena)
    m, k, e = layer.m, layer.k, layer.e
    hidden = arena[:m * k * 2].view(torch.bfloat16).view(m, k)
    logits = arena[64 << 10:(64 << 10) + m * e * 4].view(torch.float32).view(m, e)
    out = arena[128 << 10:(128 << 10) + m * k * 2].view(torch.bfloat16).view(m, k)
    hidden.copy_(torch.from_numpy(layer.hidden).to(torch.bfloat16))
    logits.copy_(torch.from_numpy(layer.logits))
    out.fill_(float("nan"))
    torch.cuda.current_stream().synchronize()
    res = client.fused_moe(region.tensor(hidden), expert_set=name, router_logits=region.tensor(logits),
                           top_k=layer.top_k, renormalize=True, output_shm=region.ref(out), like="torch")
    assert res.output.device.type == "cuda" and res.output.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    assert rel_l2(out.float().cpu().numpy(), layer.ref_of(hidden.float().cpu().numpy())) <= 2e-2
    client.unregister_shared_memory("pytest-gpu")


def test_cuda_ipc_rejects_foreign_views(client):
    a = torch.empty(1024, device="cuda")
    b = torch.empty(1024, device="cuda")
    region = client.register_cuda_tensor("pytest-gpu-a", a)
    with pytest.raises(ValueError, match="not a view"):
        region.tensor(b)
    with pytest.raises(ValueError, match="contiguous"):
        region.tensor(a.view(32, 32).t())
    client.unregister_shared_memory("pytest-gpu-a")


def test_cuda_tensor_needs_device():
    with pytest.raises(ValueError, match="CUDA"):
        expertd.cuda_ipc_handle(torch.empty(4))
