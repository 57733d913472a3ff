"""A textbook trainer, nanoGPT's recipe, timed and scored as AION's runs are: its learning curve on AION's time axis.

    python -m tools.nanogpt [--config configs/cpu.yaml] [--seconds 600] [--max-steps 0] [--seed 1337] [--block 0]
                            [key.sub=value ...]

The recipe is nanoGPT's, written out here (it is not installed): pre-LayerNorm blocks with biases off,
learned positions, GELU MLP 4x, causal SDPA, tied head, init std 0.02 (0.02/sqrt(2 L) on output
projections), AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on matrices), grad clip 1.0, float32
eager on the CPU, 16 random windows of 256 tokens per step (offsets into the train shards concatenated,
numpy's generator seeded by --seed; torch.manual_seed(--seed) for the init). Shape: 4 layers x 256, 4 heads.
--block N: learned positions and training windows of N tokens, 4,096 / N of them per step (nanoGPT's tokens
per step kept), so the model can be scored on windows up to N (eval.seq_len; 0 = the block). By default (0) the
block is the config's eval.seq_len (cpu.yaml's 2,048: scored as AION's headline), else nanoGPT's 256.
nanoGPT's LR schedule, adapted to a time budget: a linear warm-up over the first 100 steps, then the
cosine from 6e-4 to 6e-5 by p = training seconds / --seconds, where nanoGPT decays by step count.

From the config only: the data (data.* but data.seq_len: the windows are --block's), model.vocab_size, eval.*,
run.out_dir, run.log_every and ledger.path. Training seconds are wall-clock seconds of the steps alone (batch
read, forward, backward, clip, update); evaluation is kept out. The run stops at --seconds of them, or after
--max-steps steps when > 0. Evaluation is AION's val_bpb: train.Trainer.evaluate's windows (data.val_batches
of eval.seq_len, else the block; eval.batch_size rows of the block's tokens per forward), nats summed over the
target tokens over ln(2) times their bytes (data.ByteTable). Like
train.py it writes <run.out_dir>/<run id>/metrics.jsonl (train, curve and final records, which
ledger.read_metrics and ledger.plot_curves read) and one ledger row, recipe nanogpt; SIGINT or SIGTERM
stops it between steps with an interrupted row and exit code 128 + the signal. Its clock is the wall:
run it alone on the machine.
"""
import argparse
import json
import math
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import clock
import data
import ledger
import train
from config import ROOT, ConfigError, load_config

LAYERS, WIDTH, HEADS, SEQ, ROWS = 4, 256, 4, 256, 16
STEP_TOKENS = ROWS * SEQ  # nanoGPT's tokens per step, whatever the block
LR, MIN_LR, WARMUP_STEPS = 6e-4, 6e-5, 100
NOTES = ("nanoGPT's recipe: 4x256 pre-LayerNorm GPT, learned positions, GELU, tied head; AdamW 6e-4 (0.9, 0.95), "
         "wd 0.1 on matrices, clip 1.0; 100 warm-up steps, cosine to 6e-5 by time; {rows}x{block} random windows; "
         "float32 eager")


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
    def __init__(self, vocab, block=SEQ):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, WIDTH), nn.Embedding(block, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets, reduction="mean"):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's AdamW: weight decay 0.1 on the matrices (embeddings included), none on the norms' gains."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([dict(params=matrices, weight_decay=0.1), dict(params=others, weight_decay=0.0)],
                             lr=LR, betas=(0.9, 0.95))


