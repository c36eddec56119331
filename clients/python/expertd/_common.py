"""What the sync and asyncio clients share: channel credentials, request
building, LoadExperts chunking and result decoding."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field
from typing import Any, Iterator

import grpc
import numpy as np

from expertd import tensors
from expertd.v1 import expert_pb2 as pb

MAX_MESSAGE_BYTES = 1 << 30
CHUNK_BYTES = 2 << 20
# Weight tensors in the order of LoadExpertsRequest.Header.sha256.
WEIGHT_FIELDS = ("w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale", "w13_bias", "w2_bias")
# The wire dtype each weight field is sent as; None keeps the array's own
# (FP8 codes for the weights; FP32 or BF16 for the biases).
_FIELD_DTYPES = {"w13": None, "w2": None, "w13_bias": None, "w2_bias": None}

ACTIVATIONS = {"silu_gated": pb.ACTIVATION_SILU_GATED, "relu2": pb.ACTIVATION_RELU2,
               "swiglu_oai": pb.ACTIVATION_SWIGLU_OAI, "gelu_tanh_gated": pb.ACTIVATION_GELU_TANH_GATED,
               "gelu_gated": pb.ACTIVATION_GELU_GATED}
SCORINGS = {"softmax": pb.SCORING_SOFTMAX, "sigmoid": pb.SCORING_SIGMOID}
PRESETS = {"nemotron_h": pb.NAMING_PRESET_NEMOTRON_H, "qwen3_moe": pb.NAMING_PRESET_QWEN3_MOE,
           "custom": pb.NAMING_PRESET_CUSTOM}
# SafetensorsSource.weight_quantization: how BF16/F16 checkpoints become FP8.
WEIGHT_QUANTIZATIONS = {"per_tensor": pb.WEIGHT_QUANTIZATION_PER_TENSOR,
                        "per_channel": pb.WEIGHT_QUANTIZATION_PER_CHANNEL,
                        "block": pb.WEIGHT_QUANTIZATION_BLOCK}


def _enum(table: dict, value, what: str) -> int:
    if isinstance(value, int):
        return value
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"{what} {value!r}: want one of {sorted(table)}") from None


def is_loopback_target(target: str) -> bool:
    """Whether a gRPC target stays on this host: a unix socket, or
    host:port whose host is localhost or a loopback IP. Anything else (a
    DNS name, a resolver scheme) counts as remote, as in the Go SDK."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("passthrough:///", "dns:///", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return False
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(x: bytes | str | None) -> bytes | None:
    if x is None or isinstance(x, bytes):
        return x
    with open(x, "rb") as f:
        return f.read()


@dataclass
class ChannelConfig:
    """How to reach a daemon; see Client for the arguments."""

    target: str
    tls: bool = False
    root_certificates: bytes | str | None = None
    certificate_chain: bytes | str | None = None
    private_key: bytes | str | None = None
    server_name: str | None = None
    token: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    options: list = field(default_factory=list)

    def __post_init__(self):
        if self.root_certificates or self.certificate_chain or self.private_key:
            self.tls = True
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key: give both (mutual TLS) or neither")
        if self.token is not None:
            if not self.token or any(c in self.token for c in "\r\n"):
                raise ValueError("token: want a non-empty single-line bearer token")
            if not self.tls and not is_loopback_target(self.target):
                raise ValueError(f"token: refusing to send a bearer token in plaintext to {self.target!r}, "
                                 "which is not a loopback address; enable TLS (tls=True or root_certificates=)")

    def channel_args(self) -> tuple[list, grpc.ChannelCredentials | None]:
        opts = [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        opts += list(self.options)
        if not self.tls:
            return opts, None
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_certificates),
            private_key=_read(self.private_key),
            certificate_chain=_read(self.certificate_chain))
        return opts, creds

    def metadata(self, extra=None) -> list | None:
        md = list(extra or ())
        if self.token is not None:
            md.append(("authorization", "Bearer " + self.token))
        return md or None


def routing(top_k=0, renormalize=False, scoring="softmax", correction_bias=None,
            num_expert_groups=0, topk_groups=0, routed_scaling_factor=0.0) -> pb.Routing:
    """A Routing message (routed_scaling_factor 0 means 1)."""
    r = pb.Routing(top_k=top_k, renormalize=renormalize, scoring=_enum(SCORINGS, scoring, "scoring"),
                   num_expert_groups=num_expert_groups, topk_groups=topk_groups,
                   routed_scaling_factor=routed_scaling_factor)
    if correction_bias is not None:
        r.correction_bias.CopyFrom(tensors.encode(correction_bias, "float32"))
    return r


