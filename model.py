"""GPT for AION: RMSNorm, rotary positions, grouped-query attention with QK-norm, ReLU^2 or
SwiGLU MLP, optional tied embeddings, logit soft-cap, zero-initialised output projections,
optional Mixture-of-Depths routing of chosen layers by tile, token, layer or micro-batch, and optional
speedrun-style additions (value embeddings, an embedding shortcut, a hashed bigram table, U-net
skips), the parameter-golf records' items of April 2026 (attention within documents, SmearGate,
attention-output gates, partial RoPE, layer-scaled norms, sigmoid skip gates, XSA, a two-lane
parallel decoder), the competition lineage's levers (FrontierForge K82s4: the LeakyReLU slope, a fixed
query gain, the key offset on slow rotary pairs, attention-source reuse), and depth recursion: a span
of the active layers looped with shared weights, each extra pass optionally gated and routed per tile
or token (Mixture-of-Recursions). The hot ops (the head with its loss, the RMSNorms, QK-norm with
rotary, ReLU^2) are called through a kernels.Kernels (the config section `kernels`); the default is
their plain-torch reference.

Shapes in comments: B batch, T sequence, C = n_embd, H heads, K kv heads, D = C // H, V vocab,
n = T // block_size tiles, k selected units. The model config is any object with the attributes
of the `model` section of configs/base.yaml; the routing config (`mod`) one with granularity,
layers, block_size, capacity, aux_weight and recur.
"""

import functools
import math
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import REFERENCE
from kernels.reference import rms_norm


