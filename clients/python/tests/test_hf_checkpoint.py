"""Checkpoints in the layouts of the real FP8 releases, written from small
random transformers MoE blocks (built from config, no download), loaded by
the daemon from its -weights-dir and compared with the block's own forward
on the dequantized weights (rel L2 <= 2e-2).

Each case writes what the release ships: per-expert tensor names, FP8
E4M3 codes with the release's scales (ModelOpt per-tensor weight_scale
and input_scale for Nemotron-H, block [128, 128] weight_scale_inv for
DeepSeek-V3 and Qwen3-FP8, compressed-tensors per-channel weight_scale,
AutoFP8 per-tensor with input_scale for Mixtral), the router and the
shared experts beside them, a second MoE layer the load must not mix in,
config.json from the config's own save_pretrained plus the release's
quantization_config, and shards with model.safetensors.index.json from
huggingface_hub's save_torch_state_dict, small enough that the layer
spans several shards. The daemon reads E, top_k and the routing from
config.json (the test sends only router logits and the returned routing).

The reference is the block's forward with its expert weights replaced by
the checkpoint's dequantized values and FP8 quantization applied where the
daemon applies it: to the experts' input and to the down projections'
input, per token (per-channel and per-tensor weights with dynamic
activations), per token and 128-group (block weights), or with the static
input scales (their max over the experts, as vLLM takes it). The shared
experts stay out of the comparison: the daemon serves the routed ones.

The BF16 and FP16 cases write what the unquantized releases ship (Mixtral,
Qwen3-30B-A3B, DeepSeek's BF16 conversions, gpt-oss's BF16 releases with
GptOssExperts' stacked, biased experts): the experts' weights in 16 bits,
no quantization_config; the daemon quantizes them to FP8 as it
reads them, at the case's weight_quantization (default per-channel). The
set is compared with two forwards of the block: with its 16-bit weights
quantized here as the daemon should (per expert and matrix, gate and up
stacked), within the FP8 bar; and with the 16-bit weights themselves,
within what E4M3's 3 mantissa bits cost on their own (HALF_BAR).
"""

import copy
import json
import os
import shutil
import tempfile

import pytest

import expertd
import needs
from hfref import FP8_MAX, act_dynamic, act_static, quantized_expert_inputs

torch = needs.module("torch")
transformers = needs.module("transformers")
huggingface_hub = needs.module("huggingface_hub")

LAYER, OTHER_LAYER = 3, 1
M = 16


# --- quantization as the releases store it -------------------------------

def quant_tensor(w):
    """Per-tensor: one scale (ModelOpt, AutoFP8)."""
    s = (w.abs().amax() / FP8_MAX).clamp(min=1e-10).reshape(())
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def quant_channel(w):
    """Per output channel, [rows, 1] (compressed-tensors strategy channel)."""
    s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-10)
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def quant_block(w, b=128):
    """Per [b, b] tile, [ceil(rows/b), ceil(cols/b)] (DeepSeek-V3, Qwen3-FP8)."""
    r, c = w.shape
    tr, tc = -(-r // b), -(-c // b)
    p = torch.zeros(tr * b, tc * b, dtype=w.dtype)
    p[:r, :c] = w
    s = (p.reshape(tr, b, tc, b).abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-10)
    full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:r, :c]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def dequant(codes, s, form, b=128):
    s = s.float()
    if form == "block":
        s = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:codes.shape[0], :codes.shape[1]]
    return codes.float() * s


