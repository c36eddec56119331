"""ctypes mirror of kernels/cuda/csrc/expertd_cuda.h, for the device benchmark.

Only what the benchmarks need: version check, init, expert-set create/free,
the device-pointer entry point expertd_moe_device and (ABI 4 on) the
synchronous host entry point expertd_moe, which bench/host_trace.py times
against it.
The constants below must equal the header's #defines. Five ABI versions load: v1; v2, whose
expertd_set_create also takes the weight block shape (block_n, block_k; 0, 0:
no block mode); v3, whose expertd_init also takes the streams per set
(the benchmark's device-pointer calls use none of them: 1); and v4, whose
expertd_init takes a struct expertd_options and whose expertd_moe_device takes
a struct expertd_call (Options and Call below mirror them; the library checks
their size and version fields); and v5, which adds the gated activations
(SWIGLU_OAI among them) and whose expertd_set_create takes a struct
expertd_set_params (SetParams below) with per-expert biases and SWIGLU_OAI's
limit and alpha. A v1 library refuses block-scaled layers here
with EXPERTD_ERR_UNSUPPORTED, before any call, and one older than v5 layers
with biases or SWIGLU_OAI. Every
call's return code is checked; a failure raises ExpertdError with
expertd_last_error().
"""

from __future__ import annotations

import ctypes
import os

import torch

# The ABI versions this mirror speaks; the newest is the header's.
ABI_VERSIONS = (1, 2, 3, 4, 5)
ABI_VERSION = max(ABI_VERSIONS)

OK = 0
ERR_UNSUPPORTED = 2
_CODES = {1: "INVALID", 2: "UNSUPPORTED", 3: "OOM", 4: "CUDA", 5: "NO_DEVICE", 6: "NOT_FOUND"}

DTYPE_FLOAT32 = 1
DTYPE_BFLOAT16 = 2
DTYPE_FLOAT8_E4M3FN = 4

ACT_SILU_GATED = 1
ACT_RELU2 = 2
ACT_SWIGLU_OAI = 3
ACT_GELU_TANH_GATED = 4
ACT_GELU_GATED = 5
# bench.peer.MoEShape.activation to the header's value.
_ACTIVATIONS = {"silu_gated": ACT_SILU_GATED, "relu2": ACT_RELU2, "swiglu_oai": ACT_SWIGLU_OAI}
SCORING_SOFTMAX = 1
SCORING_SIGMOID = 2

MEM_UNKNOWN = 0
MEM_PAGEABLE = 1
MEM_PINNED = 2
MEM_DEVICE = 3

GEMM_AUTO = 0
GEMM_PORTABLE = 1
GEMM_PORTABLE_F16 = 2
GEMM_SM90 = 3

P_M = 0
P_HIDDEN_DTYPE = 1
P_N_HIDDEN_SCALE = 2
P_LOGITS_DTYPE = 3
P_OUT_DTYPE = 4
P_TOP_K = 5
P_RENORMALIZE = 6
P_SCORING = 7
P_NUM_GROUPS = 8
P_TOPK_GROUPS = 9
P_GEMM = 10
P_USE_GRAPH = 11
NUM_IPARAMS = 12

F_SCALING_FACTOR = 0
NUM_FPARAMS = 1

_DTYPES = {
    torch.float32: DTYPE_FLOAT32,
    torch.bfloat16: DTYPE_BFLOAT16,
    torch.float8_e4m3fn: DTYPE_FLOAT8_E4M3FN,
}

DEFAULT_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build",
                           "libexpertd_cuda.so")


class ExpertdError(RuntimeError):
    """A libexpertd_cuda call returned a code other than EXPERTD_OK."""

    def __init__(self, func: str, code: int, msg: str):
        super().__init__(f"{func}: EXPERTD_ERR_{_CODES.get(code, code)}: {msg}")
        self.code = code


_p = ctypes.c_void_p
_i64p = ctypes.POINTER(ctypes.c_int64)
_f32p = ctypes.POINTER(ctypes.c_float)

class Buf(ctypes.Structure):
    """struct expertd_buf."""
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("mem", ctypes.c_int32)]


