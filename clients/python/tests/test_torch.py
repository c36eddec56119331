"""expertd.torch.RemoteMoE against transformers' own MoE blocks: small
random Qwen3-MoE, Mixtral, DeepSeek-V3 and Nemotron-H blocks built from
config (no download), their expert weights rounded to FP8 with per-channel
scales (so both sides use the same dequantized weights), served through the
daemon and compared with the block's forward (rel L2 <= 2e-2).

The daemon quantizes activations to FP8 per token; the reference does the
same, on the block's input and on its down projections' input, so the
comparison measures the service and not FP8 itself. Needs torch and
transformers (skips without them, fails with EXPERTD_REQUIRE_TORCH=1); EXPERTD_CUDA=1 also runs the blocks on
the GPU, where RemoteMoE picks CUDA IPC.
"""

import os

import pytest

import needs
from hfref import act_dynamic, quantized_expert_inputs

torch = needs.module("torch")
transformers = needs.module("transformers")

import expertd  # noqa: E402
import expertd.torch as et  # noqa: E402

K, N, E, TOPK, M = 64, 32, 8, 2, 12


def fp8_rows(x):
    """Per-row FP8 round trip (amax / 448), as the daemon quantizes."""
    codes, scale = et.quantize_fp8_rows(x)
    return et.dequantize_fp8_rows(codes, scale).to(x.dtype)


def _round_trip_experts(block):
    """Rounds the routed experts' weights to FP8 per output channel, in
    place, whatever the storage layout."""
    experts = block.experts
    with torch.no_grad():
        if isinstance(experts, torch.nn.ModuleList):
            for mlp in experts:
                for lin in mlp.children():
                    if isinstance(lin, torch.nn.Linear):
                        lin.weight.copy_(fp8_rows(lin.weight))
            return
        for pname in ("gate_up_proj", "up_proj", "down_proj"):
            p = getattr(experts, pname, None)
            if not isinstance(p, torch.Tensor):
                continue
            rows_last = (p.shape[-1] == K) if pname != "down_proj" else (p.shape[1] == K)
            if rows_last:
                p.copy_(fp8_rows(p))
            else:
                p.copy_(fp8_rows(p.transpose(1, 2)).transpose(1, 2))


def _init(block):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        for name, b in block.named_buffers():
            if "bias" in name:
                b.copy_(torch.rand(b.shape, generator=g) * 0.1)


def _eager(config):
    # Blocks built outside a PreTrainedModel have no experts implementation
    # chosen; eager is the loop over nn.functional.linear the reference
    # hooks.
    config._experts_implementation = "eager"
    return config


def qwen3():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = _eager(Qwen3MoeConfig(hidden_size=K, moe_intermediate_size=N, intermediate_size=4 * K, num_experts=E,
                                num_experts_per_tok=TOPK, norm_topk_prob=True, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64))
    return Qwen3MoeSparseMoeBlock(cfg), cfg


def mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = _eager(MixtralConfig(hidden_size=K, intermediate_size=N, num_local_experts=E, num_experts_per_tok=TOPK,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    return MixtralSparseMoeBlock(cfg), cfg


def deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    cfg = _eager(DeepseekV3Config(hidden_size=K, moe_intermediate_size=N, intermediate_size=4 * K, n_routed_experts=E,
                                  num_experts_per_tok=TOPK, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, n_shared_experts=2, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, vocab_size=64, first_k_dense_replace=0))
    return DeepseekV3MoE(cfg), cfg


def nemotron_h():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h import modeling_nemotron_h as mod
    cls = next((getattr(mod, n) for n in ("NemotronHMOE", "NemotronHMoE") if hasattr(mod, n)), None)
    if cls is None:
        pytest.skip("this transformers has no NemotronH MoE block")
    cfg = _eager(NemotronHConfig(hidden_size=K, moe_intermediate_size=N, n_routed_experts=E, num_experts_per_tok=TOPK,
                                 n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 moe_shared_expert_intermediate_size=2 * N, mlp_hidden_act="relu2",
                                 layers_block_type=["moe"], vocab_size=64))
    try:
        return cls(cfg, layer_idx=0), cfg
    except TypeError:
        return cls(cfg), cfg


BLOCKS = {"qwen3": qwen3, "mixtral": mixtral, "deepseek_v3": deepseek_v3, "nemotron_h": nemotron_h}


def _out(y):
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_remote_moe_matches_transformers(client, kind, device):
    if device == "cuda" and (os.environ.get("EXPERTD_CUDA") != "1" or not torch.cuda.is_available()):
        pytest.skip("needs a GPU and a cuda-backend daemon on it (EXPERTD_CUDA=1)")
    block, cfg = BLOCKS[kind]()
    block = block.float().eval()
    _init(block)
    _round_trip_experts(block)
    remote = et.RemoteMoE.from_hf(block, client, f"pytest-torch-{kind}", config=cfg)
    try:
        block.to(device)
        remote.to(device)
        x = fp8_rows(torch.randn(M, K) / 2).to(device)
        # Through CUDA IPC RemoteMoE sends the hidden states as BF16, whose
        # per-token FP8 scales differ from the float32 ones: the reference
        # quantizes what the daemon receives.
        sent = x.to(torch.bfloat16).float() if device == "cuda" else x
        per_token = lambda t: act_dynamic(t, t.shape[1])  # noqa: E731
        with torch.no_grad(), quantized_expert_inputs(block.experts, per_token, per_token):
            want = _out(block(sent.unsqueeze(0))).squeeze(0)
        with torch.no_grad():
            got = _out(remote(x.unsqueeze(0))).squeeze(0)
        assert got.shape == want.shape and got.device == want.device
        # On the GPU the default path is CUDA IPC (through a ring if the
        # daemon serves one).
        assert device == "cpu" or remote.path.endswith("cuda_ipc"), remote.path
        rel = (torch.linalg.norm(got.float() - want.float()) / torch.linalg.norm(want.float())).item()
        assert rel <= 2e-2, f"{kind} on {device}: rel L2 {rel:.4f}"
    finally:
        remote.close()
        client.unload_experts(f"pytest-torch-{kind}")