class _Zero(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


# --- the cases ----------------------------------------------------------------

def _eager(cfg):
    cfg._experts_implementation = "eager"
    return cfg


def qwen3_config(k, n, e, top_k):
    from transformers import Qwen3MoeConfig
    return _eager(Qwen3MoeConfig(hidden_size=k, moe_intermediate_size=n, intermediate_size=4 * k, num_experts=e,
                                 num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64))


def qwen3_block(cfg):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    return Qwen3MoeSparseMoeBlock(cfg)


def mixtral_config(k, n, e, top_k):
    from transformers import MixtralConfig
    return _eager(MixtralConfig(hidden_size=k, intermediate_size=n, num_local_experts=e, num_experts_per_tok=top_k,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=64))


def mixtral_block(cfg):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    return MixtralSparseMoeBlock(cfg)


def deepseek_config(k, n, e, top_k):
    from transformers import DeepseekV3Config
    return _eager(DeepseekV3Config(hidden_size=k, moe_intermediate_size=n, intermediate_size=4 * k, n_routed_experts=e,
                                   num_experts_per_tok=top_k, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                   norm_topk_prob=True, n_shared_experts=1, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=64,
                                   first_k_dense_replace=0))


def deepseek_block(cfg):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    return DeepseekV3MoE(cfg)


def qwen3_next_config(k, n, e, top_k):
    from transformers import Qwen3NextConfig
    # norm_topk_prob left at Qwen3NextConfig's default (True), which the
    # loader must know.
    return _eager(Qwen3NextConfig(hidden_size=k, moe_intermediate_size=n, shared_expert_intermediate_size=2 * n,
                                  num_experts=e, num_experts_per_tok=top_k, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64))


def qwen3_next_block(cfg):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    return Qwen3NextSparseMoeBlock(cfg)


def glm4_moe_config(k, n, e, top_k):
    from transformers import Glm4MoeConfig
    return _eager(Glm4MoeConfig(hidden_size=k, moe_intermediate_size=n, intermediate_size=4 * k, n_routed_experts=e,
                                num_experts_per_tok=top_k, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                n_shared_experts=1, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=64, first_k_dense_replace=0))


def glm4_moe_block(cfg):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    return Glm4MoeMoE(cfg)


def gpt_oss_config(k, n, e, top_k):
    from transformers import GptOssConfig
    # swiglu_limit far below GptOssConfig's 7.0, which these weights never
    # reach: the loader must take config.json's clamp (swiglu_alpha is
    # saved at its default, 1.702).
    return _eager(GptOssConfig(hidden_size=k, intermediate_size=n, num_local_experts=e, num_experts_per_tok=top_k,
                               swiglu_limit=0.25, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=64))


def gpt_oss_block(cfg):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    block = GptOssMLP(cfg)
    # Some transformers releases (5.17) fix the experts' clamp at gpt-oss's
    # defaults instead of reading the config; the reference applies the
    # config's, which config.json carries and the loader reads. Those
    # releases' configs have no swiglu_alpha: the loader then takes
    # gpt-oss's, as the experts do.
    experts = block.experts
    assert hasattr(experts, "limit") and hasattr(experts, "alpha"), "GptOssExperts has no limit/alpha to set"
    experts.limit = cfg.swiglu_limit
    experts.alpha = getattr(cfg, "swiglu_alpha", experts.alpha)
    return block


def nemotron_config(k, n, e, top_k):
    from transformers import NemotronHConfig
    return _eager(NemotronHConfig(hidden_size=k, moe_intermediate_size=n, n_routed_experts=e, num_experts_per_tok=top_k,
                                  n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  moe_shared_expert_intermediate_size=2 * n, mlp_hidden_act="relu2",
                                  layers_block_type=["moe"] * 4, vocab_size=64))


def nemotron_block(cfg):
    from transformers.models.nemotron_h import modeling_nemotron_h as mod
    cls = next((getattr(mod, c) for c in ("NemotronHMoE", "NemotronHMOE") if hasattr(mod, c)), None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no NemotronH MoE block")
    return cls(cfg, layer_idx=LAYER)


DYNAMIC_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128]}
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                              "symmetric": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"]}
MODELOPT = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None}
# A 16-bit layer quantized to FP8 differs from its own forward by E4M3's
# rounding of every weight: about 2.6% relative RMS on random weights,
# which both GEMMs, the gate-up product and the intermediate's
# requantization carry into the output: the FP8 bar of 2e-2 holds against
# the quantized weights, this one against the 16-bit ones (as service's
# TestLoadHalfCheckpoint bounds them).
HALF_BAR = 8e-2
# weight_quantization: the daemon's granularity name and how it is done here.
HALF_GRANULARITY = {"per_tensor": ("per-expert", "tensor"), "per_channel": ("per-channel", "channel"),
                    "block": ("block", "block")}