class Call(ctypes.Structure):
    """struct expertd_call (ABI 4; EXPERTD_CALL_BYTES = 208)."""
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("m", ctypes.c_int32), ("top_k", ctypes.c_int32), ("renormalize", ctypes.c_int32),
                ("scoring", ctypes.c_int32), ("num_groups", ctypes.c_int32),
                ("topk_groups", ctypes.c_int32), ("gemm", ctypes.c_int32), ("use_graph", ctypes.c_int32),
                ("routed_scaling_factor", ctypes.c_float), ("n_hidden_scale", ctypes.c_int32),
                ("hidden", Buf), ("hidden_scale", Buf), ("logits", Buf), ("correction_bias", Buf),
                ("topk_ids_in", Buf), ("topk_weights_in", Buf), ("out", Buf),
                ("topk_ids_out", Buf), ("topk_weights_out", Buf),
                ("kernel_ms", ctypes.POINTER(ctypes.c_float)), ("stream", ctypes.c_uint64)]


class Options(ctypes.Structure):
    """struct expertd_options (ABI 4; EXPERTD_OPTIONS_BYTES = 44), filled in by
    expertd_options_default."""
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32), ("streams", ctypes.c_int32),
                ("pdl", ctypes.c_int32), ("sm90_block", ctypes.c_int32), ("sm90_persistent", ctypes.c_int32),
                ("sm90_toka", ctypes.c_int32), ("poison", ctypes.c_int32), ("host_trace", ctypes.c_int32),
                ("sync_spin_us", ctypes.c_int32), ("sm90_pair", ctypes.c_int32)]


class SetParams(ctypes.Structure):
    """struct expertd_set_params (ABI 5; EXPERTD_SET_PARAMS_BYTES = 104), filled in
    by expertd_set_params_init."""
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("num_experts", ctypes.c_int32), ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("activation", ctypes.c_int32), ("n_w13_scale", ctypes.c_int32),
                ("n_w2_scale", ctypes.c_int32), ("block_n", ctypes.c_int32), ("block_k", ctypes.c_int32),
                ("a13_scale", ctypes.c_float), ("a2_scale", ctypes.c_float),
                ("swiglu_limit", ctypes.c_float), ("swiglu_alpha", ctypes.c_float),
                ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("w13_scale", ctypes.c_void_p),
                ("w2_scale", ctypes.c_void_p), ("w13_bias", ctypes.c_void_p), ("w2_bias", ctypes.c_void_p)]


assert (ctypes.sizeof(Call), ctypes.sizeof(Options), ctypes.sizeof(SetParams)) == (208, 44, 104), \
    "expertd_cuda.h layouts"


# expertd_set_create's argtypes per ABI version: v2 adds block_n, block_k
# after n_w2_scale.
_SET_CREATE = {
    1: [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        _p, _p, _p, ctypes.c_int, _p, ctypes.c_int, ctypes.c_float, ctypes.c_float,
        ctypes.POINTER(ctypes.c_uint64)],
    2: [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        _p, _p, _p, ctypes.c_int, _p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_float, ctypes.c_float, ctypes.POINTER(ctypes.c_uint64)],
}
_SET_CREATE[3] = _SET_CREATE[2]

# expertd_init's argtypes per ABI version: v3 adds streams.
_INIT = {1: [ctypes.c_int], 2: [ctypes.c_int], 3: [ctypes.c_int, ctypes.c_int],
         4: [ctypes.c_int, ctypes.POINTER(Options)]}
_SET_CREATE[4] = _SET_CREATE[2]
# v5 adds activations and takes the set's parameters as a struct; the rest
# is v4's.
_SET_CREATE[5] = [ctypes.c_int, ctypes.POINTER(SetParams), ctypes.POINTER(ctypes.c_uint64)]
_INIT[5] = _INIT[4]
_MOE_DEVICE_V1 = [ctypes.c_uint64, _i64p, ctypes.c_int, _f32p, ctypes.c_int,
                  _p, _p, _p, _p, _p, _p, _p, _p, _p, ctypes.c_size_t]
_MOE_DEVICE = {1: _MOE_DEVICE_V1, 2: _MOE_DEVICE_V1, 3: _MOE_DEVICE_V1,
               4: [ctypes.c_uint64, ctypes.POINTER(Call)]}
_MOE_DEVICE[5] = _MOE_DEVICE[4]


