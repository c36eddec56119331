"""FlashInfer's CUTLASS fused MoE (`cutlass_fused_moe`), the bench's second peer.

FlashInfer's `cutlass_fused_moe` is TensorRT-LLM's MoE runner: permutation,
GEMM1, activation, FP8 requant, GEMM2 and the weighted combine (fused into
GEMM2's epilogue) on CUTLASS SM90 grouped GEMMs. vLLM calls it for FP8
per-tensor layers (its FlashInfer CUTLASS MoE path), and this module calls it
the same way:

- quant_scales, in the order the binding reads them: GEMM1's dequant scale per
  expert (a13_scale * w13_scale[e]), GEMM2's input quant scale (1 / a2_scale,
  0-dim), GEMM2's dequant scale per expert (a2_scale * w2_scale[e]) and GEMM1's
  input dequant scale (a13_scale, 0-dim); no input_sf.
- For gated activations (ActivationType.Swiglu, SwigluBias) GEMM1's output
  rows hold the linear (up) half first and the gate half second, so w13
  [gate; up] is passed as [up; gate], and so is w13_bias. Relu2 is not gated:
  w13 goes as it is.
- gpt-oss's swiglu_oai is ActivationType.SwigluBias (the kernel the binding
  switches Swiglu to when given these parameters; named here so that the
  workspace size and the autotuner's profiles are that kernel's) with
  per-expert float32 swiglu_alpha, swiglu_beta (1: the up branch plus one)
  and swiglu_limit:
  min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit,
  limit) + beta). Biases go as fc1_expert_biases [E, 2N] (added to GEMM1's
  dequantized output before the activation) and fc2_expert_biases [E, K]
  (added to GEMM2's output before the router weight), both in the output
  dtype (BF16), which is why make_weights draws BF16-representable biases.
- It takes precomputed top-k ids (int32) and weights (float32): the full op
  here is bench/peer.py's `route` followed by `cutlass_fused_moe`, and
  `moe_only` times the call alone.
- FlashInfer's autotuner picks each GEMM's tactic: `tune` profiles the bench's
  token counts once per layer (tuning_buckets: exactly the M values timed), and
  every later call looks its tactic up for the same buckets, so a CUDA graph
  captures the tuned kernels.
- One workspace buffer sized for the largest M, passed to every call, so no
  call allocates (graph capture needs that).

FlashInfer is optional: `load()` says why it is absent. The PyPI package
(flashinfer-python) JIT-compiles its CUTLASS MoE module at first use;
FLASHINFER_DISABLE_JIT=1 (bench/run.sh sets it) makes a missing ahead-of-time
module an error rather than an hours-long build.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import peer

# The version whose call signature this module follows.
FLASHINFER_VERSION = "0.7.2.post1"


@dataclasses.dataclass(frozen=True)
class FlashInfer:
    """The few FlashInfer entry points the peer calls."""

    version: str
    fused_moe: object  # flashinfer.fused_moe.cutlass_fused_moe
    workspace_size: object  # flashinfer.fused_moe.cutlass_fused_moe_workspace_size
    activation: object  # flashinfer.fused_moe.core.ActivationType
    autotune: object  # flashinfer.autotuner.autotune


def load() -> tuple[FlashInfer | None, str]:
    """FlashInfer's entry points, or None and why they are unavailable.

    Only the Python import is tried here: the CUTLASS module loads at the first
    call, where a failure is reported per model.
    """
    try:
        import flashinfer
        from flashinfer.autotuner import autotune
        from flashinfer.fused_moe import cutlass_fused_moe, cutlass_fused_moe_workspace_size
        from flashinfer.fused_moe.core import ActivationType
    except ImportError as e:
        return None, (f"flashinfer is not importable ({type(e).__name__}: {str(e)[:200]}); "
                      f"`pip install flashinfer-python=={FLASHINFER_VERSION}` brings it")
    version = getattr(flashinfer, "__version__", "unknown")
    note = f"flashinfer {version} ({flashinfer.__file__})"
    if version != FLASHINFER_VERSION:
        note += f"; the peer follows {FLASHINFER_VERSION}'s signature"
    return FlashInfer(version, cutlass_fused_moe, cutlass_fused_moe_workspace_size,
                      ActivationType, autotune), note


def supports(shape: peer.MoEShape) -> str | None:
    """None if the peer runs this layer, else why not."""
    if shape.block is not None:
        return "block-scaled FP8 is not this peer's path (per-tensor FP8 only)"
    if shape.activation not in ("relu2", "silu_gated", "swiglu_oai"):
        return f"activation {shape.activation!r} has no FlashInfer counterpart here"
    return None


class FlashInferPeer:
    """One layer's weights laid out for `cutlass_fused_moe`, and its calls.

    buckets are the token counts the autotuner profiles and every call maps to
    (each call's M must be one of them for its tuned tactic to be used);
    max_m sizes the workspace.
    """

    def __init__(self, fi: FlashInfer, w: peer.MoEWeights, buckets: list[int]):
        s = w.shape
        why = supports(s)
        if why is not None:
            raise ValueError(f"{s.name}: {why}")
        self.fi, self.w, self.shape = fi, w, s
        self.buckets = tuple(sorted(set(buckets)))
        self.max_m = self.buckets[-1]
        dev = w.w13.device
        self.act = {"relu2": fi.activation.Relu2, "silu_gated": fi.activation.Swiglu,
                    "swiglu_oai": fi.activation.SwigluBias}[s.activation]
        gated = s.activation != "relu2"
        self.fc1 = _up_first(w.w13, s.N) if gated else w.w13.contiguous()
        self.fc2 = w.w2.contiguous()
        # MoEWeights has both biases or neither, as the binding takes them.
        self.biases = {}
        if s.biases:
            b13 = _up_first(w.w13_bias, s.N) if gated else w.w13_bias
            self.biases = {"fc1_expert_biases": b13.bfloat16().contiguous(),
                           "fc2_expert_biases": w.w2_bias.bfloat16().contiguous()}
        self.act_params = {}
        if s.activation == "swiglu_oai":
            def per_expert(v):
                return torch.full((s.E,), v, dtype=torch.float32, device=dev)
            self.act_params = {"swiglu_alpha": per_expert(s.swiglu_alpha),
                               "swiglu_beta": per_expert(1.0),
                               "swiglu_limit": per_expert(s.swiglu_limit)}
        a13 = w.a13_scale.float().reshape(())
        a2 = w.a2_scale.float().reshape(())
        self.quant_scales = [
            (w.w13_scale.float() * a13).contiguous(),
            (1.0 / a2).contiguous(),
            (w.w2_scale.float() * a2).contiguous(),
            a13.contiguous(),
        ]
        nbytes = fi.workspace_size(
            self.max_m, s.K, s.N, s.E, s.top_k, x_dtype=torch.float8_e4m3fn,
            weight_dtype=torch.float8_e4m3fn, output_dtype=torch.bfloat16,
            activation_type=self.act, device=dev)
        self.workspace = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)

    # Graph capture works: precomputed routing, preallocated workspace and output.
    capturable = True

    def _tactics(self, tune: bool):
        """The autotuner context every call runs in: profiling (tune) or lookup,
        both over self.buckets so tuning and lookup agree on each M's bucket."""
        return self.fi.autotune(tune, tuning_buckets=self.buckets)

    def moe_only(self, x_fp8: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """`cutlass_fused_moe` alone on precomputed top-k ids [M, k] int32 and
        weights [M, k] float32: [M, K] BF16 (into out when given)."""
        if out is None:
            out = torch.empty(x_fp8.shape[0], self.shape.K, dtype=torch.bfloat16,
                              device=x_fp8.device)
        with self._tactics(False):
            self._call(x_fp8, ids, weights, out)
        return out

    def _call(self, x_fp8, ids, weights, out):
        self.fi.fused_moe(
            input=x_fp8, token_selected_experts=ids, token_final_scales=weights,
            fc1_expert_weights=self.fc1, fc2_expert_weights=self.fc2,
            output_dtype=torch.bfloat16, quant_scales=self.quant_scales, output=out,
            activation_type=self.act, tune_max_num_tokens=self.max_m,
            workspace_buffer=self.workspace, **self.biases, **self.act_params)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The peers' routing (bench/peer.py), ids made contiguous int32."""
        ids, weights = peer.route(logits, self.shape, self.w.correction_bias)
        return ids.contiguous(), weights.float().contiguous()

    def forward(self, x_fp8: torch.Tensor, logits: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The full op: routing, then `cutlass_fused_moe`; [M, K] BF16."""
        ids, weights = self.route(logits)
        return self.moe_only(x_fp8, ids, weights, out)

    __call__ = forward

    def tune(self, x_fp8: torch.Tensor, logits: torch.Tensor) -> None:
        """Profile every bucket's GEMM1 and GEMM2 tactics (FlashInfer draws its
        own routing for the profile); call once before timing."""
        ids, weights = self.route(logits)
        out = torch.empty(x_fp8.shape[0], self.shape.K, dtype=torch.bfloat16, device=x_fp8.device)
        with self._tactics(True):
            self._call(x_fp8, ids, weights, out)
        if out.is_cuda:
            torch.cuda.synchronize()


def _up_first(t: torch.Tensor, N: int) -> torch.Tensor:
    """[E, 2N, ...] gate rows then up rows as TensorRT-LLM's [up; gate]."""
    return torch.cat([t[:, N:], t[:, :N]], dim=1).contiguous()


def fake(calls: list | None = None) -> FlashInfer:
    """A stand-in FlashInfer that computes what `cutlass_fused_moe` is documented
    to compute, in float32 on any device, for checking this module's plumbing
    (scale order, the [up; gate] swap, biases, SwigluBias's parameters,
    routing) without a GPU. Each call's keyword arguments are appended to calls
    when given."""

    class Act:
        Swiglu, SwigluBias, Relu2 = "Swiglu", "SwigluBias", "Relu2"

    def fused_moe(*, input, token_selected_experts, token_final_scales, fc1_expert_weights,
                  fc2_expert_weights, output_dtype, quant_scales, output, activation_type,
                  fc1_expert_biases=None, fc2_expert_biases=None, swiglu_alpha=None,
                  swiglu_beta=None, swiglu_limit=None, **kw):
        if calls is not None:
            calls.append(dict(kw, activation_type=activation_type))
        # The input is FP8 already, so GEMM1's dequant scale carries a13_scale and
        # the fourth scale (GEMM1's input dequant) goes unused on this path.
        g1, q2, g2, _ = quant_scales
        x = input.float()
        y = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        n = fc2_expert_weights.shape[2]
        for t in range(x.shape[0]):
            for j in range(token_selected_experts.shape[1]):
                e = int(token_selected_experts[t, j])
                h = (x[t] @ fc1_expert_weights[e].float().T) * g1[e]
                if fc1_expert_biases is not None:
                    h = h + fc1_expert_biases[e].float()
                if activation_type == Act.Swiglu:
                    act = torch.nn.functional.silu(h[n:]) * h[:n]
                elif activation_type == Act.SwigluBias:
                    lim = swiglu_limit[e]
                    gate, lin = h[n:].clamp(max=lim), h[:n].clamp(-lim, lim)
                    act = gate * torch.sigmoid(gate * swiglu_alpha[e]) * (lin + swiglu_beta[e])
                else:
                    act = torch.relu(h).square()
                a2 = (act * q2).clamp(-peer.FP8_MAX, peer.FP8_MAX).to(torch.float8_e4m3fn)
                y2 = (a2.float() @ fc2_expert_weights[e].float().T) * g2[e]
                if fc2_expert_biases is not None:
                    y2 = y2 + fc2_expert_biases[e].float()
                y[t] += token_final_scales[t, j] * y2
        output.copy_(y.to(output_dtype))
        return [output]

    def workspace_size(*a, **kw):
        return 256

    return FlashInfer("fake", fused_moe, workspace_size, Act,
                      lambda tune, tuning_buckets=None: contextlib.nullcontext())


def self_check(device) -> int:
    """This module against the float64 reference on small layers: the real
    FlashInfer on a GPU where it loads, else the stand-in (plumbing only).
    Returns the number of failures."""
    fi, note = load() if torch.device(device).type == "cuda" else (None, "no GPU")
    real = fi is not None
    print(f"flashinfer peer check: {note if real else 'stand-in (' + note + ')'}")
    fi = fi or fake()
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    # The stand-in keeps GEMM outputs in float32: only a plumbing mistake
    # moves it past a few 1e-3; the real kernel rounds GEMM1's output to BF16.
    bar = 2e-2 if real else 5e-3
    failures = 0
    for shape in (peer.NEMOTRON, peer.QWEN3, peer.GPT_OSS):
        s = shape if real else peer.small_shape(shape)
        w = peer.make_weights(s, device, gen)
        peer.calibrate_a2_scale(w, 64, device, gen)
        Ms = [1, 37, 256] if real else [1, 7]
        p = FlashInferPeer(fi, w, Ms)
        if real:
            p.tune(*peer.make_inputs(s, w, max(Ms), device, gen))
        for M in Ms:
            x, logits = peer.make_inputs(s, w, M, device, gen)
            err = peer.rel_l2(p(x, logits), peer.reference_moe(w, x, logits))
            ok = err <= bar
            failures += not ok
            print(f"flashinfer check {s.name:24s} M={M:4d} rel-L2 {err:.2e} (bar {bar:g}) "
                  f"{'ok' if ok else 'FAIL'}")
    return failures


if __name__ == "__main__":
    import sys

    sys.exit(1 if self_check("cuda" if torch.cuda.is_available() else "cpu") else 0)