AUTOFP8 = {"quant_method": "fp8", "activation_scheme": "static"}

# name: (config, block, dims (K, N, E, top_k), scales (tensor, channel or
# block; None for a 16-bit checkpoint), scale dtype, scale suffix, static
# input scales, quantization config, tensor prefix of the layers, expert
# projection names (gate, up, down; gate None without one), the block's
# module name in the layer, router bias, wrapper config (multimodal); for
# 16-bit checkpoints the weights' dtype and the weight_quantization asked
# for (None: the daemon's default, per-channel); stacked: the experts in
# GptOssExperts' stacked tensors, with biases and a router of its own
# (module "router", with a bias in its logits); activation: the set's, where
# a backend may not run it)
CASES = {
    "nemotron_h-modelopt": dict(config=nemotron_config, block=nemotron_block, dims=(64, 32, 8, 2), scales="tensor",
                                suffix="weight_scale", static=True, quant=MODELOPT, prefix="backbone.layers",
                                proj=(None, "up_proj", "down_proj"), module="mixer", bias=True,
                                preset="nemotron_h"),
    "qwen3_moe-block-fp8": dict(config=qwen3_config, block=qwen3_block, dims=(256, 256, 8, 2), scales="block",
                                scale_dtype=torch.bfloat16, suffix="weight_scale_inv", quant=DYNAMIC_FP8,
                                prefix="model.layers", proj=("gate_proj", "up_proj", "down_proj"), module="mlp",
                                preset="qwen3_moe"),
    "qwen3_moe-compressed-tensors": dict(config=qwen3_config, block=qwen3_block, dims=(64, 32, 8, 2),
                                         scales="channel", suffix="weight_scale", quant=COMPRESSED_TENSORS,
                                         prefix="model.layers", proj=("gate_proj", "up_proj", "down_proj"),
                                         module="mlp", preset="qwen3_moe"),
    "qwen3_vl_moe-block-fp8": dict(config=qwen3_config, block=qwen3_block, dims=(256, 128, 8, 2), scales="block",
                                   suffix="weight_scale_inv", quant=DYNAMIC_FP8, prefix="model.language_model.layers",
                                   proj=("gate_proj", "up_proj", "down_proj"), module="mlp", wrapper="qwen3_vl_moe",
                                   preset="qwen3_moe", tensor_prefix="model.language_model."),
    "deepseek_v3-block-fp8": dict(config=deepseek_config, block=deepseek_block, dims=(256, 256, 16, 4),
                                  scales="block", suffix="weight_scale_inv", quant=DYNAMIC_FP8, prefix="model.layers",
                                  proj=("gate_proj", "up_proj", "down_proj"), module="mlp", bias=True,
                                  preset="deepseek_v3"),
    "qwen3_next-block-fp8": dict(config=qwen3_next_config, block=qwen3_next_block, dims=(256, 256, 16, 4),
                                 scales="block", scale_dtype=torch.bfloat16, suffix="weight_scale_inv",
                                 quant=DYNAMIC_FP8, prefix="model.layers", proj=("gate_proj", "up_proj", "down_proj"),
                                 module="mlp", preset="qwen3_moe"),
    "glm4_moe-block-fp8": dict(config=glm4_moe_config, block=glm4_moe_block, dims=(256, 256, 16, 4),
                               scales="block", suffix="weight_scale_inv", quant=DYNAMIC_FP8, prefix="model.layers",
                               proj=("gate_proj", "up_proj", "down_proj"), module="mlp", bias=True,
                               preset="deepseek_v3"),
    "mixtral-fp8-static": dict(config=mixtral_config, block=mixtral_block, dims=(64, 32, 8, 2), scales="tensor",
                               suffix="weight_scale", static=True, quant=AUTOFP8, prefix="model.layers",
                               proj=("w1", "w3", "w2"), module="block_sparse_moe", preset="mixtral"),
    "nemotron_h-bf16": dict(config=nemotron_config, block=nemotron_block, dims=(64, 32, 8, 2), scales=None,
                            dtype=torch.bfloat16, prefix="backbone.layers", proj=(None, "up_proj", "down_proj"),
                            module="mixer", bias=True, preset="nemotron_h"),
    "qwen3_moe-bf16": dict(config=qwen3_config, block=qwen3_block, dims=(64, 32, 8, 2), scales=None,
                           dtype=torch.bfloat16, prefix="model.layers", proj=("gate_proj", "up_proj", "down_proj"),
                           module="mlp", preset="qwen3_moe"),
    "qwen3_moe-fp16-block": dict(config=qwen3_config, block=qwen3_block, dims=(256, 192, 8, 2), scales=None,
                                 dtype=torch.float16, weight_quantization="block", prefix="model.layers",
                                 proj=("gate_proj", "up_proj", "down_proj"), module="mlp", preset="qwen3_moe"),
    "deepseek_v3-bf16-block": dict(config=deepseek_config, block=deepseek_block, dims=(256, 256, 16, 4), scales=None,
                                   dtype=torch.bfloat16, weight_quantization="block", prefix="model.layers",
                                   proj=("gate_proj", "up_proj", "down_proj"), module="mlp", bias=True,
                                   preset="deepseek_v3"),
    "gpt_oss-bf16": dict(config=gpt_oss_config, block=gpt_oss_block, dims=(64, 32, 8, 2), scales=None,
                         dtype=torch.bfloat16, prefix="model.layers", module="mlp", stacked=True, preset="gpt_oss",
                         activation=expertd.pb.ACTIVATION_SWIGLU_OAI),
    "gpt_oss-bf16-block": dict(config=gpt_oss_config, block=gpt_oss_block, dims=(256, 128, 8, 4), scales=None,
                               dtype=torch.bfloat16, weight_quantization="block", prefix="model.layers", module="mlp",
                               stacked=True, preset="gpt_oss", activation=expertd.pb.ACTIVATION_SWIGLU_OAI),
    "mixtral-bf16-per-tensor": dict(config=mixtral_config, block=mixtral_block, dims=(64, 32, 8, 2), scales=None,
                                    dtype=torch.bfloat16, weight_quantization="per_tensor", prefix="model.layers",
                                    proj=("w1", "w3", "w2"), module="block_sparse_moe", preset="mixtral"),
}