def rotary_frequencies(head_dim, base, rotated=None):
    """-> (head_dim/2,) float32: the angle per position of each rotary pair. Pair i is the head's
    dimensions i and i + head_dim/2 (kernels.qk_norm_rope's halves). rotated: the head dimensions
    that rotate (partial RoPE, parameter-golf records from 2026-03: 16 of 64), with the frequencies
    of a rotated-wide head; the other pairs get frequency 0."""
    rotated = rotated or head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, rotated, 2, dtype=torch.float32) / rotated))
    return torch.cat((inv_freq, torch.zeros((head_dim - rotated) // 2)))


def slow_pairs(cfg, seq_len: int):
    """model.key_offset: the rotary pairs of a head that turn less than the radius cfg.key_offset
    over a training row of seq_len tokens, inv_freq_i * (seq_len - 1) < radius -> (head_dim/2,) bool.
    Pairs that do not rotate (partial RoPE) turn 0 and count as slow: the rule as FrontierForge
    K82s4 states it (recipes/K82s4/train.py, key_offset_mask; it has no such pairs)."""
    head_dim = cfg.n_embd // cfg.n_head
    return rotary_frequencies(head_dim, cfg.rope_base, rotated_dims(cfg)) * (seq_len - 1) < cfg.key_offset


class Rotary(nn.Module):
    """rotary_frequencies as a buffer; pairs of frequency 0 get cos 1 and sin 0, the identity, so
    every qk_norm_rope kernel serves partial RoPE unchanged. (Which dimensions pair up is arbitrary:
    the projections before it learn any permutation.)"""

    def __init__(self, head_dim, base, rotated=None):
        super().__init__()
        self.register_buffer("inv_freq", rotary_frequencies(head_dim, base, rotated), persistent=False)

    def forward(self, x, pos=None):
        """x: (B, H, T, D), pos: (B, T) or None = 0..T-1 -> cos, sin in x's dtype, (T, D/2) or
        (B, 1, T, D/2): the rotation kernels.qk_norm_rope applies."""
        t = torch.arange(x.size(-2), device=x.device) if pos is None else pos[:, None]  # (T,) or (B, 1, T)
        freqs = t.float()[..., None] * self.inv_freq  # (T, D/2) or (B, 1, T, D/2)
        return freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, kernels, value_embed=False, seq_len=None):
        """seq_len: the training rows' length (data.seq_len), which model.key_offset's slow pairs are counted over."""
        super().__init__()
        self.kernels = kernels
        assert cfg.n_embd % cfg.n_head == 0 and cfg.n_head % cfg.n_kv_head == 0
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_kv = nn.Linear(cfg.n_embd, 2 * kv_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj.zero_init = True
        # QK-norm makes q.k bounded, so a learned per-head gain sets the attention temperature; with
        # model.qk_gain_learned=false it is the constant qk_gain_init (K82s4's 1.44), rebuilt from the config.
        gain = torch.full((self.n_head,), cfg.qk_gain_init)
        if cfg.qk_gain_learned:
            self.q_gain = nn.Parameter(gain)
        else:
            self.register_buffer("q_gain", gain, persistent=False)
        self.rotary = Rotary(self.head_dim, cfg.rope_base, rotated_dims(cfg))
        # model.key_offset: the key dimensions of the slow pairs, which take an earlier token's (offset_keys).
        # Fixed by the training rows' length, so evaluation on longer rows splices the same dimensions.
        if cfg.key_offset:
            assert seq_len, "model.key_offset counts slow pairs over the training rows: GPT needs seq_len"
            self.register_buffer("slow", slow_pairs(cfg, seq_len).repeat(2), persistent=False)
        else:
            self.slow = None
        # The learned weight of the value embedding added to v (modded-nanogpt's lambda); model.value_embed_ends:
        # the lineage's a * v + b * ve, both from 0.5 (K82s4's ve_a and ve_b), one ve per query head.
        self.ve_ends = value_embed and cfg.value_embed_ends
        if value_embed:
            self.ve_gate = nn.Parameter(torch.full((), 0.5 if self.ve_ends else 1.0))
        if self.ve_ends:
            self.ve_keep = nn.Parameter(torch.full((), 0.5))
        # model.attn_gate: each head's output times sigmoid(scale * w_h . x[:width]) of the attention's
        # input x, w zero-initialised (every gate 0.5 at the start); dense reads all of x, sparse
        # its first gate_window dimensions (parameter-golf records 2026-04-19 and 2026-04-23).
        self.gate = nn.Parameter(torch.zeros(self.n_head, gate_width(cfg))) if gate_width(cfg) else None
        self.gate_scale = cfg.attn_gate_scale
        self.float32_core = False  # the SDPA core in float32 whatever the compute dtype (GPT's attn_float32)
        self.xsa = False  # exclusive self-attention (model.xsa_layers; set by GPT.set_active)

    def forward(self, x, pos=None, mask=None, ve=None, doc=None):
        """pos: (B, T) token positions (routed tiles keep their original ones); mask: (B, 1, T, T)
        bool, True = may attend, replacing the causal mask; ve: (B, T, K*D) value embeddings of
        the tokens, or None; doc: (B, T) document index of each token, or None: a query attends
        only to keys of its own document (within-document attention)."""
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k, v = self.c_kv(x).view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, K, T, D)
        if ve is not None and self.ve_ends:  # a value per query head: keys and values widened to every head
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            v = self.ve_keep * v + self.ve_gate * ve.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        elif ve is not None:
            v = v + self.ve_gate * ve.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(q, pos)
        q, k = self.kernels.qk_norm_rope(q, cos, sin, self.q_gain), self.kernels.qk_norm_rope(k, cos, sin)
        if doc is not None:  # a static (B, 1, T, T) mask from the data: no data-dependent shape
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if mask is None else mask
            mask = causal & (doc[:, None, :, None] == doc[:, None, None, :])
        if self.slow is not None:
            k = self.offset_keys(k, mask)
        if self.float32_core:
            with torch.autocast(x.device.type, enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=mask is None,
                                                   enable_gqa=k.size(1) != self.n_head).to(v.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=k.size(1) != self.n_head)
        if self.xsa:  # XSA (parameter-golf records from 2026-03-20): drop each output's component along its own value
            heads = y.view(B, v.size(1), self.n_head // v.size(1), T, self.head_dim)
            unit = F.normalize(v, dim=-1)[:, :, None]  # (B, K, 1, T, D), or K = H with value_embed_ends
            y = (heads - (heads * unit).sum(-1, keepdim=True) * unit).view_as(y)
        if self.gate is not None:
            gate = torch.sigmoid(self.gate_scale * F.linear(x[..., :self.gate.size(1)], self.gate))  # (B, T, H)
            y = y * gate.transpose(1, 2)[..., None]
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    def offset_keys(self, k, mask):
        """model.key_offset (FrontierForge K82s4, recipes/K82s4/train.py, CausalSelfAttention.forward;
        -0.0013 val_bpb in its docs/FINDINGS.md section 1): the slow dimensions of each key (normed and
        rotated) become those of the key before it, so a nearly position-free subspace of every key
        carries the previous token: an induction feature without parameters. k: (B, K, T, D).
        "Before it" is the latest earlier key its own query may attend to (mask (B, 1, T, T), or
        causal): the previous token; within documents none at a document's first token, which keeps
        its own key; in a routed layer's evaluation (TileRouter.masked) the previous routed token,
        as its training (gathered tiles, where that is the previous token of the sequence) has it.
        The first position keeps its own key."""
        if mask is None:
            earlier = torch.cat((k[:, :, :1], k[:, :, :-1]), dim=2)
        else:
            T = k.size(2)
            t = torch.arange(T, device=k.device)
            seen = mask & (t[:, None] > t)  # (B, 1, T, T): the keys before t that query t attends to
            last = T - 1 - seen.flip(-1).to(torch.uint8).argmax(-1)  # the latest of them (argmax: the first maximum)
            index = torch.where(seen.any(-1), last, t)  # (B, 1, T); none: its own
            earlier = k.gather(2, index[..., None].expand(-1, k.size(1), -1, k.size(3)))
        return torch.where(self.slow, earlier, k)


class MLP(nn.Module):
    def __init__(self, cfg, kernels):
        super().__init__()
        self.kernels = kernels
        hidden = cfg.mlp_mult * cfg.n_embd
        self.hidden = hidden  # active hidden units: a static slice, set by GPT.set_active
        self.swiglu = cfg.mlp == "swiglu"
        self.leaky = cfg.mlp == "leaky_relu2"
        self.slope = cfg.leaky_slope  # model.leaky_slope: the records' 0.5, K82s4's 0.35
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.c_proj.zero_init = True

    def forward(self, x):
        n, full, w_in = self.hidden, self.c_proj.in_features, self.c_fc.weight  # w_in: (H or 2H, C)
        w_out = self.c_proj.weight[:, :n]  # (C, n)
        if self.swiglu:
            w_in = w_in if n == full else torch.cat((w_in[:n], w_in[full:full + n]))
            gate, up = F.linear(x, w_in).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w_out)
        if self.leaky:  # LeakyReLU(slope)^2 (parameter-golf records): plain torch, the kernels cover relu2 only
            return F.linear(F.leaky_relu(F.linear(x, w_in[:n]), self.slope).square(), w_out)
        return F.linear(self.kernels.relu2(F.linear(x, w_in[:n])), w_out)


class Block(nn.Module):
    def __init__(self, cfg, kernels, value_embed=False, index=0, seq_len=None):
        super().__init__()
        self.kernels = kernels
        self.attn, self.mlp = Attention(cfg, kernels, value_embed, seq_len), MLP(cfg, kernels)
        # model.ln_scale: the normed branch inputs of block `index` times 1/sqrt(index + 1) (records from 2026-03-20).
        self.norm_scale = 1 / math.sqrt(index + 1) if cfg.ln_scale else None
        # The learned scalars of GPT.block_input, one set per block (so they move with it).
        if cfg.x0_shortcut:
            self.x0_mix = nn.Parameter(torch.tensor([1.0, cfg.x0_init]))  # (residual, embedding): x at x0_init 0
        if cfg.bigram_buckets:
            self.bigram_scale = nn.Parameter(torch.ones(()))
        if cfg.unet:
            self.skip_weight = nn.Parameter(torch.ones(()))
        if cfg.skip_gates:  # per channel, sigmoid(0) = 0.5 at the start
            self.skip_gate = nn.Parameter(torch.zeros(cfg.n_embd))
        if cfg.parallel_lanes == 2:  # Block.lanes: rows (attention lane, MLP lane), columns (residual, attn, mlp)
            self.lane_mix = nn.Parameter(torch.tensor([[1.1, 1.0, 1.0], [1.1, 1.0, 1.0]]))  # the records' init
        # Residual-branch scales (the annealing schedule moves them); buffers, so a new value is
        # graph data on XLA, not a new graph. Not saved: the schedule sets them from progress.
        self.register_buffer("attn_scale", torch.ones(()), persistent=False)
        self.register_buffer("mlp_scale", torch.ones(()), persistent=False)
        self.parallel = False  # attention and MLP read the same input (model.parallel_layers; set by GPT.set_active)

    def norm(self, x):
        return self.scaled(self.kernels.rmsnorm(x))

    def scaled(self, h):
        return h if self.norm_scale is None else h * self.norm_scale

    def forward(self, x, pos=None, mask=None, ve=None, doc=None, src=None):
        """src: None, or the normed attention source (model.attn_source_after; GPT.hidden) that this
        block's attention reads instead of norm(x), with this block's norm scale (model.ln_scale)."""
        if self.parallel:  # GPT-J / PaLM parallel residual: one norm, shared by both branches
            h = self.norm(x)
            return x + self.attn_scale * self.attn(h, pos, mask, ve, doc) + self.mlp_scale * self.mlp(h)
        h = self.norm(x) if src is None else self.scaled(src)
        x = x + self.attn_scale * self.attn(h, pos, mask, ve, doc)
        return x + self.mlp_scale * self.mlp(self.norm(x))

    def lanes(self, attn_lane, mlp_lane, ve=None, doc=None):
        """model.parallel_lanes=2 (parameter-golf records from 2026-04-09): attention reads one
        residual lane, the MLP the other, and each lane takes a learned mix of its own residual
        and both outputs. -> (attention lane, MLP lane)."""
        a = self.attn_scale * self.attn(self.norm(attn_lane), ve=ve, doc=doc)
        m = self.mlp_scale * self.mlp(self.norm(mlp_lane))
        (r0, a0, m0), (r1, a1, m1) = self.lane_mix
        return r0 * attn_lane + a0 * a + m0 * m, r1 * mlp_lane + a1 * a + m1 * m


TILED = ("block", "token")  # granularities that route units of a sequence through a TileRouter


def units_selected(capacity: float, n: int) -> int:
    """k = ceil(capacity * n), the static number of units (tiles, sequences) routed through. The
    product is rounded first so float error (0.3 * 10 = 3.0000000000000004) adds no unit."""
    return math.ceil(round(capacity * n, 9))


def rotation_period(mod, capacity: float) -> int:
    """Layer routing: micro-batches after which the rotation repeats (capacity a/P: P); 1 otherwise."""
    return Fraction(capacity).limit_denominator(1000).denominator if mod.granularity == "layer" else 1


class TileRouter(nn.Module):
    """Block-granularity Mixture-of-Depths for one layer: the sequence is cut into tiles of
    block_size tokens and each tile goes through the layer, or around it, as a unit.

    Router and predictor read the residual stream at the last token of the previous tile (zeros
    for tile 0), so neither a tile's weight nor its evaluation decision depends on its own tokens
    or later ones. Training: the top-k tiles of each sequence by router score are gathered in
    ascending order (causal order kept), run with their original positions, and their residual
    delta, scaled by w = sigmoid(score), is added back; gradients reach the router through w.
    Top-k looks at later tiles, so evaluation instead processes tile j iff predictor logit > 0.
    The predictor learns top-k membership (BCE) from a detached context, so it does not shape
    the residual stream. Evaluation counts, on the device, how often the two decisions agree.
    own_token: tiles of one token whose router and predictor read that token's own residual
    stream (token-level routing, as in Raposo et al. 2024): still causal, as the decision for
    token t depends on tokens <= t only.
    """

    def __init__(self, n_embd, block_size, own_token=False):
        super().__init__()
        assert block_size == 1 or not own_token, block_size
        self.block_size, self.own_token = block_size, own_token
        # Biases give the predictor a threshold, and tile 0 (zero context) a learnable decision.
        self.router = nn.Linear(n_embd, 1)
        self.predictor = nn.Linear(n_embd, 1)
        self.register_buffer("agree", torch.zeros(1, dtype=torch.long), persistent=False)
        self.register_buffer("total", torch.zeros(1, dtype=torch.long), persistent=False)

    def forward(self, block, x, k, ve=None, doc=None):
        """x: (B, T, C); k tiles per sequence go through `block` -> (x (B, T, C), predictor BCE).
        ve: the layer's value embeddings (B, T, K*D), or None; doc: (B, T) document indices or None."""
        B, T, C = x.shape
        bs = self.block_size
        assert T % bs == 0 and 1 <= k <= T // bs, (T, bs, k)
        ctx = x if self.own_token else torch.cat((x.new_zeros(B, 1, C), x[:, bs - 1::bs][:, :-1]), dim=1)  # (B, n, C)
        h = rms_norm(ctx)  # n = T / block_size rows: the reference, not a hot op
        score = self.router(h).squeeze(-1)  # (B, n)
        logit = self.predictor(h.detach()).squeeze(-1)  # (B, n)
        top = score.topk(k, dim=-1).indices  # (B, k)
        target = torch.zeros_like(logit).scatter(1, top, 1.0)  # (B, n) top-k membership, no gradient
        bce = F.binary_cross_entropy_with_logits(logit, target)
        w = torch.sigmoid(score)  # bounded, so a tile's delta is at most the layer's full delta
        if self.training:
            return self.gathered(block, x, top.sort(dim=-1).values, w, ve, doc), bce
        keep = logit > 0  # (B, n)
        self.agree += (keep == target.bool()).sum()
        self.total += keep.numel()
        return self.masked(block, x, keep, w, ve, doc), bce

    def gathered(self, block, x, tiles, w, ve, doc):
        """Run `block` on the ascending tiles (B, k) of x only; add their w-scaled deltas back."""
        B, T, C = x.shape
        bs, k = self.block_size, tiles.size(1)
        x_tiles = x.view(B, T // bs, bs, C)
        index = tiles[:, :, None, None].expand(B, k, bs, C)
        x_sel = x_tiles.gather(1, index).view(B, k * bs, C)
        pos = (tiles[:, :, None] * bs + torch.arange(bs, device=x.device)).view(B, k * bs)
        if ve is not None:  # the same tiles of the value embeddings (B, T, K*D)
            ve_index = tiles[:, :, None, None].expand(B, k, bs, ve.size(-1))
            ve = ve.view(B, T // bs, bs, -1).gather(1, ve_index).view(B, k * bs, -1)
        if doc is not None:
            doc = doc.view(B, T // bs, bs).gather(1, tiles[:, :, None].expand(B, k, bs)).view(B, k * bs)
        delta = (block(x_sel, pos, ve=ve, doc=doc) - x_sel).view(B, k, bs, C) * w.gather(1, tiles)[:, :, None, None]
        return x_tiles.scatter_add(1, index, delta).view(B, T, C)

    def masked(self, block, x, keep, w, ve, doc):
        """What `gathered` computes for the kept tiles (B, n) bool, on the whole sequence: queries
        attend only to keys of kept tiles; tokens of the other tiles keep x."""
        B, T, C = x.shape
        keep = keep[:, :, None].expand(-1, -1, self.block_size).reshape(B, T)  # (B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        # A skipped token may see itself, so no attention row is empty (its output is dropped).
        self_only = torch.eye(T, dtype=torch.bool, device=x.device)
        mask = causal & (keep[:, None, :] | self_only)  # (B, T, T)
        y = block(x, mask=mask[:, None], ve=ve, doc=doc)
        w = w[:, :, None].expand(-1, -1, self.block_size).reshape(B, T, 1)
        return torch.where(keep[..., None], x + w * (y - x), x)


class GPT(nn.Module):
    """mod: None or granularity "none" = dense. Otherwise the layers in mod.layers are routed:

    - block: TileRouter per layer; ceil(capacity * n) of the n tiles of each sequence go through.
    - token: the same with tiles of one token, each routed on its own residual stream.
    - layer: a routed layer runs on a whole micro-batch or is skipped; its residual delta is
      scaled by a learned gate (init 1). Rule: the layer at position r among the routed layers
      runs on micro-batch m iff ceil(c * (s + 1)) > ceil(c * s), s = m + r. A Bresenham spread:
      of any P consecutive s (c * P whole) exactly c * P run, and at one micro-batch the routed
      layers (consecutive s) share about c * len(layers) runs, at least one if that is >= 1.
      A layer gets its share when micro_step covers whole periods P: accum_steps a multiple of
      P, or micro_step counting micro-batches across steps (up to P graphs). Evaluation runs
      every layer with its gate (LayerDrop).
    - microbatch: the first ceil(capacity * B) sequences take the deep path, the others skip
      the routed layers (data order is shuffled, so this split is data-independent);
      evaluation takes the deep path for all.
    Skipped work is not computed. Shapes depend only on B, T and capacity (set_capacity).
    Depth recursion (set_recursion): after the active layer at position `last` of a loop span
    (first, last), the span's blocks run again, passes - 1 more times, with the same weights. Each
    extra pass is a unit: with recur_gate it adds gate * (its output - its input), gate a learned
    scalar per pass starting at 0 (entering the loop keeps the function); with mod.recur
    (Mixture-of-Recursions, Bae et al. 2025) it has a TileRouter of its own, which sends
    ceil(capacity * n) tiles or tokens of each sequence through it (granularity block or token).
    The per-block input additions (bigram, x0 mix) enter on the first pass only.
    model.attn_source_after and model.attn_source_layers (attention-source reuse, FrontierForge K82s4,
    recipes/K82s4/train.py, GPT.forward with FF_ATTN_SRC="5:6,7,8"; -0.0015 val_bpb over four seed pairs
    in its docs/FINDINGS.md section 3): the source block's output, normed once (src), is what the listed
    later blocks' attention reads instead of the norm of their own input; their residual and MLP are
    their own. Without parameters; gradients reach the source through every reader. While the source
    block is not active (depth annealing) its readers read their own input.
    Optional additions (keys of the `model` section; off, the model is exactly the one without them):
    value_embed (a second embedding table, kv-wide, added to the values of every other layer, the
    last included, with a learned per-layer weight), and the block inputs of block_input.
    kernels: a kernels.Kernels (kernels.resolve); None = the reference (kernels.REFERENCE).
    """

    def __init__(self, cfg, mod=None, kernels=None, attn_float32=False, passes=1, recur_gate=False, bos=None,
                 seq_len=None, mtp=0, masked_target=None):
        """attn_float32: the attention core (SDPA) runs in float32 inside a bfloat16 autocast or with
        bfloat16 weights (the backend's choice, train.Backend.attn_float32); the rest as before.
        passes: the most passes any stage loops its span (the gates and routers the loop needs).
        bos: the tokenizer's BOS id, which starts every document: needed by document masking and
        SmearGate, kept as a buffer so that a checkpoint carries it; None = neither is used.
        seq_len: the training rows' length (data.seq_len), needed by model.key_offset only.
        mtp, masked_target: the training objective's extra targets, and a token id it leaves out as a
        target (optim.mask_bos_targets: the BOS id), or None (objective()): neither is saved or evaluated."""
        super().__init__()
        self.cfg = cfg
        self.kernels = REFERENCE if kernels is None else kernels
        self.granularity = "none" if mod is None else mod.granularity
        assert self.granularity in ("none", "block", "token", "layer", "microbatch"), self.granularity
        self.routed = () if self.granularity == "none" else tuple(mod.layers)
        assert all(0 <= i < cfg.n_layer for i in self.routed), (self.routed, cfg.n_layer)
        self.aux_weight = 0.0 if mod is None else mod.aux_weight
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        if cfg.value_embed_ends:  # the lineage's: one n_embd-wide table, the first and the last layer
            self.ve_layers, ve_dim = {0, cfg.n_layer - 1}, cfg.n_embd
        else:
            self.ve_layers = {i for i in range(cfg.n_layer) if cfg.value_embed and i % 2 == (cfg.n_layer - 1) % 2}
            ve_dim = cfg.n_kv_head * (cfg.n_embd // cfg.n_head)
        # Tables as plain parameters: an nn.Embedding would draw its own init from the RNG and so
        # change every other initial weight (reset_parameters initialises them last).
        self.value_embed = nn.Parameter(torch.empty(cfg.vocab_size, ve_dim)) if cfg.value_embed else None
        self.bigram = nn.Parameter(torch.empty(cfg.bigram_buckets, cfg.n_embd)) if cfg.bigram_buckets else None
        self.blocks = nn.ModuleList(Block(cfg, self.kernels, i in self.ve_layers, i, seq_len) for i in range(cfg.n_layer))
        # model.smear_gate (SmearGate, parameter-golf records from 2026-04-16): each token's embedding plus
        # lambda * sigmoid(w . e_t[:gate_window]) times the previous token's, never across a BOS; w and
        # lambda start at 0, so it enters as nothing.
        self.smear_gate = nn.Parameter(torch.zeros(cfg.gate_window)) if cfg.smear_gate else None
        self.smear_lambda = nn.Parameter(torch.zeros(())) if cfg.smear_gate else None
        if bos is not None:
            self.register_buffer("bos", torch.as_tensor(bos))  # an id, or a checkpoint's buffer
        self.mtp, self.masked_target = mtp, masked_target
        self.mtp_computed = mtp  # the first extra targets the objective computes now (a stage's mtp: train.set_stage)
        if mtp:  # the extra targets' weights (set_mtp_weights): a buffer, so a new value is data, not a new graph
            self.register_buffer("mtp_weight", torch.zeros(mtp), persistent=False)
        self.doc_mask = False  # attention within documents (model.doc_mask, a stage may switch it; set by set_active)
        for block in self.blocks:
            block.attn.float32_core = attn_float32
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.routers = nn.ModuleDict({str(i): TileRouter(cfg.n_embd, tile_size(mod), self.granularity == "token")
                                      for i in self.routed if self.granularity in TILED})
        layer_routed = self.routed if self.granularity == "layer" else ()
        self.gates = nn.ParameterDict({str(i): nn.Parameter(torch.ones(())) for i in layer_routed})
        self.mor = mod is not None and mod.recur
        assert not self.mor or self.granularity in TILED, self.granularity
        for j in range(1, passes if self.mor else 1):
            self.routers[f"pass{j}"] = TileRouter(cfg.n_embd, tile_size(mod), self.granularity == "token")
        self.recur_gates = nn.ParameterList(nn.Parameter(torch.zeros(())) for _ in range(passes - 1)) if recur_gate else None
        self.max_passes, self.loop_span, self.passes = passes, (), 1  # GPT.set_recursion
        self.set_capacity(1.0 if mod is None else mod.capacity)
        self.set_active(range(cfg.n_layer), cfg.mlp_mult * cfg.n_embd)  # every block, every MLP unit
        self.aux_loss = torch.zeros(())  # set by every forward: aux_weight * sum of the routers' BCE
        self.reset_parameters()

    def reset_parameters(self):
        # Tied embeddings double as the output layer, so they start small (logits near uniform).
        nn.init.normal_(self.wte.weight, std=self.cfg.embed_init_std)
        mlp_inputs = {block.mlp.c_fc for block in self.blocks}
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if getattr(m, "zero_init", False) or m is self.lm_head:
                    nn.init.zeros_(m.weight)  # each residual branch and the head start as no-ops
                else:
                    scale = self.cfg.mlp_in_init if m in mlp_inputs else 1.0
                    nn.init.normal_(m.weight, std=scale * m.in_features ** -0.5)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for gate in self.gates.values():
            nn.init.ones_(gate)
        for gate in self.recur_gates or ():
            nn.init.zeros_(gate)
        # Last, so that switching them on leaves every other initial weight as it was.
        if self.value_embed is not None:
            nn.init.normal_(self.value_embed, std=1.0 if self.cfg.value_embed_ends else self.cfg.embed_init_std)
        if self.bigram is not None:
            nn.init.zeros_(self.bigram)  # enters as nothing; its per-block scales start at 1
        if self.cfg.head_init_std:  # (config: an untied head)
            nn.init.normal_(self.lm_head.weight, std=self.cfg.head_init_std)

    def set_capacity(self, capacity: float):
        """Share of units routed through every routed layer; a change is a new static shape."""
        assert 0 < capacity <= 1, capacity
        self.capacity = capacity

    def set_active(self, layers, mlp_hidden: int, doc_mask=None, xsa_layers=None):
        """Run only `layers` (block indices), each MLP with its first mlp_hidden units: static
        slices, so inactive capacity costs no compute. Inactive weights get no gradient and keep
        their initial values, whose zero output projections make a block or hidden unit enter as
        the identity (adds nothing): growth preserves the function. The last model.parallel_layers
        active blocks are parallel (Block.parallel): it follows depth growth, and a block that leaves
        the last ones at a switch turns sequential (the function is then not preserved). So do the
        last xsa_layers, with exclusive self-attention. doc_mask: attention within documents. Both
        default to the model config's (a stage may set its own)."""
        doc_mask = self.cfg.doc_mask if doc_mask is None else doc_mask
        xsa_layers = self.cfg.xsa_layers if xsa_layers is None else xsa_layers
        assert all(0 <= i < self.cfg.n_layer for i in layers) and 0 < mlp_hidden <= self.cfg.mlp_mult * self.cfg.n_embd
        assert not doc_mask or hasattr(self, "bos"), "document masking needs the BOS id (GPT's bos)"
        self.active, self.doc_mask = tuple(sorted(layers)), doc_mask
        parallel = self.active[max(0, len(self.active) - self.cfg.parallel_layers):]
        exclusive = self.active[max(0, len(self.active) - xsa_layers):]
        for i, block in enumerate(self.blocks):
            block.mlp.hidden = mlp_hidden
            block.parallel = i in parallel
            block.attn.xsa = i in exclusive

    def set_recursion(self, span, passes: int):
        """Loop the active layers at positions span = (first, last) `passes` times in all (shared
        weights); passes 1 = no loop. Call after set_active; a new loop is a new static graph."""
        assert passes == 1 or (len(span) == 2 and 0 <= span[0] <= span[1] < len(self.active)), (span, self.active)
        assert 1 <= passes <= self.max_passes, (passes, self.max_passes)
        self.loop_span, self.passes = (tuple(span) if passes > 1 else ()), passes

    def loop_pass(self, x, pos=None, mask=None, ve=None, doc=None, gate=None):
        """One extra pass of x (B, T', C) through the loop span's blocks; ve: these tokens' value
        embeddings (B, T', K*D) or None; doc: their document indices or None; gate: None or the
        pass's learned gate."""
        y = x
        for i in self.active[self.loop_span[0]:self.loop_span[1] + 1]:
            y = self.blocks[i](y, pos, mask, ve if i in self.ve_layers else None, doc)
        return y if gate is None else x + gate * (y - x)

    @torch.no_grad()
    def set_mtp_weights(self, weights):
        """The extra targets' weights now (optim.mtp_weights), in place, from a tensor made on the host: on XLA
        data, where a Python 0 (a faded weight) would be a graph constant; under torch.compile no recompile."""
        if self.mtp:
            self.mtp_weight.copy_(torch.tensor(weights, dtype=torch.float32), non_blocking=True)

    def set_residual_scales(self, attn: float, mlp: float):
        with torch.no_grad():
            for block in self.blocks:
                block.attn_scale.fill_(attn)
                block.mlp_scale.fill_(mlp)

    def layer_runs(self, position: int, micro_step: int) -> bool:
        """granularity=layer, training: does the routed layer at `position` run on this micro-batch?"""
        s = micro_step + position
        return units_selected(self.capacity, s + 1) > units_selected(self.capacity, s)

    def hidden(self, idx, micro_step: int = 0):
        """idx: (B, T) int64 -> the final-normed residual stream (B, T, C), the head's input. In
        eval mode position t sees only idx[:, :t+1]. micro_step: index of the micro-batch in the
        optimizer step (layer routing)."""
        starts = None if not hasattr(self, "bos") else idx == self.bos  # (B, T): a document's first token
        x = x0 = self.kernels.rmsnorm(self.embed(idx, starts))  # (B, T, C)
        # Within documents: the index of each token's document in the window (a cumulative sum: static shapes).
        doc = starts.cumsum(1) if self.doc_mask else None
        bigram = None
        if self.bigram is not None:
            rows = bigram_rows(idx, self.cfg.bigram_buckets)
            rows = rows if doc is None else torch.where(starts, 0, rows)  # no pair across documents
            bigram = F.embedding(rows, self.bigram)
        values = None if self.value_embed is None else F.embedding(idx, self.value_embed)  # (B, T, K*D)
        aux = torch.zeros((), device=x.device)
        skips = []  # U-net: outputs of the first half of the active blocks
        src = None  # model.attn_source_after: the source block's normed output, once it ran
        lanes = None  # model.parallel_lanes=2: (attention lane, MLP lane) from the first parallel block on
        for position, i in enumerate(self.active):
            block = self.blocks[i]
            ve = values if i in self.ve_layers else None
            mlp_lane = x if lanes is None else lanes[1]  # the lanes start as the stream before the first one's inputs
            x = self.block_input(block, position, x, x0, bigram, skips)  # once there are lanes, x is the attention lane
            if block.parallel and self.cfg.parallel_lanes == 2:  # the last active blocks: no routing, no loop
                lanes = block.lanes(x, mlp_lane, ve, doc)
                x = lanes[0]
            elif i not in self.routed:  # (attention-source readers are never routed: config.validate)
                x = block(x, ve=ve, doc=doc, src=src if i in self.cfg.attn_source_layers else None)
            elif self.granularity in TILED:
                k = units_selected(self.capacity, x.size(1) // self.routers[str(i)].block_size)
                x, bce = self.routers[str(i)](block, x, k, ve, doc)
                aux = aux + bce
            elif self.granularity == "layer":
                if not self.training or self.layer_runs(self.routed.index(i), micro_step):
                    x = x + self.gates[str(i)] * (block(x, ve=ve, doc=doc) - x)
            elif self.training:  # microbatch: the first k sequences go deep
                k = units_selected(self.capacity, x.size(0))
                x = torch.cat((block(x[:k], ve=None if ve is None else ve[:k], doc=None if doc is None else doc[:k]),
                               x[k:]))
            else:
                x = block(x, ve=ve, doc=doc)
            if i == self.cfg.attn_source_after:
                src = self.kernels.rmsnorm(x)
            if self.cfg.unet and position < len(self.active) // 2:
                skips.append(x)
            extra = self.passes - 1 if self.loop_span and position == self.loop_span[1] else 0
            for j in range(1, extra + 1):  # the loop's extra passes, after its last layer
                gate = None if self.recur_gates is None else self.recur_gates[j - 1]
                if self.mor:
                    router = self.routers[f"pass{j}"]
                    k = units_selected(self.capacity, x.size(1) // router.block_size)
                    x, bce = router(functools.partial(self.loop_pass, gate=gate), x, k, values, doc)
                    aux = aux + bce
                else:
                    x = self.loop_pass(x, ve=values, doc=doc, gate=gate)
        if lanes is not None:
            x = 0.5 * (lanes[0] + lanes[1])
        self.aux_loss = self.aux_weight * aux
        return self.kernels.rmsnorm(x)

    def embed(self, idx, starts):
        """The token embeddings (B, T, C); with SmearGate, plus the gated previous token's, except at
        the BOS positions `starts` (B, T) bool (the records' fix of 2026-04-27: nothing crosses a document)."""
        e = self.wte(idx)
        if self.smear_gate is None:
            return e
        gate = self.smear_lambda * torch.sigmoid(e[:, 1:, :self.smear_gate.numel()] @ self.smear_gate)  # (B, T-1)
        return torch.cat((e[:, :1], e[:, 1:] + (gate * ~starts[:, 1:])[..., None] * e[:, :-1]), dim=1)

    def block_input(self, block, position, x, x0, bigram, skips):
        """The residual stream entering the active block at `position`, from the options that are on:
        - unet: the mirrored first-half block's output (the last one saved first) times a learned
          weight, initialised to 1 (modded-nanogpt records 11 and 15); with skip_gates, instead
          lerp(weight * skip, x, sigmoid(gate)), a learned gate per channel (parameter-golf records);
        - x0_shortcut: lambda_r * x + lambda_0 * x0, x0 the normed token embedding, lambdas 1 and 0
          at init (record 9);
        - bigram_buckets: plus a learned scale (init 1) times the hashed bigram embedding, a
          zero-initialised table (record 62).
        Each is elementwise on the whole sequence, so routing (which follows) is unaffected."""
        if self.cfg.unet and position >= len(self.active) - len(self.active) // 2:
            skip = block.skip_weight * skips.pop()
            x = torch.lerp(skip, x, torch.sigmoid(block.skip_gate)) if self.cfg.skip_gates else x + skip
        if self.cfg.x0_shortcut:
            x = block.x0_mix[0] * x + block.x0_mix[1] * x0
        if bigram is not None:
            x = x + block.bigram_scale * bigram
        return x

    @property
    def head_weight(self):
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, idx, micro_step: int = 0):
        """idx: (B, T) int64 -> logits (B, T, V) fp32, from the reference head (load_for_eval's
        contract); training and evaluation use loss(), the fused head."""
        return self.logits(self.hidden(idx, micro_step))

    def logits(self, x):
        """The reference head: final-normed x (..., C) -> soft-capped logits (..., V) fp32."""
        logits = F.linear(x, self.head_weight).float()
        cap = self.cfg.logit_softcap
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)  # bounded logits keep early training stable
        return logits

    def loss(self, idx, targets, reduction="mean", micro_step: int = 0):
        """Cross-entropy in nats of targets (B, T): reduction "mean" (the training objective), "sum", or
        "none" (B*T,) fp32. With mtp or masked_target the training objective is objective()'s; "sum" and
        "none" (evaluation) stay the next-token NLL. The routers' auxiliary loss is separate:
        self.aux_loss after this call."""
        assert reduction in ("mean", "sum", "none"), reduction
        x = self.hidden(idx, micro_step)
        if reduction == "mean" and (self.mtp or self.masked_target is not None):
            return self.objective(x, targets)
        nll = self.kernels.head(x.flatten(0, 1), self.head_weight, targets.flatten(), self.cfg.logit_softcap)
        return nll.mean() if reduction == "mean" else nll.sum() if reduction == "sum" else nll

    def objective(self, x, targets):
        """The training loss with K82s4's multi-token prediction and BOS-target masking (FrontierForge,
        recipes/K82s4/train.py of github marker2601/trainium-simulator: fused_ce_head, _FusedChunkedCE;
        MTP measured -0.0043 val_bpb, docs/FINDINGS.md §1). x (B, T, C) final-normed, targets (B, T) ->
            ( sum_t m_0(t) nll(z_t, y_t) + sum_k w_k sum_t m_k(t) nll(z_t, y_{t+k}) ) / max(1, sum_t m_0(t))
        z_t the soft-capped logits, scored against the next token and each of the k = 1..mtp tokens after it
        (the row's targets shifted left by k: none at its last k positions), w_k = mtp_weight (set_mtp_weights),
        m_k(t) 0 where that target is missing or is masked_target (BOS). Not renormalised by the weights' sum, as
        K82s4. No parameter or matmul is added (flops_per_token, active_params unchanged): MTP computes the
        logits once with the reference head (the fused heads score one target per row); masking alone keeps
        the configured head. Only the first mtp_computed extra targets are computed (a stage leaves out those
        whose weights have faded to 0: the same value, less work); with none, the configured head."""
        masked = self.masked_target
        valid = torch.ones_like(targets, dtype=torch.bool) if masked is None else targets != masked  # (B, T)
        count = valid.sum().clamp(min=1)
        computed = self.mtp_computed
        if not computed:
            nll = self.kernels.head(x.flatten(0, 1), self.head_weight, targets.flatten(), self.cfg.logit_softcap)
            return (nll * valid.flatten()).sum() / count
        position = torch.arange(targets.size(1), device=targets.device)
        shifts = range(computed + 1)
        columns = torch.stack([targets.roll(-k, 1) for k in shifts], -1)  # (B, T, 1 + mtp): y_{t+k}
        present = torch.stack([valid.roll(-k, 1) & (position < targets.size(1) - k) for k in shifts], -1)
        nll = -self.logits(x).log_softmax(-1).gather(-1, columns)  # (B, T, 1 + mtp)
        weights = torch.cat((torch.ones_like(self.mtp_weight[:1]), self.mtp_weight[:computed]))
        return (nll * present * weights).sum() / count

    def reset_routing_stats(self):
        # New host-made zeros, not zero_(): on XLA they enter the next graph as data, so the first
        # evaluation batch is the same graph as the others.
        for router in self.routers.values():
            router.agree = torch.zeros(1, dtype=torch.long).to(router.agree.device)
            router.total = torch.zeros(1, dtype=torch.long).to(router.total.device)

    def routing_agreement(self):
        """-> (agree, total) int64 device tensors of shape (1,): evaluation tiles whose predictor decision
        matched the top-k of the router scores, and all evaluated tiles, summed over routed layers
        since reset_routing_stats(). (0, 0) without block routing."""
        zero = torch.zeros(1, dtype=torch.long, device=self.wte.weight.device)
        agree = sum((r.agree for r in self.routers.values()), zero)
        return agree, sum((r.total for r in self.routers.values()), zero)


def bigram_rows(idx, buckets: int):
    """idx: (B, T) tokens -> (B, T) rows of the hashed bigram table: the pair (previous token, token)
    hashed into rows 1..buckets-1 (the XOR of two odd multiples, as modded-nanogpt's bigram hash);
    row 0 at a window's first position, whose previous token the model does not see."""
    pairs = torch.bitwise_xor(36313 * idx[:, 1:], 27191 * idx[:, :-1]) % (buckets - 1) + 1
    return torch.cat((torch.zeros_like(idx[:, :1]), pairs), dim=1)


def rotated_dims(cfg) -> int:
    """Head dimensions that rotate under model.rope_fraction: an even number (config checks it is >= 2)."""
    return 2 * round(cfg.rope_fraction * (cfg.n_embd // cfg.n_head) / 2)


def gate_width(cfg) -> int:
    """Inputs of each head's attention-output gate (model.attn_gate); 0 = no gate."""
    return {"none": 0, "dense": cfg.n_embd, "sparse": cfg.gate_window}[cfg.attn_gate]


def tile_size(mod) -> int:
    """Tokens per routed unit of a sequence under block or token routing."""
    return 1 if mod.granularity == "token" else mod.block_size


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def routed_share(mod, seq_len: int) -> float:
    """Share of a routed layer's tokens that go through it: realised ceil(c * n) / n tiles for
    block and token routing; the capacity for layer (its long-run share) and microbatch (B is not known)."""
    if mod.granularity in TILED:
        n = seq_len // tile_size(mod)
        return units_selected(mod.capacity, n) / n
    return mod.capacity


def active_params(model: GPT) -> int:
    """Parameters used per token: the active blocks with their active MLP units (GPT.set_active),
    a routed one with the capacity share of the tokens (the realised block share also depends on
    T); embeddings, head, routers, predictors and gates count fully."""
    def used(i):
        mlp = model.blocks[i].mlp
        unused = (mlp.c_proj.in_features - mlp.hidden) * mlp.c_proj.out_features * (3 if mlp.swiglu else 2)
        return sum(p.numel() for p in model.blocks[i].parameters()) - unused
    blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    active = sum(used(i) * (model.capacity if i in model.routed else 1) for i in model.active)
    return round(param_count(model) - blocks + active)


def flops_per_token(cfg, seq_len: int, mod=None, layers=None, mlp_hidden=None, loop_layers=0, passes=1) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward, a multiply-add = 2 FLOPs).
    Counts every matmul: q, kv, attention output and MLP projections, the attention-output gates
    and SmearGate's, the output head, and causal attention itself (QK^T and AV: 2 x 2 x C per key,
    T/2 keys on average; within-document attention computes them all too). Embedding lookups,
    norms and elementwise work (XSA, skip gates, lanes, model.key_offset's splice) are not counted;
    model.attn_source_* (the readers' attention: the same matmuls on another input), model.qk_gain_learned
    and model.leaky_slope change nothing here.
    With routing (mod), a routed layer's matmuls count with its token share s (routed_share);
    its attention with s^2 for block and token routing (s*T queries over s*T keys) and s otherwise;
    these two add each layer's router and predictor, Linear(C, 1) each, once per tile. Gates,
    gathers and the evaluation mask are not counted.
    layers, mlp_hidden: the active blocks and MLP width of an annealing stage (default: all).
    loop_layers, passes: a loop of that many layers run `passes` times in all (the virtual depth);
    with mod.recur each extra pass counts like a routed layer of each of its layers, plus its router."""
    layers = range(cfg.n_layer) if layers is None else layers
    C, L = cfg.n_embd, len(layers)
    kv_dim = cfg.n_kv_head * (C // cfg.n_head)
    hidden = mlp_hidden or cfg.mlp_mult * C
    mlp_in = (2 if cfg.mlp == "swiglu" else 1) * hidden
    layer_params = C * C + C * 2 * kv_dim + C * C + C * mlp_in + hidden * C + cfg.n_head * gate_width(cfg)
    layer_attention = 2 * 2 * C * seq_len / 2
    matmul_params = L * layer_params + C * cfg.vocab_size + (cfg.gate_window if cfg.smear_gate else 0)
    attention = L * layer_attention
    if mod is not None and mod.granularity != "none":
        routed, share = len(set(mod.layers) & set(layers)), routed_share(mod, seq_len)
        tiled = mod.granularity in TILED
        attention_share = share ** 2 if tiled else share
        matmul_params -= routed * (1 - share) * layer_params
        attention -= routed * (1 - attention_share) * layer_attention
        if tiled:
            matmul_params += routed * 2 * C / tile_size(mod)
    if passes > 1:
        mor = mod is not None and mod.recur
        share = routed_share(mod, seq_len) if mor else 1.0
        matmul_params += (passes - 1) * (loop_layers * share * layer_params + (2 * C / tile_size(mod) if mor else 0))
        attention += (passes - 1) * loop_layers * share ** 2 * layer_attention
    return 3 * (2 * matmul_params + attention)


def training_values(cfg, tokens: int) -> tuple:
    """-> (parameters, activation values autograd keeps for `tokens` tokens), roughly: the blocks' matrices,
    the embedding, head and tables; per token n_layer x (8 + 3 x mlp_mult) x n_embd (norm inputs, q/k/v, attention
    output, residual, MLP hidden before and after its activation) and 4 x vocab_size (logits, softcap,
    log-softmax, its gradient). What train.py's memory check counts."""
    hidden, kv_dim = cfg.mlp_mult * cfg.n_embd, cfg.n_kv_head * (cfg.n_embd // cfg.n_head)
    layer = 2 * cfg.n_embd * cfg.n_embd + 2 * cfg.n_embd * kv_dim + (3 if cfg.mlp == "swiglu" else 2) * cfg.n_embd * hidden
    params = (cfg.n_layer * layer + (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.n_embd
              + cfg.bigram_buckets * cfg.n_embd + (cfg.vocab_size * kv_dim if cfg.value_embed else 0))
    return params, tokens * (cfg.n_layer * (8 + 3 * cfg.mlp_mult) * cfg.n_embd + 4 * cfg.vocab_size)