def batch(tokens: np.ndarray, rng: np.random.Generator, block=SEQ) -> tuple:
    """STEP_TOKENS // block random windows of the token stream -> (inputs, targets), int64 [rows, block]."""
    starts = rng.integers(0, len(tokens) - block - 1, STEP_TOKENS // block)
    rows = torch.from_numpy(np.stack([tokens[s:s + block + 1] for s in starts]).astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def train_step(model: NanoGPT, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    """Forward, backward, clip at 1.0, update -> the batch's mean loss."""
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def lr_at(step: int, progress: float) -> float:
    """nanoGPT's schedule on a time budget: linear warm-up by step (as nanoGPT's get_lr), then the cosine to
    MIN_LR by progress p = training seconds / budget (nanoGPT's: by step, to lr_decay_iters)."""
    if step < WARMUP_STEPS:
        return LR * (step + 1) / (WARMUP_STEPS + 1)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (LR - MIN_LR)


@torch.no_grad()
def evaluate(model: NanoGPT, val_files, seq_len: int, rows: int, table: data.ByteTable, max_tokens: int,
             stop=lambda: False):
    """-> (val_loss nats/token, val_bpb, target tokens, target bytes) over the first max_tokens targets of the
    validation split (0 = all of it) in windows of seq_len, rows of them per forward, as train.Trainer.evaluate
    scores them; None if stop() turns true first."""
    model.eval()
    nll, n_tokens, n_bytes = 0.0, 0, 0
    for x, y in data.val_batches(val_files, seq_len, rows, model.wte.num_embeddings, max_tokens=max_tokens):
        nll += model(x, y, reduction="none").double().sum().item()
        n_tokens += y.numel()
        n_bytes += int(table.target_bytes(x, y).sum())
        if stop():
            break
    model.train()
    return None if stop() else (nll / n_tokens, nll / (math.log(2) * n_bytes), n_tokens, n_bytes)


def eval_windows(cfg, block: int) -> tuple:
    """-> (window length, windows per forward): eval.seq_len, else the block; eval.batch_size rows of the block's
    tokens per forward (at least one window)."""
    seq_len = cfg.eval.seq_len or block
    return seq_len, max(1, cfg.eval.batch_size * block // seq_len)


class Run:
    """One run: the model, its optimizer, the clock (training seconds, steps) and the outputs."""

    def __init__(self, cfg, args, tokens, val_files, table, data_sha):
        self.cfg, self.args, self.tokens, self.val_files, self.table, self.data_sha = (
            cfg, args, tokens, val_files, table, data_sha)
        torch.manual_seed(args.seed)
        self.rng = np.random.default_rng(args.seed)
        self.model = NanoGPT(cfg.model.vocab_size, args.block)
        self.eval_seq, self.eval_rows = eval_windows(cfg, args.block)
        self.opt = adamw(self.model)
        self.run_id = f"nanogpt-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
        self.run_dir = Path(cfg.run.out_dir) / self.run_id
        self.step, self.train_s, self.step_ms, self.signals = 0, 0.0, [], []
        self.curve_points, self.curve_s = 0, 0.0

    def metric(self, kind: str, **values):
        record = dict(kind=kind, step=self.step, train_s=round(self.train_s, 3), tokens=self.step * STEP_TOKENS,
                      **values)
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def evaluate(self, max_tokens: int):
        return evaluate(self.model, self.val_files, self.eval_seq, self.eval_rows, self.table, max_tokens,
                        stop=lambda: bool(self.signals))

    def curve_point(self):
        """The same first eval.curve_tokens of the validation split; its time is kept out of training seconds."""
        start = time.perf_counter()
        result = self.evaluate(self.cfg.eval.curve_tokens)
        seconds = time.perf_counter() - start
        if result is None:  # cut short by a signal: not a point of the curve; the loop stops next
            return
        val_loss, val_bpb, _, _ = result
        self.curve_points, self.curve_s = self.curve_points + 1, self.curve_s + seconds
        print(f"curve step:{self.step} train_s:{self.train_s:.1f} val_loss:{val_loss:.4f} val_bpb:{val_bpb:.4f} "
              f"eval_s:{seconds:.2f}", flush=True)
        self.metric("curve", val_loss=val_loss, val_bpb=val_bpb, eval_s=seconds)

    def train(self) -> str:
        """The timed loop, with curve points every eval.every_seconds from step 0 -> status."""
        cfg, budget, max_steps = self.cfg, self.args.seconds, self.args.max_steps
        every, next_curve = cfg.eval.every_seconds, 0.0
        self.logged, self.loss_sum = 0, 0.0  # the step of the last train record, the loss summed since
        while not self.signals and self.train_s < budget and not (max_steps and self.step >= max_steps):
            if every and self.train_s >= next_curve:
                self.curve_point()
                next_curve = (self.train_s // every + 1) * every
                continue  # a signal during it stops the run before another step
            self.lr = lr_at(self.step, self.train_s / budget)
            for group in self.opt.param_groups:
                group["lr"] = self.lr
            t0 = time.perf_counter()
            loss = train_step(self.model, self.opt, *batch(self.tokens, self.rng, self.args.block)).item()
            elapsed = time.perf_counter() - t0
            self.step, self.train_s, self.loss_sum = self.step + 1, self.train_s + elapsed, self.loss_sum + loss
            self.step_ms.append(elapsed * 1000)
            if not math.isfinite(loss):
                return "diverged"
            if self.step % cfg.run.log_every == 0:
                self.report()
        if self.step > self.logged:
            self.report()
        return "interrupted" if self.signals else "ok"

    def report(self):
        """The progress line and train record: the mean loss of the steps since the last one."""
        loss, self.logged, self.loss_sum = self.loss_sum / (self.step - self.logged), self.step, 0.0
        print(f"step:{self.step} loss:{loss:.4f} lr:{self.lr:.3g} train_s:{self.train_s:.1f} "
              f"tokens_per_s:{self.tokens_per_s:.0f}", flush=True)
        self.metric("train", loss=loss, lr=self.lr)

    @property
    def tokens_per_s(self) -> float:
        return self.step * STEP_TOKENS / self.train_s if self.train_s else 0.0

    def run(self) -> dict:
        """Train, evaluate (an ok run), append the ledger row (always, also on a failure) -> the row."""
        git_commit, git_dirty = ledger.git_state(ROOT)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        print(f"run_id:{self.run_id} git:{git_commit}{'+dirty' if git_dirty else ''} params:{self.params} "
              f"budget_s:{self.args.seconds:g} max_steps:{self.args.max_steps} seed:{self.args.seed} data:{self.data_sha}",
              flush=True)
        handlers = {s: signal.signal(s, lambda signum, frame: self.signals.append(signum))
                    for s in (signal.SIGINT, signal.SIGTERM)}
        status, error, final, eval_s = "failed", "", None, 0.0
        try:
            status = self.train()
            if status == "ok":
                start = time.perf_counter()
                final = self.evaluate(self.cfg.eval.tokens)
                eval_s = time.perf_counter() - start
                if final is None:
                    status = "interrupted"
                else:
                    self.metric("final", eval_s=eval_s, val_loss=final[0], val_bpb=final[1])
        except Exception as e:  # in training or the evaluation: the row still records the run
            status, error = "failed", f"{type(e).__name__}: {e}"
            raise
        finally:
            try:
                row = self.finish(status, error, final, eval_s, git_commit, git_dirty)
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)
        return row

    @property
    def command(self) -> str:
        """The run's arguments, defaults included: its row says how to run it again."""
        args, config = self.args, Path(self.args.config).resolve()
        config = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
        return " ".join([f"--config {config} --seconds {args.seconds:g} --seed {args.seed}",
                         *([f"--max-steps {args.max_steps}"] if args.max_steps else []),
                         *([f"--block {args.block}"] if args.block != SEQ else []), *args.overrides])

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def finish(self, status, error, final, eval_s, git_commit, git_dirty) -> dict:
        val_loss, val_bpb, val_tokens, val_bytes = final or (None,) * 4
        notes = [NOTES.format(rows=STEP_TOKENS // self.args.block, block=self.args.block)]
        notes += [self.cfg.ledger.notes] if self.cfg.ledger.notes else []
        if self.curve_points:
            notes.append(f"curve_evals={self.curve_points} curve_eval_s={self.curve_s:.1f}")
        if status == "diverged":
            notes.append(f"non-finite training loss at step {self.step}")
        if error:
            notes.append(error)
        row = dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), run_id=self.run_id, git_commit=git_commit,
                   git_dirty=git_dirty, config="tools/nanogpt.py", overrides=self.command, device="cpu",
                   world_size=1, seed=self.args.seed, data_sha=self.data_sha, params=self.params, active_params=self.params,
                   budget_s=self.args.seconds, train_s=self.train_s, eval_s=eval_s, steps=self.step,
                   tokens=self.step * STEP_TOKENS, tokens_per_s=self.tokens_per_s,
                   step_ms_p50=statistics.median(self.step_ms) if self.step_ms else None, val_loss=val_loss,
                   val_bpb=val_bpb, val_tokens=val_tokens, val_bytes=val_bytes, status=status, recipe="nanogpt",
                   sweep=self.cfg.ledger.sweep, variant=self.cfg.ledger.variant, machine=clock.machine(), clock="wall",
                   notes="; ".join(notes))
        ledger.append(self.cfg.ledger.path, row)
        self.metrics_file.close()
        print("summary " + " ".join(f"{k}:{v:.6g}" if isinstance(v, float) else f"{k}:{v}" for k, v in row.items()
                                    if v not in (None, "") and k != "notes"), flush=True)
        return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu.yaml"), help="data, eval, run and ledger keys")
    parser.add_argument("--seconds", type=float, default=600.0, help="training seconds (wall clock, steps only)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps; 0 = no limit")
    parser.add_argument("--seed", type=int, default=1337, help="torch's init and numpy's window offsets")
    parser.add_argument("--block", type=int, default=0, help="learned positions and training windows; "
                        f"{STEP_TOKENS} / block windows per step; 0 = the config's eval.seq_len, else {SEQ}")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides; later ones win")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.seconds <= 0:
            raise ConfigError(f"--seconds: expected > 0, got {args.seconds:g}")
        if args.max_steps < 0:
            raise ConfigError(f"--max-steps: expected >= 0, got {args.max_steps}")
        if not 0 <= args.seed < 2 ** 32:
            raise ConfigError(f"--seed: expected in [0, 2**32) (numpy's seed range), got {args.seed}")
        cfg = load_config(args.config, args.overrides)
        args.block = args.block or cfg.eval.seq_len or SEQ
        if args.block < 1 or STEP_TOKENS % args.block:
            raise ConfigError(f"--block: expected a divisor of {STEP_TOKENS} (the tokens per step), got {args.block}")
        if cfg.eval.seq_len > args.block:
            raise ConfigError(f"eval.seq_len: expected at most --block ({args.block}: the learned positions), "
                              f"got {cfg.eval.seq_len}")
        train_files, val_files, tokenizer, data_sha = train.open_data(cfg)
        table = data.ByteTable(tokenizer)
        if table.vocab_size != cfg.model.vocab_size:
            raise data.DataError(f"tokenizer {tokenizer} has {table.vocab_size} tokens but "
                                 f"model.vocab_size is {cfg.model.vocab_size}")
        tokens = np.concatenate([data.load_shard(f, cfg.model.vocab_size) for f in train_files])
        if len(tokens) < args.block + 2:
            raise data.DataError(f"{', '.join(map(str, train_files))}: {len(tokens)} tokens, expected at least "
                                 f"{args.block + 2} (one window of {args.block} + 1)")
        next(data.val_batches(val_files, *eval_windows(cfg, args.block), cfg.model.vocab_size,
                              max_tokens=cfg.eval.tokens))
        train.check_outputs(cfg)
    except (ConfigError, data.DataError, ledger.LedgerError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run = Run(cfg, args, tokens, val_files, table, data_sha)
    status = run.run()["status"]
    return 128 + run.signals[0] if status == "interrupted" else (0 if status == "ok" else 1)


if __name__ == "__main__":
    sys.exit(main())
