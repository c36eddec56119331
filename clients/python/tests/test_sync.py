"""The sync client against a real daemon."""

import grpc
import numpy as np
import pytest

import expertd
from moeref import rel_l2


def test_server_info(client):
    info = client.server_info()
    assert info.version and info.backends and info.limits.max_message_bytes > 0


def test_load_run_list_unload(client, loaded):
    name, layer = loaded
    sets = {s.name: s for s in client.list_experts()}
    assert sets[name].num_experts == layer.e and sets[name].hidden_size == layer.k
    res = client.fused_moe(layer.hidden, expert_set=name, output_dtype="float32", return_routing=True,
                           **layer.call_args())
    assert res.output.shape == (layer.m, layer.k) and res.output.dtype == np.float32
    assert rel_l2(res.output, layer.ref) <= 2e-2, rel_l2(res.output, layer.ref)
    assert res.topk_ids.shape == (layer.m, layer.top_k) and res.backend
    # BF16 output (the default) widened to float32.
    bf = client.fused_moe(layer.hidden, expert_set=name, **layer.call_args())
    assert bf.output.dtype == np.float32 and rel_l2(bf.output, layer.ref) <= 2e-2
    # The same weights inline.
    w = expertd.expert_weights(*layer.weights())
    inline = client.fused_moe(layer.hidden, weights=w, output_dtype="float32", **layer.call_args())
    np.testing.assert_array_equal(inline.output, res.output)


def test_precomputed_routing(client, loaded):
    name, layer = loaded
    res = client.fused_moe(layer.hidden, expert_set=name, output_dtype="float32", return_routing=True,
                           **layer.call_args())
    again = client.fused_moe(layer.hidden, expert_set=name, output_dtype="float32",
                             topk_ids=res.topk_ids, topk_weights=res.topk_weights)
    np.testing.assert_array_equal(again.output, res.output)


def test_progress_and_fingerprint(client, layer):
    import hashlib

    seen = []
    info = client.load_experts("pytest-progress", *layer.weights(), chunk_bytes=1000, overwrite=True,
                               progress=lambda sent, total: seen.append((sent, total)))
    try:
        blobs = b"".join(a.tobytes() for a in layer.weights())
        assert info.fingerprint == hashlib.sha256(blobs).hexdigest() and info.bytes == len(blobs)
        assert len(seen) >= len(blobs) // 1000 and seen[-1] == (len(blobs), len(blobs))
    finally:
        assert client.unload_experts("pytest-progress") == info.bytes


def test_typed_errors(client, loaded):
    name, layer = loaded
    with pytest.raises(expertd.NotFoundError) as e:
        client.fused_moe(layer.hidden, expert_set="no-such-set", **layer.call_args())
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-set" in e.value.message
    with pytest.raises(expertd.InvalidArgumentError) as e:
        client.fused_moe(layer.hidden[:, :-1], expert_set=name, **layer.call_args())
    assert "hidden_states" in e.value.message
    assert [f for f, _ in e.value.field_violations] in ([], ["hidden_states"])
    with pytest.raises(expertd.AlreadyExistsError):
        client.load_experts(name, *layer.weights())
    with pytest.raises(expertd.InvalidArgumentError):
        client.fused_moe(layer.hidden, expert_set=name, router_logits=layer.logits, top_k=layer.e + 1)


def test_safetensors_source_without_weights_dir(client):
    with pytest.raises(expertd.ExpertdError) as e:
        client.load_safetensors("pytest-st", "model.safetensors", 0, "qwen3_moe")
    assert e.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)


def test_torch_tensors(client, loaded):
    torch = pytest.importorskip("torch")
    name, layer = loaded
    hb = torch.from_numpy(layer.hidden).to(torch.bfloat16)
    res = client.fused_moe(hb, expert_set=name, router_logits=torch.from_numpy(layer.logits), top_k=layer.top_k,
                           renormalize=True)
    assert isinstance(res.output, torch.Tensor) and res.output.dtype == torch.bfloat16
    assert rel_l2(res.output.float().numpy(), layer.ref_of(hb.float().numpy())) <= 2e-2
    if hasattr(torch, "float8_e4m3fn"):
        w13 = torch.from_numpy(layer.w13).view(torch.float8_e4m3fn)
        w2 = torch.from_numpy(layer.w2).view(torch.float8_e4m3fn)
        client.load_experts("pytest-torch", w13, w2, torch.from_numpy(layer.s13), torch.from_numpy(layer.s2),
                            overwrite=True)
        try:
            got = client.fused_moe(layer.hidden, expert_set="pytest-torch", output_dtype="float32",
                                   **layer.call_args())
            assert rel_l2(got.output, layer.ref) <= 2e-2
        finally:
            client.unload_experts("pytest-torch")
