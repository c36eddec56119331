"""PyTorch integration: RemoteMoE serves a Hugging Face MoE block's routed
experts from expertd.

    block = model.model.layers[5].mlp                     # e.g. Qwen3MoeSparseMoeBlock
    model.model.layers[5].mlp = expertd.torch.RemoteMoE.from_hf(block, client, "qwen3/layer5")

from_hf quantizes the block's expert weights to FP8 E4M3 with one scale per
output channel (exact for weights that are already FP8 with such scales),
uploads them once, and keeps the router (gate) and any shared experts in
this process: forward computes the router logits locally, has the service
run the routed experts, and adds the shared experts' output. Known blocks:
Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3MoE (also Kimi-K2)
and NemotronH's MoE, with experts stored either as a ModuleList of MLPs or
as fused [E, 2N, K] / [E, K, N] parameters.

CUDA inputs go through a CUDA IPC region when the daemon runs the cuda
backend on this host's GPU (cuda_ipc=True); otherwise they are copied to
the host and sent inline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertd import _common
from expertd.v1 import expert_pb2 as pb

FP8_MAX = 448.0


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes of w [..., rows, cols] with one float32 scale per row
    (amax / 448), as compressed-tensors' per-channel scheme does."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-10)
    codes = (w / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.unsqueeze(-1)


def _first(objs, names, default=None):
    for o in objs:
        if o is None:
            continue
        for n in names:
            v = getattr(o, n, None)
            if v is not None:
                return v
    return default


def _expert_weights(experts, k: int):
    """(w13 [E, rows, K] with gate rows first, w2 [E, K, N], gated) of a
    ModuleList of MLPs or fused expert parameters."""
    if isinstance(experts, nn.ModuleList):
        first = experts[0]
        names = next((ns for ns in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
                      if all(hasattr(first, n) for n in ns)), None)
        if names is not None:
            w13 = torch.stack([torch.cat([getattr(x, names[0]).weight, getattr(x, names[1]).weight]) for x in experts])
            return w13, torch.stack([getattr(x, names[2]).weight for x in experts]), True
        if hasattr(first, "up_proj") and hasattr(first, "down_proj"):  # Nemotron-H: relu2, no gate
            return (torch.stack([x.up_proj.weight for x in experts]),
                    torch.stack([x.down_proj.weight for x in experts]), False)
        raise TypeError(f"experts of {type(first).__name__}: no gate_proj/up_proj/down_proj or w1/w3/w2")
    gu = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    gated = gu is not None
    if gu is None:
        gu = getattr(experts, "up_proj", None)
    if gu is None or down is None or not isinstance(down, torch.Tensor):
        raise TypeError(f"{type(experts).__name__}: want gate_up_proj (or up_proj) and down_proj parameters")
    # Fused layouts store [E, rows, K] (weights as rows) or [E, K, rows].
    if gu.shape[-1] != k:
        gu = gu.transpose(1, 2)
    if down.shape[1] != k:
        down = down.transpose(1, 2)
    return gu, down, gated


class RemoteMoE(nn.Module):
    """A MoE block whose routed experts run in expertd.

    gate_weight [E, K] makes router logits from the hidden states here;
    routing is a Routing message (or expertd.routing(...)); shared is an
    optional module added to the output (DeepSeek-V3 and Nemotron-H shared
    experts); output_dtype is the service's output dtype (default float32
    for float32 hidden states, else bfloat16). Use from_hf to build one
    from a transformers block.
    """

    def __init__(self, client, name: str, gate_weight: torch.Tensor, routing: pb.Routing,
                 shared: nn.Module | None = None, returns_router_logits: bool = False,
                 cuda_ipc: bool = False, output_dtype: str | None = None):
        super().__init__()
        self.client, self.name, self.routing = client, name, routing
        self.gate_weight = nn.Parameter(gate_weight.detach().clone(), requires_grad=False)
        self.shared = shared
        self.returns_router_logits = returns_router_logits
        self.cuda_ipc = cuda_ipc
        self.output_dtype = output_dtype
        self._arena = None
        self._region = None

    @classmethod
    def from_hf(cls, block: nn.Module, client, name: str, config=None, overwrite: bool = True,
                cuda_ipc: bool = False, chunk_bytes: int = _common.CHUNK_BYTES) -> "RemoteMoE":
        """Uploads block's experts as expert set name and returns the module
        that serves the block. config is the model's config when the block
        does not keep one (block.config is used otherwise)."""
        config = config if config is not None else getattr(block, "config", None)
        gate = block.gate
        gate_w = gate.weight if isinstance(gate.weight, torch.Tensor) else gate.weight()
        e, k = gate_w.shape
        kind = type(block).__name__
        if not isinstance(getattr(block, "fc1_latent_proj", nn.Identity()), nn.Identity):
            raise TypeError(f"{kind}: experts behind a latent projection (moe_latent_size) are not supported")
        w13, w2, gated = _expert_weights(block.experts, k)
        sigmoid = "Deepseek" in kind or "NemotronH" in kind or "Kimi" in kind or \
            getattr(gate, "e_score_correction_bias", None) is not None
        top_k = _first((block, gate, config), ("top_k", "num_experts_per_tok"))
        if top_k is None:
            raise ValueError(f"{kind}: cannot find top_k (pass config=)")
        norm = _first((block, gate, config), ("norm_topk_prob",), default=None)
        if "Mixtral" in kind:
            norm = True  # Mixtral renormalizes its top-k softmax weights always
        if norm is None:
            norm = sigmoid
        routing = pb.Routing(top_k=int(top_k), renormalize=bool(norm),
                             scoring=pb.SCORING_SIGMOID if sigmoid else pb.SCORING_SOFTMAX)
        if sigmoid:
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                routing.correction_bias.CopyFrom(pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[e],
                                                           data=bias.detach().float().cpu().numpy().tobytes()))
            n_group = _first((block, gate, config), ("n_group", "num_group"), default=0) or 0
            if n_group:
                routing.num_expert_groups = int(n_group)
                routing.topk_groups = int(_first((block, gate, config), ("topk_group",), default=n_group))
            sf = _first((block, gate, config), ("routed_scaling_factor",), default=0.0)
            routing.routed_scaling_factor = float(sf or 0.0)
        c13, s13 = quantize_fp8_rows(w13)
        c2, s2 = quantize_fp8_rows(w2)
        client.load_experts(name, c13.cpu(), c2.cpu(), s13.cpu(), s2.cpu(),
                            activation="silu_gated" if gated else "relu2", overwrite=overwrite,
                            chunk_bytes=chunk_bytes)
        # Whether the block returns (hidden, router_logits) differs across
        # transformers versions; one token through it says.
        with torch.no_grad():
            probe = block(torch.zeros(1, 1, k, dtype=gate_w.dtype, device=gate_w.device))
        returns = isinstance(probe, tuple)
        return cls(client, name, gate_w, routing, shared=getattr(block, "shared_experts", None),
                   returns_router_logits=returns, cuda_ipc=cuda_ipc)

    def _call_ipc(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        need = [m * k * 2, m * logits.shape[1] * 4, m * k * 2]
        offs = [0]
        for n in need[:-1]:
            offs.append(offs[-1] + (n + 255) // 256 * 256)
        size = offs[-1] + need[-1]
        if self._arena is None or self._arena.numel() < size or self._arena.device != x.device:
            if self._region is not None:
                self.client.unregister_shared_memory(self._region.name)
            self._arena = torch.empty(max(size, 1 << 20) * 2, dtype=torch.uint8, device=x.device)
            self._region = self.client.register_cuda_tensor(f"{self.name}/ipc-{id(self)}"[:128], self._arena)
        a = self._arena
        h = a[offs[0]:offs[0] + need[0]].view(torch.bfloat16).view(m, k)
        lg = a[offs[1]:offs[1] + need[1]].view(torch.float32).view(m, -1)
        out = a[offs[2]:offs[2] + need[2]].view(torch.bfloat16).view(m, k)
        h.copy_(x)
        lg.copy_(logits)
        torch.cuda.current_stream(x.device).synchronize()
        self.client.fused_moe(self._region.tensor(h), expert_set=self.name, router_logits=self._region.tensor(lg),
                              routing_message=self.routing, output_shm=self._region.ref(out), like="torch")
        return out.clone()

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate_weight.float())
        if self.cuda_ipc and x.is_cuda:
            y = self._call_ipc(x.to(torch.bfloat16), logits)
        else:
            res = self.client.fused_moe(x.detach().to("cpu", torch.float32), expert_set=self.name,
                                        router_logits=logits.detach().cpu(), routing_message=self.routing,
                                        output_dtype=self.output_dtype or (
                                            "float32" if hidden_states.dtype == torch.float32 else "bfloat16"),
                                        like="torch")
            y = res.output
        y = y.to(hidden_states.device, hidden_states.dtype).reshape(shape)
        if self.shared is not None:
            y = y + self.shared(hidden_states)
        if self.returns_router_logits:
            return y, logits.to(hidden_states.dtype)
        return y
