"""The FP8 activation quantization the daemon applies, for references
built on transformers' MoE blocks (test_torch.py, test_hf_checkpoint.py)."""

import contextlib

import needs

torch = needs.module("torch")

FP8_MAX = 448.0


def fp8_round(x):
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def act_dynamic(x, group):
    """Per token (group = width) or per (token, group) amax / 448; the
    last group of a row may be short, as the daemon's are."""
    out = torch.empty_like(x)
    for lo in range(0, x.shape[1], group):
        g = x[:, lo:lo + group]
        s = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-10)
        out[:, lo:lo + group] = fp8_round(g / s) * s
    return out


def act_static(x, s):
    return fp8_round(x / s) * s


@contextlib.contextmanager
def quantized_expert_inputs(experts, q_in, q_mid):
    """Quantizes the input of every linear whose weight lies in the routed
    experts' parameters: q_in before the gate/up (or up) projection, q_mid
    before the down projection (GptOssExperts: its input and its gated
    intermediate). Other linears (router, shared experts) are left alone."""
    if isinstance(experts, torch.nn.ModuleList):  # one MLP module per expert
        down = [m.w2.weight if hasattr(m, "w2") else m.down_proj.weight for m in experts]
        up = [p for m in experts for n, p in m.named_parameters() if p is not None and
              not any(p is d for d in down)]
    else:  # fused [E, rows, cols] parameters
        up = [experts.gate_up_proj if getattr(experts, "gate_up_proj", None) is not None else experts.up_proj]
        down = [experts.down_proj]

    def inside(w, ps):
        return any(p.data_ptr() <= w.data_ptr() < p.data_ptr() + p.numel() * p.element_size() for p in ps)

    orig = torch.nn.functional.linear

    def linear(x, w, b=None):
        if inside(w, up):
            x = q_in(x)
        elif inside(w, down):
            x = q_mid(x)
        return orig(x, w, b)

    # GptOssExperts (input-major, "transposed" parameters) multiplies with
    # @, not linear: its input is quantized as it enters the module, the
    # intermediate as _apply_gate returns it.
    stacked = getattr(experts, "is_transposed", False)
    if stacked:
        pre = experts.register_forward_pre_hook(lambda m, args: (q_in(args[0]), *args[1:]))
        gate = experts._apply_gate
        experts._apply_gate = lambda gate_up: q_mid(gate(gate_up))
    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = orig
        if stacked:
            pre.remove()
            del experts._apply_gate