# (name, restype, argtypes), in the header's order and spelling of types;
# expertd_init's and expertd_set_create's argtypes are set once the version
# is known.
_SIGNATURES = [
    ("expertd_abi_version", ctypes.c_int, []),
    ("expertd_init", ctypes.c_int, None),
    ("expertd_device_info", ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]),
    ("expertd_set_create", ctypes.c_int, None),
    ("expertd_set_free", ctypes.c_int, [ctypes.c_uint64]),
    ("expertd_moe_device", ctypes.c_int, None),
    ("expertd_moe", ctypes.c_int, None),
    ("expertd_last_error", ctypes.c_char_p, []),
]


def _ptr(t: torch.Tensor | None) -> int | None:
    """Address of a contiguous tensor (device or host memory), or NULL."""
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("expertd needs contiguous tensors")
    return t.data_ptr()


def buf(t: torch.Tensor, mem: int = MEM_DEVICE) -> Buf:
    """struct expertd_buf of a tensor: its address, its element type's code
    (0 where the ABI has none: int32 ids) and where it lives (MEM_*)."""
    return Buf(_ptr(t), _DTYPES.get(t.dtype, 0), mem)


class Library:
    """A loaded libexpertd_cuda.so whose ABI version this mirror speaks
    (self.abi: one of ABI_VERSIONS)."""

    def __init__(self, path: str = DEFAULT_LIB):
        self.path = os.path.abspath(path)
        self.lib = ctypes.CDLL(self.path)
        for name, res, args in _SIGNATURES:
            fn = getattr(self.lib, name)
            fn.restype = res
            if args is not None:
                fn.argtypes = args
        got = self.lib.expertd_abi_version()
        if got not in ABI_VERSIONS:
            raise ExpertdError("expertd_abi_version", 1,
                               f"library ABI {got}, this mirror speaks {ABI_VERSIONS}")
        self.abi = got
        self.lib.expertd_set_create.argtypes = _SET_CREATE[got]
        self.lib.expertd_init.argtypes = _INIT[got]
        self.lib.expertd_moe_device.argtypes = _MOE_DEVICE[got]
        if got >= 4:
            self.lib.expertd_moe.argtypes = _MOE_DEVICE[got]
            self.lib.expertd_options_default.restype = None
            self.lib.expertd_options_default.argtypes = [ctypes.POINTER(Options)]
        if got >= 5:
            self.lib.expertd_set_params_init.restype = None
            self.lib.expertd_set_params_init.argtypes = [ctypes.POINTER(SetParams)]

    @property
    def block_scales(self) -> bool:
        """Whether expertd_set_create takes block-scaled weights (ABI >= 2)."""
        return self.abi >= 2

    @property
    def epilogue(self) -> bool:
        """Whether the library has SWIGLU_OAI and expert biases (ABI >= 5)."""
        return self.abi >= 5

    def check(self, func: str, code: int) -> None:
        """Raise ExpertdError with the thread's last error unless code is OK."""
        if code != OK:
            raise ExpertdError(func, code, self.lib.expertd_last_error().decode(errors="replace"))

    def init(self, device: int) -> None:
        """expertd_init on device."""
        if self.abi >= 4:
            opts = Options()
            self.lib.expertd_options_default(ctypes.byref(opts))
            opts.streams = 1
            args = (device, ctypes.byref(opts))
        else:
            args = (device, 1) if self.abi >= 3 else (device,)
        self.check("expertd_init", self.lib.expertd_init(*args))

    def device_info(self, device: int) -> str:
        """expertd_device_info as a str."""
        buf = ctypes.create_string_buffer(256)
        self.check("expertd_device_info", self.lib.expertd_device_info(device, buf, len(buf)))
        return buf.value.decode(errors="replace")