# The blocks' shared-expert modules (DeepSeek-V3 and GLM-4.5's, Qwen3-Next's).
SHARED_EXPERTS = ("shared_experts", "shared_expert")


def _router(block):
    """The block's router: gate, or GptOssMLP's router."""
    return getattr(block, "gate", None) or block.router


def _init(block, g):
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        gate = _router(block)
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(torch.rand(gate.e_score_correction_bias.shape, generator=g) * 0.1)


def _experts(block):
    """(up weights [E, rows, K] with gate rows first, down [E, K, N],
    gated) of the block's fused expert parameters."""
    ex = block.experts
    gu = getattr(ex, "gate_up_proj", None)
    return (gu if gu is not None else ex.up_proj), ex.down_proj, gu is not None


QUANT = {"tensor": quant_tensor, "channel": quant_channel, "block": quant_block}


def _expert_parts(case, up, down, x, gated):
    """Expert x's (projection name, weight) pairs as the checkpoint names
    them."""
    n = case["dims"][1]
    gate_name, up_name, down_name = case["proj"]
    parts = [(gate_name, up[x, :n]), (up_name, up[x, n:])] if gated else [(up_name, up[x])]
    return parts + [(down_name, down[x])]


def _stacked_layer(block, case, layer):
    """GptOssExperts' parameters as its BF16 release stores them (under
    their own names, biases included, in the case's dtype); the block's
    are rounded to it."""
    base = f"{case['prefix']}.{layer}.{case['module']}"
    ts = {}
    with torch.no_grad():
        for pname, p in block.experts.named_parameters():
            p.copy_(p.to(case["dtype"]).float())
            ts[f"{base}.experts.{pname}"] = p.detach().to(case["dtype"]).contiguous()
        for pname, p in block.router.named_parameters():
            ts[f"{base}.router.{pname}"] = p.detach().to(torch.bfloat16).contiguous()
    return ts


