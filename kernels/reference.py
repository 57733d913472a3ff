"""The plain-torch definition of every fused op: what model.py computed before kernels/ existed,
and what every Triton and NKI implementation is checked against (values and gradients).

Shapes: N tokens (rows), C = n_embd, V vocab, B batch, H heads, T sequence, D head dim.
"""

import torch
import torch.nn.functional as F


def head_nll(x, weight, targets, softcap):
    """The output head with its logit soft-cap and cross-entropy.

    x (N, C) final-normed activations; weight (V, C) the output head (the tied embedding);
    targets (N,) int64; softcap float, 0 = off. -> (N,) float32 next-token NLL in nats.
    Training takes .mean(), evaluation the per-token sums."""
    logits = F.linear(x, weight).float()  # (N, V)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)  # bounded logits keep early training stable
    return F.cross_entropy(logits, targets, reduction="none")


def rms_norm(x):
    """RMSNorm over the last dim, no weight, eps = torch.finfo(x.dtype).eps (F.rms_norm's default).
    x (..., C) -> (..., C) in x's dtype."""
    return F.rms_norm(x, (x.size(-1),))


def qk_norm_rope(x, cos, sin, gain=None):
    """QK-norm then rotary positions, for queries (with their per-head gain) and keys (gain None).

    x (B, H, T, D); cos, sin (T, D/2) or (B, 1, T, D/2) (routed tiles keep their own positions),
    already in x's dtype; gain (H,) or None. -> (B, H, T, D) in x's dtype. The gain is cast to
    x's dtype first, so a bf16 x stays bf16 under autocast."""
    x1, x2 = rms_norm(x).chunk(2, dim=-1)
    out = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
    return out if gain is None else out * gain.to(out.dtype)[None, :, None, None]


def relu2(x):
    """The ReLU^2 MLP activation: relu(x)^2, elementwise, in x's dtype."""
    return F.relu(x).square()