class ExpertSet:
    """One layer's experts uploaded to expertd, and calls of the op on them."""

    def __init__(self, lib: Library, device: int, weights):
        """Upload bench.peer.MoEWeights (copied to host: the ABI takes host weights).

        Block-scaled weights (shape.block = [Bn, Bk]) need ABI 2, SWIGLU_OAI
        and biases ABI 5; an older library raises
        ExpertdError(EXPERTD_ERR_UNSUPPORTED) before any call. Biases and
        SWIGLU_OAI's limit and alpha go in expertd_set_params (w13_bias in w13's
        row order: gate rows, then up rows, as the library takes w13).
        """
        s = weights.shape
        self.lib, self.shape, self.weights = lib, s, weights
        self.block = s.block
        if s.block is not None and not lib.block_scales:
            raise ExpertdError("expertd_set_create", ERR_UNSUPPORTED,
                               f"library ABI {lib.abi} has no block-scaled weights "
                               f"(weight_block_shape {list(s.block)} needs ABI 2)")
        if s.activation not in _ACTIVATIONS:
            raise ValueError(f"{s.name}: activation {s.activation!r} has no expertd value here")
        act = _ACTIVATIONS[s.activation]
        biases = [b for b in (weights.w13_bias, weights.w2_bias) if b is not None]
        epilogue = bool(biases) or act == ACT_SWIGLU_OAI
        if epilogue and not lib.epilogue:
            raise ExpertdError("expertd_set_create", ERR_UNSUPPORTED,
                               f"library ABI {lib.abi} has no expert biases or SWIGLU_OAI "
                               f"({s.name}: activation {s.activation}, "
                               f"{'with' if biases else 'no'} biases; needs ABI 5)")
        # Host copies live only for the call; the library copies them to the GPU.
        w13 = weights.w13.view(torch.uint8).cpu().contiguous()
        w2 = weights.w2.view(torch.uint8).cpu().contiguous()
        s13 = weights.w13_scale.float().cpu().contiguous()
        s2 = weights.w2_scale.float().cpu().contiguous()
        handle = ctypes.c_uint64(0)
        # Block layers: activation scales 0, dynamic per token group of Bk.
        a13, a2 = float(weights.a13_scale), float(weights.a2_scale)
        if lib.abi >= 5:
            b13 = None if weights.w13_bias is None else weights.w13_bias.float().cpu().contiguous()
            b2 = None if weights.w2_bias is None else weights.w2_bias.float().cpu().contiguous()
            for name, b, want in (("w13_bias", b13, (s.E, s.rows1)), ("w2_bias", b2, (s.E, s.K))):
                if b is not None and tuple(b.shape) != want:
                    raise ValueError(f"{s.name}: {name} is {list(b.shape)}, want {list(want)}")
            p = SetParams()
            lib.lib.expertd_set_params_init(ctypes.byref(p))
            p.num_experts, p.hidden, p.inter, p.activation = s.E, s.K, s.N, act
            p.n_w13_scale, p.n_w2_scale = s13.numel(), s2.numel()
            p.block_n, p.block_k = s.block or (0, 0)
            p.a13_scale, p.a2_scale = a13, a2
            if act == ACT_SWIGLU_OAI:
                p.swiglu_limit, p.swiglu_alpha = s.swiglu_limit, s.swiglu_alpha
            p.w13, p.w2, p.w13_scale, p.w2_scale = (_ptr(t) for t in (w13, w2, s13, s2))
            p.w13_bias, p.w2_bias = _ptr(b13), _ptr(b2)
            args = (device, ctypes.byref(p), ctypes.byref(handle))
        else:
            block = [] if lib.abi < 2 else list(s.block or (0, 0))
            args = (device, s.E, s.K, s.N, act, w13.data_ptr(), w2.data_ptr(),
                    s13.data_ptr(), s13.numel(), s2.data_ptr(), s2.numel(), *block,
                    a13, a2, ctypes.byref(handle))
        lib.check("expertd_set_create", lib.lib.expertd_set_create(*args))
        self.handle = handle.value
        del w13, w2
        # The static per-tensor hidden scale; block layers pass each call's
        # per-token-group scales instead.
        self.hidden_scale = weights.a13_scale.float().reshape(1).contiguous()
        self.bias = None
        if weights.correction_bias is not None:
            self.bias = weights.correction_bias.float().contiguous()

    def params(self, M: int, gemm: int = GEMM_AUTO):
        """The call's parameters for M tokens of FP8 hidden, FP32 logits, BF16 out:
        a Call whose buffers moe_device fills in (ABI 4), else the iparams /
        fparams arrays.

        Block layers take M * ceil(K/Bk) hidden scales (per token group) and the
        shape's expert groups; the others one scale and no grouping.
        """
        s = self.shape
        n_hidden_scale = 1 if s.block is None else M * -(-s.K // s.block[1])
        if self.lib.abi >= 4:
            c = Call(size=ctypes.sizeof(Call), version=self.lib.abi, m=M, top_k=s.top_k,
                     renormalize=int(s.renormalize),
                     scoring=SCORING_SIGMOID if s.scoring == "sigmoid" else SCORING_SOFTMAX,
                     num_groups=s.n_group if s.n_group > 1 else 0,
                     topk_groups=s.topk_group if s.n_group > 1 else 0, gemm=gemm, use_graph=0,
                     routed_scaling_factor=s.scaling_factor, n_hidden_scale=n_hidden_scale)
            return c
        ip = (ctypes.c_int64 * NUM_IPARAMS)()
        ip[P_M] = M
        ip[P_HIDDEN_DTYPE] = DTYPE_FLOAT8_E4M3FN
        ip[P_N_HIDDEN_SCALE] = n_hidden_scale
        ip[P_LOGITS_DTYPE] = DTYPE_FLOAT32
        ip[P_OUT_DTYPE] = DTYPE_BFLOAT16
        ip[P_TOP_K] = s.top_k
        ip[P_RENORMALIZE] = int(s.renormalize)
        ip[P_SCORING] = SCORING_SIGMOID if s.scoring == "sigmoid" else SCORING_SOFTMAX
        ip[P_NUM_GROUPS] = s.n_group if s.n_group > 1 else 0
        ip[P_TOPK_GROUPS] = s.topk_group if s.n_group > 1 else 0
        ip[P_GEMM] = gemm
        ip[P_USE_GRAPH] = 0
        fp = (ctypes.c_float * NUM_FPARAMS)()
        fp[F_SCALING_FACTOR] = s.scaling_factor
        return ip, fp

    def moe_device(self, x_fp8: torch.Tensor, logits: torch.Tensor, out: torch.Tensor,
                   params=None, topk_ids: torch.Tensor | None = None,
                   topk_w: torch.Tensor | None = None,
                   hidden_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Enqueue the op on torch's current stream (capturable); returns out.

        hidden_scale: block layers' per-token-group scales [M, ceil(K/Bk)]
        float32, row-major (required for them, ignored otherwise).
        """
        M = x_fp8.shape[0]
        params = params or self.params(M)
        n_hs = params.n_hidden_scale if isinstance(params, Call) else params[0][P_N_HIDDEN_SCALE]
        if self.block is not None:
            if hidden_scale is None or hidden_scale.numel() != n_hs:
                raise ValueError(f"block layer: hidden_scale needs {n_hs} floats")
            hs = hidden_scale
        else:
            hs = self.hidden_scale
        if isinstance(params, Call):
            c = Call.from_buffer_copy(params)
            for name, t in (("hidden", x_fp8), ("hidden_scale", hs), ("logits", logits),
                            ("correction_bias", self.bias), ("out", out),
                            ("topk_ids_out", topk_ids), ("topk_weights_out", topk_w)):
                if t is not None:
                    setattr(c, name, buf(t))
            self.launch(c, x_fp8.device)
            return out
        stream = torch.cuda.current_stream(x_fp8.device).cuda_stream
        ip, fp = params
        self.lib.check("expertd_moe_device", self.lib.lib.expertd_moe_device(
            self.handle, ip, NUM_IPARAMS, fp, NUM_FPARAMS,
            _ptr(x_fp8), _ptr(hs), _ptr(logits), _ptr(self.bias),
            None, None, _ptr(out), _ptr(topk_ids), _ptr(topk_w), stream))
        return out

    def launch(self, call: Call, device=None) -> None:
        """expertd_moe_device of a filled-in Call (ABI 4 on; device buffers),
        enqueued on torch's current stream of device (capturable)."""
        call.stream = torch.cuda.current_stream(device).cuda_stream
        self.lib.check("expertd_moe_device", self.lib.lib.expertd_moe_device(self.handle, ctypes.byref(call)))

    def moe_host(self, call: Call) -> None:
        """expertd_moe of a filled-in Call (ABI 4 on): synchronous, on the
        library's own streams; buffers anywhere, as each Buf's mem says."""
        if self.lib.abi < 4:
            raise ExpertdError("expertd_moe", ERR_UNSUPPORTED, f"library ABI {self.lib.abi}: no expertd_call")
        self.lib.check("expertd_moe", self.lib.lib.expertd_moe(self.handle, ctypes.byref(call)))

    def free(self) -> None:
        """expertd_set_free; safe to call twice."""
        if self.handle:
            self.lib.check("expertd_set_free", self.lib.lib.expertd_set_free(self.handle))
            self.handle = 0


def load(path: str = DEFAULT_LIB) -> Library | None:
    """The library at path, or None when the file is absent (peer-only runs)."""
    if not os.path.exists(path):
        return None
    return Library(path)
