"""Training-step speed of a textbook trainer against ours, at the textbook trainer's shape.

    python sweeps/nanogpt_step.py [--steps 40] [--warmup 5] [key.sub=value ...]

The textbook trainer is nanoGPT's recipe as tools/nanogpt.py writes it out (pre-LayerNorm blocks
with biases off, learned positions, GELU MLP 4x, causal SDPA, tied head, init std 0.02
(0.02/sqrt(2 L) on output projections), AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on
matrices), grad clip 1.0, fp32 eager), here at a constant LR on random windows of the first train
shard. Shape: 4 layers x 256, 4 heads, 16 windows of 256 tokens per step. Its tokens/s is the
median step (batch read, forward, backward, clip, update) after --warmup steps.

Ours: train.py on configs/cpu.yaml at the same shape (n_layer 4, n_embd 256, 4096 tokens per
step in one micro-batch of 16) plus the trailing overrides, for --steps steps; its tokens/s is
train.py's own (median step, first step excluded). Both run in this process, one after the
other, so run it alone on the machine. Prints one line per trainer and the ratio.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import train  # noqa: E402
from config import load_config  # noqa: E402
from tools.nanogpt import HEADS, LAYERS, ROWS, SEQ, WIDTH, NanoGPT, adamw, batch, train_step  # noqa: E402


def nanogpt_tokens_per_s(tokens: np.ndarray, vocab: int, steps: int, warmup: int) -> float:
    model = NanoGPT(vocab)
    opt = adamw(model)
    rng, times = np.random.default_rng(0), []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        train_step(model, opt, *batch(tokens, rng))
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
