"""Tests that need no daemon: encodings, target checks, error decoding."""

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

import expertd
from expertd import tensors
from expertd.errors import from_rpc_error
from expertd.v1 import expert_pb2 as pb
from moeref import fp8_decode, fp8_encode


@pytest.mark.parametrize("target,want", [
    ("localhost:50051", True), ("127.0.0.1:1", True), ("127.9.9.9:1", True), ("[::1]:50051", True),
    ("unix:/run/expertd.sock", True), ("dns:///localhost:443", True), ("ipv4:127.0.0.1:5", True),
    ("expertd.internal:50051", False), ("10.0.0.1:50051", False), ("localhost", False),
    ("dns:///expertd:443", False), ("[::2]:1", False), ("localhost.evil.com:1", False),
])
def test_loopback_target(target, want):
    assert expertd.is_loopback_target(target) is want


def test_token_refused_in_plaintext_to_remote():
    with pytest.raises(ValueError, match="plaintext"):
        expertd.Client("expertd.internal:50051", token="0123456789abcdef")
    with pytest.raises(ValueError, match="single-line"):
        expertd.Client("localhost:1", token="abc\ndef")
    # Loopback and TLS targets accept it.
    expertd.Client("localhost:1", token="0123456789abcdef").close()
    expertd.Client("expertd.internal:50051", tls=True, token="0123456789abcdef").close()


def test_mtls_needs_both_halves():
    with pytest.raises(ValueError, match="both"):
        expertd.Client("localhost:1", certificate_chain=b"x")


def test_encode_dtypes():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    t = tensors.encode(a)
    assert (t.dtype, list(t.shape), len(t.data)) == (expertd.pb.DATA_TYPE_FLOAT32, [2, 3], 24)
    assert tensors.encode(np.zeros((4,), np.uint8)).dtype == expertd.pb.DATA_TYPE_FLOAT8_E4M3FN
    bf = tensors.encode(np.zeros((3,), np.uint16), "bfloat16")
    assert (bf.dtype, len(bf.data)) == (expertd.pb.DATA_TYPE_BFLOAT16, 6)
    with pytest.raises(ValueError, match="bfloat16"):
        tensors.encode(np.zeros(3, np.uint16))
    with pytest.raises(ValueError):
        tensors.encode(np.zeros(3, np.float32), "bfloat16")


def test_bf16_round_trip():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], np.float32)
    got = tensors.bf16_to_f32(tensors.f32_to_bf16(x))
    np.testing.assert_allclose(got, x, rtol=2 ** -8)
    t = expertd.pb.Tensor(dtype=expertd.pb.DATA_TYPE_BFLOAT16, shape=[5], data=tensors.f32_to_bf16(x).tobytes())
    np.testing.assert_array_equal(tensors.decode(t), got)
    np.testing.assert_array_equal(tensors.decode(t, widen=False), tensors.f32_to_bf16(x))


def test_fp8_reference_codec():
    codes = np.arange(256, dtype=np.uint8)
    vals = fp8_decode(codes)
    ok = ~np.isnan(vals)
    # Every finite code encodes back to itself, except -0 which is 0.
    back = fp8_encode(vals[ok])
    assert np.array_equal(fp8_decode(back), vals[ok])
    assert fp8_decode(fp8_encode([1000.0]))[0] == 448.0
    # Midpoints round to the even code, in both directions and both signs:
    # 1.0625 lies between 1.0 (0x38) and 1.125 (0x39), 1.1875 between
    # 1.125 and 1.25 (0x3A); 0.5 * 2^-9 between 0 and the least subnormal.
    assert list(fp8_encode([1.0625, 1.1875, -1.0625, -1.1875, 2.0 ** -10, 2.0 ** -10 * 3])) == \
        [0x38, 0x3A, 0xB8, 0xBA, 0x00, 0x02]


class _FakeError(grpc.RpcError):
    def __init__(self, code, msg, trailers):
        self._c, self._m, self._t = code, msg, trailers

    def code(self):
        return self._c

    def details(self):
        return self._m

    def trailing_metadata(self):
        return self._t