def _half_layer(block, case, layer):
    """The layer's expert tensors in the case's 16-bit dtype; the block's
    expert weights are rounded to it."""
    if case.get("stacked"):
        return _stacked_layer(block, case, layer)
    base = f"{case['prefix']}.{layer}.{case['module']}"
    up, down, gated = _experts(block)
    ts = {}
    with torch.no_grad():
        up.copy_(up.to(case["dtype"]).float())
        down.copy_(down.to(case["dtype"]).float())
        for x in range(case["dims"][2]):
            for pname, w in _expert_parts(case, up, down, x, gated):
                ts[f"{base}.experts.{x}.{pname}.weight"] = w.to(case["dtype"]).contiguous()
    _router_and_shared(block, case, base, ts)
    return ts


def fp8_block(block, case):
    """A copy of the block with its experts' weights as the daemon quantizes
    a 16-bit checkpoint at the case's weight_quantization, dequantized: per
    expert and matrix, the gate and up rows stacked as one."""
    form = HALF_GRANULARITY[case.get("weight_quantization") or "per_channel"][1]
    b = copy.deepcopy(block)
    up, down, _ = _experts(b)
    with torch.no_grad():
        for w in [*up, *down]:
            # GptOssExperts holds each matrix input-major ([K, 2N], [N,
            # K]); the daemon quantizes its transpose, output rows first.
            m = w.T if case.get("stacked") else w
            codes, s = QUANT[form](m.float())
            m.copy_(dequant(codes, s, form))
    return b


def _router_and_shared(block, case, base, ts):
    """Adds what the layer holds besides its experts: the router, its
    correction bias and the shared experts, in BF16 as releases keep them."""
    with torch.no_grad():
        ts[f"{base}.gate.weight"] = block.gate.weight.detach().to(torch.bfloat16).contiguous()
        if case.get("bias"):
            ts[f"{base}.gate.e_score_correction_bias"] = block.gate.e_score_correction_bias.detach().float().clone()
        for attr in SHARED_EXPERTS:
            shared = getattr(block, attr, None)
            if shared is not None:
                for pname, t in shared.state_dict().items():
                    ts[f"{base}.{attr}.{pname}"] = t.detach().to(torch.bfloat16).contiguous()


def _quantize_layer(block, case, layer):
    """The layer's expert tensors as the release stores them; the block's
    expert weights are replaced by their dequantized values."""
    if case["scales"] is None:
        return _half_layer(block, case, layer)
    e = case["dims"][2]
    quant = QUANT[case["scales"]]
    sdt = case.get("scale_dtype", torch.float32)
    base = f"{case['prefix']}.{layer}.{case['module']}"
    up, down, gated = _experts(block)
    ts = {}
    with torch.no_grad():
        for x in range(e):
            deq = []
            for pname, w in _expert_parts(case, up, down, x, gated):
                codes, s = quant(w.float())
                s = s.to(sdt)
                p = f"{base}.experts.{x}.{pname}"
                ts[p + ".weight"] = codes.contiguous()
                ts[p + "." + case["suffix"]] = s.contiguous()
                deq.append(dequant(codes, s, case["scales"]))
            up[x].copy_(torch.cat(deq[:-1]))
            down[x].copy_(deq[-1])
    _router_and_shared(block, case, base, ts)
    return ts


