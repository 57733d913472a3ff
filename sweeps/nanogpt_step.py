"""Training-step speed of a textbook trainer against ours, at the textbook trainer's shape.

    python sweeps/nanogpt_step.py [--steps 40] [--warmup 5] [key.sub=value ...]

The textbook trainer is nanoGPT's recipe written out here (it is not installed): pre-LayerNorm
blocks with biases off, learned positions, GELU MLP 4x, causal SDPA, tied head, init std 0.02
(0.02/sqrt(2 L) on output projections), AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on
matrices), grad clip 1.0, fp32 eager, random windows of the train shards. Shape: 4 layers x 256,
4 heads, 16 windows of 256 tokens per step. Its tokens/s is the median step (batch read,
forward, backward, clip, update) after --warmup steps.

Ours: train.py on configs/cpu.yaml at the same shape (n_layer 4, n_embd 256, 4096 tokens per
step in one micro-batch of 16) plus the trailing overrides, for --steps steps; its tokens/s is
train.py's own (median step, first step excluded). Both run in this process, one after the
other, so run it alone on the machine. Prints one line per trainer and the ratio.
"""

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import train  # noqa: E402
from config import load_config  # noqa: E402

LAYERS, WIDTH, HEADS, SEQ, ROWS = 4, 256, 4, 256, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
        self.c_attn, self.attn_proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nanogpt_tokens_per_s(tokens: np.ndarray, vocab: int, steps: int, warmup: int) -> float:
    model = NanoGPT(vocab)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=matrices, weight_decay=0.1), dict(params=others, weight_decay=0.0)],
                            lr=6e-4, betas=(0.9, 0.95))
    rng, times = np.random.default_rng(0), []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        starts = rng.integers(0, len(tokens) - SEQ - 1, ROWS)
        batch = torch.from_numpy(np.stack([tokens[s:s + SEQ + 1] for s in starts]).astype(np.int64))
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return ROWS * SEQ / statistics.median(times[warmup:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="for our trainer, after the shape")
    args = parser.parse_args(argv)
    ours = [f"model.n_layer={LAYERS}", f"model.n_embd={WIDTH}", f"model.n_head={HEADS}", f"data.seq_len={SEQ}",
            f"optim.batch_tokens={ROWS * SEQ}", f"optim.micro_batch={ROWS}", f"budget.max_steps={args.steps}",
            "run.name=nanogpt-shape", "run.profile_steps=0", "eval.tokens=8192", "eval.every_seconds=0",
            "checkpoint.every_seconds=0", *args.overrides]
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "cpu.yaml", ours)
    torch.manual_seed(cfg.run.seed)
    train_files, _, _, _ = train.open_data(cfg)
    tokens = data.load_shard(train_files[0], cfg.model.vocab_size)
    reference = nanogpt_tokens_per_s(tokens, cfg.model.vocab_size, args.steps, args.warmup)
    print(f"nanogpt: {LAYERS}x{WIDTH}, {ROWS}x{SEQ} tokens/step, tokens/s {reference:.0f}", flush=True)
    summary = train.Trainer(cfg, "configs/cpu.yaml", ours).train()
    print(f"aion:    same shape, overrides {' '.join(args.overrides) or '-'}: tokens/s {summary['tokens_per_s']:.0f} "
          f"(run {summary['run_id']})")
    print(f"ratio aion/nanogpt: {summary['tokens_per_s'] / reference:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
