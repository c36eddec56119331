"""POSIX shared memory (needs a daemon started with -shared-memory:
EXPERTD_SHM=1)."""

import os

import numpy as np
import pytest

import expertd
from moeref import rel_l2

pytestmark = pytest.mark.skipif(os.environ.get("EXPERTD_SHM") != "1",
                                reason="EXPERTD_SHM=1 says the daemon serves shared memory")


def test_shm_inputs_and_output_in_place(client, loaded):
    name, layer = loaded
    with expertd.SharedMemory.create(1 << 20) as shm:
        region = client.register_shared_memory("pytest-acts", shm)
        shm.unlink()
        assert [r.name for r in client.list_shared_memory()] == ["pytest-acts"]
        hidden = region.put(0, layer.hidden)
        logits = region.put(64 << 10, layer.logits)
        assert hidden.WhichOneof("source") == "shm"
        out_off, out_n = 128 << 10, layer.m * layer.k * 4
        res = client.fused_moe(hidden, expert_set=name, router_logits=logits, top_k=layer.top_k,
                               renormalize=True, output_dtype="float32", output_shm=region.ref(out_off, out_n))
        assert res.response.output.WhichOneof("source") == "shm" and not res.response.output.data
        assert rel_l2(res.output, layer.ref) <= 2e-2
        # The output is a view of the region: a second call rewrites it.
        region.array("float32", (layer.m, layer.k), out_off)[:] = np.nan
        assert np.isnan(res.output).all()
        again = client.fused_moe(hidden, expert_set=name, router_logits=logits, top_k=layer.top_k,
                                 renormalize=True, output_dtype="float32", output_shm=region.ref(out_off, out_n))
        assert np.array_equal(res.output, again.output) and not np.isnan(res.output).any()
        # BF16 output in place, read as bit patterns.
        bf = client.fused_moe(hidden, expert_set=name, router_logits=logits, top_k=layer.top_k, renormalize=True,
                              output_shm=region.ref(out_off, out_n // 2))
        assert rel_l2(bf.output, layer.ref) <= 2e-2
        del res, again, bf
        assert client.unregister_shared_memory() == ["pytest-acts"]
        with pytest.raises(expertd.NotFoundError, match="pytest-acts"):
            client.fused_moe(hidden, expert_set=name, router_logits=layer.logits, top_k=layer.top_k)


def test_shm_errors(client, loaded):
    name, layer = loaded
    with expertd.SharedMemory.create(4096) as shm:
        region = client.register_shared_memory("pytest-small", shm)
        with pytest.raises(ValueError, match="do not fit"):
            region.put(4000, layer.hidden)
        with pytest.raises(expertd.AlreadyExistsError):
            client.register_shared_memory("pytest-small", shm)
        with pytest.raises(expertd.ExpertdError) as e:
            client.register_shared_memory("pytest-big", shm, 0, 1 << 20)
        assert "byte_size" in e.value.message or "size" in e.value.message
        client.unregister_shared_memory("pytest-small")
    with pytest.raises(expertd.ExpertdError):
        client.register_shared_memory("pytest-gone", shm)


def test_shm_torch(client, loaded):
    torch = pytest.importorskip("torch")
    name, layer = loaded
    with expertd.SharedMemory.create(1 << 20) as shm:
        region = client.register_shared_memory("pytest-torch-acts", shm)
        h = torch.from_numpy(layer.hidden).to(torch.bfloat16)
        res = client.fused_moe(region.put(0, h), expert_set=name, router_logits=layer.logits,
                               top_k=layer.top_k, renormalize=True, like="torch",
                               output_shm=region.ref(64 << 10, layer.m * layer.k * 2))
        assert isinstance(res.output, torch.Tensor) and res.output.dtype == torch.bfloat16
        got = res.output.float().numpy()
        del res  # the output views the mapping, which closes at the end of the block
        assert rel_l2(got, layer.ref_of(h.float().numpy())) <= 2e-2
        client.unregister_shared_memory()
