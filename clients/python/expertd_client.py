"""A small Python client for expertd (gRPC service expertd.v1.ExpertService).

Stubs are generated from proto/expertd/v1/expert.proto with grpcio-tools at
run time (generate_stubs), so nothing generated is committed. Tensors are
numpy arrays:

    from expertd_client import Client, generate_stubs
    generate_stubs("proto", "/tmp/expertd-stubs")
    c = Client("localhost:50051")
    c.load_experts("layer0", "silu_gated", w13_codes, w2_codes, w13_scale, w2_scale)
    out = c.fused_moe(hidden, expert_set="layer0", router_logits=logits, top_k=2)["output"]

FP8 E4M3FN tensors are uint8 arrays of codes; bfloat16 tensors are uint16
arrays of bit patterns, passed with dtype="bfloat16".
"""

import hashlib
import importlib
import os
import sys

import numpy as np

pb = None  # expertd.v1.expert_pb2, set by generate_stubs
pb_grpc = None  # expertd.v1.expert_pb2_grpc

MAX_MESSAGE_BYTES = 1 << 30
CHUNK_BYTES = 2 << 20
# Weight tensors in the order of LoadExpertsRequest.Header.sha256.
TENSOR_FIELDS = ("w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale")


def generate_stubs(proto_root, out_dir):
    """Generates the Python stubs of expert.proto into out_dir and imports them."""
    global pb, pb_grpc
    from grpc_tools import protoc

    import grpc_tools

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    os.makedirs(out_dir, exist_ok=True)
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        os.path.join(proto_root, "expertd", "v1", "expert.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    pb = importlib.import_module("expertd.v1.expert_pb2")
    pb_grpc = importlib.import_module("expertd.v1.expert_pb2_grpc")


def _dtype_enum(dtype):
    return {
        "float32": pb.DATA_TYPE_FLOAT32,
        "bfloat16": pb.DATA_TYPE_BFLOAT16,
        "float8_e4m3fn": pb.DATA_TYPE_FLOAT8_E4M3FN,
        "int32": pb.DATA_TYPE_INT32,
    }[dtype]


def tensor(array, dtype=None, meta_only=False):
    """A Tensor message from a numpy array.

    dtype defaults from the array: float32, int32, uint8 (as FP8 E4M3FN
    codes); uint16 arrays need dtype="bfloat16".
    """
    a = np.ascontiguousarray(array)
    if dtype is None:
        dtype = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32",
                 np.dtype(np.uint8): "float8_e4m3fn"}[a.dtype]
    t = pb.Tensor(dtype=_dtype_enum(dtype), shape=list(a.shape))
    if not meta_only:
        t.data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    return t


def decode(t):
    """A numpy array from a Tensor message (bfloat16 widened to float32)."""
    if t.dtype == pb.DATA_TYPE_FLOAT32:
        a = np.frombuffer(t.data, dtype="<f4")
    elif t.dtype == pb.DATA_TYPE_BFLOAT16:
        a = (np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif t.dtype == pb.DATA_TYPE_INT32:
        a = np.frombuffer(t.data, dtype="<i4")
    else:
        raise ValueError(f"cannot decode dtype {t.dtype}")
    return a.reshape(tuple(t.shape))


def _activation(name):
    return {"silu_gated": pb.ACTIVATION_SILU_GATED, "relu2": pb.ACTIVATION_RELU2}[name]


class Client:
    """A connection to an expertd server."""

    def __init__(self, addr, max_message_bytes=MAX_MESSAGE_BYTES):
        import grpc

        if pb is None:
            raise RuntimeError("call generate_stubs first")
        self.channel = grpc.insecure_channel(addr, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ])
        self.stub = pb_grpc.ExpertServiceStub(self.channel)

    def close(self):
        self.channel.close()

    def server_info(self, timeout=10):
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)

    def list_experts(self, timeout=10):
        return list(self.stub.ListExperts(pb.ListExpertsRequest(), timeout=timeout).expert_sets)

    def unload_experts(self, name, timeout=10):
        return self.stub.UnloadExperts(pb.UnloadExpertsRequest(name=name), timeout=timeout).freed_bytes

    @staticmethod
    def weights(activation, w13, w2, w13_scale, w2_scale, a13_scale=None, a2_scale=None,
                block_shape=None, meta_only=False):
        """An ExpertWeights message; FP8 weights as uint8 codes, scales float32."""
        w = pb.ExpertWeights(activation=_activation(activation))
        for name, a in zip(TENSOR_FIELDS, (w13, w2, w13_scale, w2_scale, a13_scale, a2_scale)):
            if a is not None:
                getattr(w, name).CopyFrom(tensor(a, meta_only=meta_only))
        if block_shape:
            w.weight_block_shape.extend(block_shape)
        return w

    def load_experts(self, name, activation, w13, w2, w13_scale, w2_scale, a13_scale=None,
                     a2_scale=None, block_shape=None, overwrite=False, chunk_bytes=CHUNK_BYTES,
                     progress=None, timeout=600):
        """Uploads a layer in chunks with a SHA-256 the server verifies."""
        arrays = [np.ascontiguousarray(a) if a is not None else None
                  for a in (w13, w2, w13_scale, w2_scale, a13_scale, a2_scale)]
        blobs = [a.tobytes() if a is not None else b"" for a in arrays]
        total = sum(len(b) for b in blobs)
        header = pb.LoadExpertsRequest.Header(
            name=name, weights=self.weights(activation, *arrays, block_shape=block_shape, meta_only=True),
            total_bytes=total, sha256=hashlib.sha256(b"".join(blobs)).hexdigest(), overwrite=overwrite)

        def requests():
            yield pb.LoadExpertsRequest(header=header)
            sent = 0
            for field, blob in zip(TENSOR_FIELDS, blobs):
                for off in range(0, len(blob), chunk_bytes):
                    data = blob[off:off + chunk_bytes]
                    yield pb.LoadExpertsRequest(chunk=pb.LoadExpertsRequest.Chunk(tensor=field, offset=off, data=data))
                    sent += len(data)
                    if progress:
                        progress(sent, total)

        return self.stub.LoadExperts(requests(), timeout=timeout)

    def fused_moe(self, hidden, expert_set=None, weights=None, router_logits=None, top_k=0,
                  renormalize=False, scoring="softmax", topk_ids=None, topk_weights=None,
                  output_dtype="float32", return_routing=False, timeout=60):
        """Runs one MoE layer; returns a dict with output (numpy) and the response."""
        req = pb.FusedMoERequest(
            hidden_states=tensor(hidden),
            output_dtype=_dtype_enum(output_dtype),
            return_routing=return_routing,
        )
        if expert_set is not None:
            req.expert_set = expert_set
        else:
            req.weights.CopyFrom(weights)
        if topk_ids is not None:
            req.topk_ids.CopyFrom(tensor(np.asarray(topk_ids, dtype=np.int32)))
            req.topk_weights.CopyFrom(tensor(np.asarray(topk_weights, dtype=np.float32)))
        else:
            req.router_logits.CopyFrom(tensor(router_logits))
            req.routing.CopyFrom(pb.Routing(
                top_k=top_k, renormalize=renormalize,
                scoring={"softmax": pb.SCORING_SOFTMAX, "sigmoid": pb.SCORING_SIGMOID}[scoring]))
        resp = self.stub.FusedMoE(req, timeout=timeout)
        out = {"output": decode(resp.output), "response": resp}
        if return_routing:
            out["topk_ids"] = decode(resp.topk_ids)
            out["topk_weights"] = decode(resp.topk_weights)
        return out