def test_error_details_decoded():
    st = status_pb2.Status(code=3, message="hidden_states: bad")
    br = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field="hidden_states", description="bad")])
    st.details.add().Pack(br)
    st.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=250_000_000)))
    e = from_rpc_error(_FakeError(grpc.StatusCode.INVALID_ARGUMENT, "hidden_states: bad",
                                  (("grpc-status-details-bin", st.SerializeToString()),)))
    assert isinstance(e, expertd.InvalidArgumentError) and isinstance(e, expertd.ExpertdError)
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.message == "hidden_states: bad"
    assert e.field_violations == [("hidden_states", "bad")]
    assert e.retry_delay == 0.25
    plain = from_rpc_error(_FakeError(grpc.StatusCode.UNAVAILABLE, "draining", None))
    assert isinstance(plain, expertd.UnavailableError) and plain.details == [] and plain.retry_delay is None


def test_load_requests_chunks_and_digest():
    import hashlib

    w13 = np.arange(100, dtype=np.uint8).reshape(1, 10, 10)
    w2 = np.arange(50, dtype=np.uint8).reshape(1, 10, 5)
    s = np.ones(1, np.float32)
    seen = []
    msgs = list(expertd._common.load_requests("x", w13, w2, s, s, chunk_bytes=30,
                                              progress=lambda a, b: seen.append((a, b))))
    hdr = msgs[0].header
    assert hdr.total_bytes == 158 and hdr.sha256 == hashlib.sha256(
        w13.tobytes() + w2.tobytes() + s.tobytes() + s.tobytes()).hexdigest()
    chunks = [m.chunk for m in msgs[1:]]
    assert [c.tensor for c in chunks] == ["w13"] * 4 + ["w2"] * 2 + ["w13_scale", "w2_scale"]
    assert b"".join(c.data for c in chunks if c.tensor == "w13") == w13.tobytes()
    assert seen[-1] == (158, 158)


def test_safetensors_source_weight_quantization():
    src = expertd.safetensors_source("x", "ck", weight_quantization="block").safetensors
    assert src.weight_quantization == pb.WEIGHT_QUANTIZATION_BLOCK
    src = expertd.safetensors_source("x", "ck", weight_quantization=pb.WEIGHT_QUANTIZATION_PER_TENSOR).safetensors
    assert src.weight_quantization == pb.WEIGHT_QUANTIZATION_PER_TENSOR
    assert expertd.safetensors_source("x", "ck").safetensors.weight_quantization == 0
    with pytest.raises(ValueError, match="weight_quantization 'fp8'"):
        expertd.safetensors_source("x", "ck", weight_quantization="fp8")


def test_load_requests_biases_and_swiglu():
    """Biases go last in the digest's field order, each in its own dtype
    (a torch bfloat16 bias stays BF16), with SwiGLU's parameters on the
    header; activation names map to their enum values."""
    import hashlib

    torch = pytest.importorskip("torch")
    w13 = np.zeros((2, 8, 4), np.uint8)
    w2 = np.zeros((2, 4, 4), np.uint8)
    s = np.ones(1, np.float32)
    b13 = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    b2 = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    msgs = list(expertd._common.load_requests("x", w13, w2, s, s, activation="swiglu_oai",
                                              w13_bias=b13, w2_bias=b2, swiglu_limit=5.0))
    hdr = msgs[0].header
    w = hdr.weights
    pb = expertd.v1.expert_pb2
    assert w.activation == pb.ACTIVATION_SWIGLU_OAI
    assert w.swiglu_limit == 5.0 and w.swiglu_alpha == 0.0
    assert list(w.w13_bias.shape) == [2, 8] and w.w13_bias.dtype == pb.DATA_TYPE_FLOAT32
    assert list(w.w2_bias.shape) == [2, 4] and w.w2_bias.dtype == pb.DATA_TYPE_BFLOAT16
    b2_bytes = b2.view(torch.int16).numpy().tobytes()
    assert hdr.sha256 == hashlib.sha256(w13.tobytes() + w2.tobytes() + s.tobytes() + s.tobytes()
                                        + b13.tobytes() + b2_bytes).hexdigest()
    assert [m.chunk.tensor for m in msgs[1:]][-2:] == ["w13_bias", "w2_bias"]
    for name, value in (("gelu_tanh_gated", pb.ACTIVATION_GELU_TANH_GATED), ("gelu_gated", pb.ACTIVATION_GELU_GATED)):
        ew = expertd._common.expert_weights(w13, w2, s, s, activation=name, w2_bias=b13[:, :4])
        assert ew.activation == value and list(ew.w2_bias.shape) == [2, 4]