def _input_scales(ts, case, layer, a13, a2):
    """Static per-expert input scales, one scalar per projection, as
    ModelOpt and AutoFP8 write them."""
    base = f"{case['prefix']}.{layer}.{case['module']}.experts"
    gate_name, up_name, down_name = case["proj"]
    for x in range(len(a13)):
        for pname in (gate_name, up_name):
            if pname is not None:
                ts[f"{base}.{x}.{pname}.input_scale"] = a13[x].reshape(()).clone()
        ts[f"{base}.{x}.{down_name}.input_scale"] = a2[x].reshape(()).clone()


def _calibrated(amax, e, g):
    """Per-expert scales as a calibration gives them: amax / 448 for the
    expert that saw the largest value, less for the others."""
    s = (torch.rand(e, generator=g) * 0.5 + 0.5) * amax / FP8_MAX
    s[int(torch.randint(e, (1,), generator=g))] = amax / FP8_MAX
    return s


def _write_checkpoint(d, cfg, case, tensors, max_shard_size="48KB"):
    huggingface_hub.save_torch_state_dict(tensors, d, max_shard_size=max_shard_size)
    cfg.save_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        conf = json.load(f)
    conf.pop("_experts_implementation", None)
    if case.get("quant"):
        conf["quantization_config"] = case["quant"]
    if case.get("wrapper"):
        # Multimodal release: the language model's fields in text_config.
        conf["model_type"] = case["wrapper"] + "_text"
        conf = {"model_type": case["wrapper"], "architectures": ["Qwen3VLMoeForConditionalGeneration"],
                "text_config": conf, "vision_config": {"depth": 2},
                "quantization_config": conf.pop("quantization_config")}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    index = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index):
        # Tensors that fit one shard are one model.safetensors, without
        # an index.
        return {name: "model.safetensors" for name in tensors}
    with open(index) as f:
        return json.load(f)["weight_map"]


def make_case(case_name, g):
    """Builds the case's block and the second layer's, quantizes them as
    the release stores them (the blocks keep the dequantized weights) and
    makes a batch on the FP8 grid. Returns (config, block, the layer's
    tensors, the other layer's tensors, batch, the quantization of the
    experts' input, that of the down projections' input)."""
    case = CASES[case_name]
    k, n, e, top_k = case["dims"]
    cfg = case["config"](k, n, e, top_k)
    block = case["block"](cfg).float().eval()
    other = case["block"](cfg).float().eval()
    _init(block, g)
    _init(other, g)
    ts = _quantize_layer(block, case, LAYER)
    ts_other = _quantize_layer(other, case, OTHER_LAYER)
    for attr in SHARED_EXPERTS:
        # The caller runs the shared expert, not the daemon.
        if getattr(block, attr, None) is not None:
            setattr(block, attr, _Zero())

    x = torch.randn(M, k, generator=g) * 0.5
    if case.get("static"):
        s13 = _calibrated(x.abs().max(), e, g)
        x = act_static(x, s13.max())
        seen = []

        def record(t):
            seen.append(t.abs().max())
            return t

        # The intermediate's scale is calibrated on the same batch.
        with torch.no_grad(), quantized_expert_inputs(block.experts, lambda t: t, record):
            block(x.unsqueeze(0))
        s2 = _calibrated(torch.stack(seen).max(), e, g)
        _input_scales(ts, case, LAYER, s13, s2)
        # The other layer's scales are larger: a load that mixed them in
        # would quantize with them.
        _input_scales(ts_other, case, OTHER_LAYER, s13 * 4, s2 * 4)

        def q_in(t):
            return act_static(t, s13.max())

        def q_mid(t):
            return act_static(t, s2.max())
    else:
        block_weights = case["scales"] == "block" or case.get("weight_quantization") == "block"
        group = 128 if block_weights else None

        def q_in(t):
            return act_dynamic(t, group or t.shape[1])

        q_mid = q_in
        x = q_in(x)  # on the FP8 grid, so the daemon's quantization of it is exact
    return cfg, block, ts, ts_other, x, q_in, q_mid


def _forward(block, x):
    """The block's output for the tokens x (GptOssMLP also returns its
    router scores)."""
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