def _weights_header(activation, block_shape, swiglu_limit, swiglu_alpha) -> pb.ExpertWeights:
    w = pb.ExpertWeights(activation=_enum(ACTIVATIONS, activation, "activation"),
                         swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    if block_shape:
        w.weight_block_shape.extend(block_shape)
    return w


def expert_weights(w13, w2, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
                   activation="silu_gated", block_shape=None, *, w13_bias=None, w2_bias=None,
                   swiglu_limit=0.0, swiglu_alpha=0.0) -> pb.ExpertWeights:
    """An ExpertWeights message with the tensors inline (for FusedMoE's
    weights oneof). FP8 weights as uint8 codes or torch float8 tensors;
    the optional biases w13_bias [E, 2N or N] and w2_bias [E, K] as FP32 or
    BF16. swiglu_limit and swiglu_alpha (0: gpt-oss's 7 and 1.702) are
    activation "swiglu_oai"'s."""
    w = _weights_header(activation, block_shape, swiglu_limit, swiglu_alpha)
    for name, a in zip(WEIGHT_FIELDS, (w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, w13_bias, w2_bias)):
        if a is not None:
            getattr(w, name).CopyFrom(tensors.encode(a, _FIELD_DTYPES.get(name, "float32")))
    return w


def _tensor_arg(x, dtype=None) -> pb.Tensor:
    """An input tensor: a Tensor message (e.g. a shared-memory reference
    from Region.put) as is, else x's bytes inline."""
    return tensors.encode(x, dtype)


def fused_moe_request(hidden, expert_set=None, weights=None, router_logits=None, top_k=0,
                      renormalize=False, scoring="softmax", correction_bias=None,
                      num_expert_groups=0, topk_groups=0, routed_scaling_factor=0.0,
                      topk_ids=None, topk_weights=None, hidden_scale=None,
                      output_dtype="bfloat16", return_routing=False, output_shm=None,
                      routing_message=None) -> pb.FusedMoERequest:
    """A FusedMoERequest. hidden, router_logits, topk_ids, topk_weights and
    hidden_scale are numpy arrays, CPU torch tensors or Tensor messages
    (shared-memory references from Region.put / CudaRegion.tensor);
    output_shm is a SharedMemoryRef (Region.ref). routing_message, a Routing
    message such as the ExpertSetInfo.routing of a set loaded from a
    checkpoint, replaces the routing arguments."""
    if (expert_set is None) == (weights is None):
        raise ValueError("give exactly one of expert_set and weights")
    req = pb.FusedMoERequest(hidden_states=_tensor_arg(hidden),
                             output_dtype=tensors.dtype_enum(output_dtype),
                             return_routing=return_routing)
    if expert_set is not None:
        req.expert_set = expert_set
    else:
        req.weights.CopyFrom(weights)
    if hidden_scale is not None:
        req.hidden_states_scale.CopyFrom(_tensor_arg(hidden_scale, "float32"))
    if topk_ids is not None or topk_weights is not None:
        if topk_ids is None or topk_weights is None:
            raise ValueError("topk_ids and topk_weights: give both or neither")
        req.topk_ids.CopyFrom(_tensor_arg(topk_ids, "int32"))
        req.topk_weights.CopyFrom(_tensor_arg(topk_weights, "float32"))
    if router_logits is not None:
        req.router_logits.CopyFrom(_tensor_arg(router_logits))
    if routing_message is not None:
        req.routing.CopyFrom(routing_message)
    elif router_logits is not None or top_k:
        req.routing.CopyFrom(routing(top_k, renormalize, scoring, correction_bias,
                                     num_expert_groups, topk_groups, routed_scaling_factor))
    if output_shm is not None:
        req.output_shm.CopyFrom(output_shm)
    return req


def load_requests(name: str, w13, w2, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
                  activation="silu_gated", block_shape=None, overwrite=False,
                  chunk_bytes=CHUNK_BYTES, progress=None, *, w13_bias=None, w2_bias=None,
                  swiglu_limit=0.0, swiglu_alpha=0.0) -> Iterator[pb.LoadExpertsRequest]:
    """The LoadExperts stream of an upload: a header with the tensors'
    dtypes, shapes and SHA-256, then chunks of at most chunk_bytes cut from
    the arrays without copying them whole. progress(sent, total) is called
    after each chunk. The biases and SwiGLU parameters are as in
    expert_weights."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes {chunk_bytes}: want >= 1")
    w = _weights_header(activation, block_shape, swiglu_limit, swiglu_alpha)
    blobs = []
    digest = hashlib.sha256()
    for fname, a in zip(WEIGHT_FIELDS, (w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, w13_bias, w2_bias)):
        if a is None:
            continue
        meta, raw = tensors.describe(a, _FIELD_DTYPES.get(fname, "float32"))
        getattr(w, fname).CopyFrom(meta)
        digest.update(memoryview(raw))
        blobs.append((fname, raw))
    total = sum(raw.nbytes for _, raw in blobs)
    yield pb.LoadExpertsRequest(header=pb.LoadExpertsRequest.Header(
        name=name, weights=w, total_bytes=total, sha256=digest.hexdigest(), overwrite=overwrite))
    sent = 0
    for fname, raw in blobs:
        view = memoryview(raw)
        for off in range(0, raw.nbytes, chunk_bytes):
            data = view[off:off + chunk_bytes]
            yield pb.LoadExpertsRequest(chunk=pb.LoadExpertsRequest.Chunk(
                tensor=fname, offset=off, data=bytes(data)))
            sent += len(data)
            if progress:
                progress(sent, total)


def safetensors_source(name: str, path: str, layer: int = 0, preset="qwen3_moe", overwrite=False,
                       num_experts: int = 0, weight_block_shape=None, **fields) -> pb.LoadExpertsRequest:
    """A LoadExperts message reading a layer from the server's weights
    directory. preset is a NamingPreset name (lowercase, without the
    NAMING_PRESET_ prefix) or value; fields are further SafetensorsSource
    fields (e.g. w13_template=... with preset="custom";
    weight_quantization="per_tensor", "per_channel" or "block" for a BF16
    or F16 checkpoint)."""
    if isinstance(preset, str):
        key = preset.lower()
        value = getattr(pb, "NAMING_PRESET_" + key.upper(), None)
        if value is None:
            raise ValueError(f"preset {preset!r}: want a NamingPreset name such as 'qwen3_moe'")
        preset = value
    if "activation" in fields:
        fields["activation"] = _enum(ACTIVATIONS, fields["activation"], "activation")
    if "weight_quantization" in fields:
        fields["weight_quantization"] = _enum(WEIGHT_QUANTIZATIONS, fields["weight_quantization"],
                                              "weight_quantization")
    src = pb.LoadExpertsRequest.SafetensorsSource(
        name=name, path=path, layer=layer, preset=preset, overwrite=overwrite,
        num_experts=num_experts, weight_block_shape=list(weight_block_shape or ()), **fields)
    return pb.LoadExpertsRequest(safetensors=src)


@dataclass
class FusedMoEResult:
    """One FusedMoE answer.

    output is the [M, K] output: a numpy array (BF16 widened to float32
    unless the client was made with widen_bf16=False) or, when the call's
    hidden states were a torch tensor, a torch tensor of the wire dtype. An
    output written to shared memory (output_shm) is read in place from the
    region (a CUDA IPC output is the registered torch tensor's memory).
    """

    output: Any
    topk_ids: Any
    topk_weights: Any
    response: pb.FusedMoEResponse

    @property
    def timings(self) -> pb.Timings:
        return self.response.timings

    @property
    def backend(self) -> str:
        return self.response.backend


def result(resp: pb.FusedMoEResponse, like: str, widen: bool, regions) -> FusedMoEResult:
    """Decodes a response; shm outputs are viewed in their region."""
    out = resp.output
    if out.WhichOneof("source") == "shm":
        region = regions.get(out.shm.region_name)
        if region is None:
            raise ValueError(f"output is in region {out.shm.region_name!r}, which this client did not register")
        output = region.read(out.shm.offset, out.dtype, out.shape, like=like, widen=widen)
    else:
        output = tensors.decode(out, like=like, widen=widen)
    ids = tensors.decode(resp.topk_ids, like=like) if resp.HasField("topk_ids") else None
    wts = tensors.decode(resp.topk_weights, like=like) if resp.HasField("topk_weights") else None
    return FusedMoEResult(output, ids, wts, resp)


def like_of(x, like=None) -> str:
    """Whether results come back as torch or numpy: like when given, else
    torch exactly when the call's hidden states x are a torch tensor."""
    if like is not None:
        if like not in ("numpy", "torch"):
            raise ValueError(f"like {like!r}: want 'numpy' or 'torch'")
        return like
    return "torch" if tensors.is_torch(x) else "numpy"


def array_nbytes(a) -> int:
    if tensors.is_torch(a):
        return a.numel() * a.element_size()
    return np.asarray(a).nbytes
