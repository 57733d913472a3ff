"""GPT for AION: RMSNorm, rotary positions, grouped-query attention with QK-norm, ReLU^2 or
SwiGLU MLP, optional tied embeddings, logit soft-cap, zero-initialised output projections.

Shapes in comments: B batch, T sequence, C = n_embd, H heads, K kv heads, D = C // H, V vocab.
The model config is any object with the attributes of the `model` section of configs/base.yaml.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):  # x: (B, H, T, D) -> same, rotated by position
        t = torch.arange(x.size(-2), device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # (T, D/2)
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0 and cfg.n_head % cfg.n_kv_head == 0
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_kv = nn.Linear(cfg.n_embd, 2 * kv_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj.zero_init = True
        # QK-norm makes q.k bounded, so a learned per-head gain sets the attention temperature.
        self.q_gain = nn.Parameter(torch.full((self.n_head,), cfg.qk_gain_init))
        self.rotary = Rotary(self.head_dim, cfg.rope_base)

    def forward(self, x):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k, v = self.c_kv(x).view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, K, T, D)
        q, k = self.rotary(rms_norm(q)), self.rotary(rms_norm(k))
        q = q * self.q_gain.to(q.dtype)[None, :, None, None]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.mlp_mult * cfg.n_embd
        self.swiglu = cfg.mlp == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.c_proj.zero_init = True

    def forward(self, x):
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.c_proj(F.silu(gate) * up)
        return self.c_proj(F.relu(h).square())


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(rms_norm(x))
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        # Tied embeddings double as the output layer, so they start small (logits near uniform).
        nn.init.normal_(self.wte.weight, std=self.cfg.embed_init_std)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if getattr(m, "zero_init", False) or m is self.lm_head:
                    nn.init.zeros_(m.weight)  # each residual branch and the head start as no-ops
                else:
                    nn.init.normal_(m.weight, std=m.in_features ** -0.5)

    def forward(self, idx):
        """idx: (B, T) int64 -> logits (B, T, V) fp32; position t sees only idx[:, :t+1]."""
        x = rms_norm(self.wte(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = rms_norm(x)
        logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight).float()
        cap = self.cfg.logit_softcap
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)  # bounded logits keep early training stable
        return logits

    def loss(self, idx, targets, reduction="mean"):
        """Cross-entropy in nats of targets (B, T); reduction="sum" for evaluation sums."""
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction=reduction)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward, a multiply-add = 2 FLOPs).
    Counts every matmul: q, kv, attention output and MLP projections, the output head, and
    causal attention itself (QK^T and AV: 2 x 2 x C per key, T/2 keys on average). Embedding
    lookups, norms and elementwise work are not counted."""
    C, L = cfg.n_embd, cfg.n_layer
    kv_dim = cfg.n_kv_head * (C // cfg.n_head)
    hidden = cfg.mlp_mult * C
    mlp_in = (2 if cfg.mlp == "swiglu" else 1) * hidden
    matmul_params = L * (C * C + C * 2 * kv_dim + C * C + C * mlp_in + hidden * C) + C * cfg.vocab_size
    attention = L * 2 * 2 * C * seq_len / 2
    return 3 * (2 * matmul_params + attention)