@pytest.mark.parametrize("how", ["auto", "preset"])
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_checkpoint_matches_transformers(client, case_name, how):
    root = os.environ.get("EXPERTD_WEIGHTS_DIR")
    if not root:
        pytest.skip("EXPERTD_WEIGHTS_DIR names the daemon's -weights-dir")
    case = CASES[case_name]
    k, n, e, top_k = case["dims"]
    seed = int(os.environ.get("EXPERTD_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed} (EXPERTD_TEST_SEED={seed} repeats it)")
    g = torch.Generator().manual_seed(seed)
    cfg, block, ts, ts_other, x, q_in, q_mid = make_case(case_name, g)

    d = tempfile.mkdtemp(prefix=f"hf-{case_name}-{how}-", dir=root)
    name = os.path.basename(d)
    weight_map = _write_checkpoint(d, cfg, case, {**ts_other, **ts})
    layer_shards = {weight_map[t] for t in ts}
    assert len(layer_shards) >= 2, f"the layer is in {layer_shards}: want it across shards"

    fields = {"tensor_prefix": case.get("tensor_prefix", "")} if how == "preset" else {}
    if case.get("weight_quantization"):
        fields["weight_quantization"] = case["weight_quantization"]
    preset = "auto" if how == "auto" else case["preset"]
    act = case.get("activation")
    if act is not None and act not in client.server_info().backends[0].activations:
        # The serving backend (cuda) refuses the set, as its BackendInfo
        # says it would.
        with pytest.raises(expertd.FailedPreconditionError):
            client.load_safetensors(name, name, layer=LAYER, preset=preset, **fields)
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip(f"the daemon's backend does not run {expertd.pb.Activation.Name(act)}")
    info = client.load_safetensors(name, name, layer=LAYER, preset=preset, **fields)
    try:
        assert (info.num_experts, info.hidden_size, info.intermediate_size) == (e, k, n), info
        rt = info.routing
        assert rt.top_k == top_k, rt
        assert info.static_a13_scale == bool(case.get("static")), info
        half = case["scales"] is None
        if half:
            granularity = HALF_GRANULARITY[case.get("weight_quantization") or "per_channel"][0]
            assert (info.w13_scale_granularity, info.w2_scale_granularity) == (granularity, granularity), info
            with torch.no_grad(), quantized_expert_inputs(block.experts, q_in, q_mid):
                want_half = _forward(block, x)
            block = fp8_block(block, case)
        with torch.no_grad(), quantized_expert_inputs(block.experts, q_in, q_mid):
            want = _forward(block, x)
        router = _router(block)
        logits = torch.nn.functional.linear(x, router.weight.float(), getattr(router, "bias", None))
        res = client.fused_moe(x, expert_set=name, router_logits=logits, routing_message=rt, output_dtype="float32")
        got = res.output
        assert got.shape == want.shape and not torch.isnan(got).any()
        rel = (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item()
        print(f"{case_name} ({how}) on {res.response.backend}: rel L2 {rel:.2e}")
        if half:
            rel_half = (torch.linalg.norm(got - want_half) / torch.linalg.norm(want_half)).item()
            print(f"{case_name} ({how}): rel L2 {rel_half:.2e} against the {case['dtype']} weights")
            assert rel_half <= HALF_BAR, f"{case_name} ({how}): rel L2 {rel_half:.4f} against the 16-bit block"
        assert rel <= 2e-2, f"{case_name} ({how}): rel L2 {rel:.4f}"
        if res.response.backend == "cpu":
            # The reference quantizes as the CPU backend does: only float32
            # summation order separates them, which now and then moves an
            # intermediate value across an FP8 rounding boundary (one
            # such flip costs ~5e-4 here); a wrong scale costs far more.
            assert rel <= 5e-3, f"{case_name} ({how}) on the cpu backend: rel L2 {rel:.2e}"
    finally:
        client.unload_experts(name)
        shutil.rmtree(d, ignore_errors=True)
