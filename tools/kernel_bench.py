"""Forward + backward time of every implementation of every kernel op that can run on this
backend, against the reference, at the shapes of a config; what kernels.AUTO is set from. A tool
(tools/ may import train for Backend; the kernels package imports nothing of AION's).

    python -m tools.kernel_bench --config configs/base.yaml [key.sub=value ...] [--repeats 20 --warmup 5]

Shapes: one micro-batch, N = optim.micro_batch * data.seq_len tokens: head x (N, n_embd) and the
(vocab, n_embd) weight; rmsnorm (B, T, n_embd); qk_norm_rope (B, n_head, T, head_dim); relu2
(B, T, mlp_mult * n_embd). Inputs have the dtypes a training step gives them under device.dtype
(autocast): the residual stream (rmsnorm, the head's x and weight) in float32, the projections'
outputs (qk_norm_rope, relu2) in the compute dtype. A timing is the median of --repeats calls of
forward + backward after --warmup, bracketed by Backend.wait(); peak memory is CUDA's peak
allocation during one call, above what the inputs hold.
"""

import argparse
import importlib
import statistics
import time

import torch

import kernels
import train
from config import load_config


def op_inputs(op, cfg, device, dtype):
    """-> (positional args of one call of `op`, the tensors whose gradients backward computes)."""
    m, B, T = cfg.model, cfg.optim.micro_batch, cfg.data.seq_len
    C, H = m.n_embd, m.n_head
    D = C // H

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    if op == "head":
        weight = (torch.randn(m.vocab_size, C, device=device) * m.embed_init_std).requires_grad_()
        targets = torch.randint(0, m.vocab_size, (B * T,), device=device)
        x = randn(B * T, C)
        return (x, weight, targets, m.logit_softcap), (x, weight)
    if op == "rmsnorm":
        x = randn(B, T, C)
        return (x,), (x,)
    if op == "qk_norm_rope":
        x = randn(B, H, T, D, dtype=dtype)
        inv_freq = 1.0 / (m.rope_base ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
        angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq  # (T, D/2)
        gain = torch.full((H,), m.qk_gain_init, device=device, requires_grad=True)
        return (x, angles.cos().to(dtype), angles.sin().to(dtype), gain), (x, gain)
    x = randn(B, T, m.mlp_mult * C, dtype=dtype)
    return (x,), (x,)


def time_op(fn, args, grads_of, backend, repeats, warmup):
    """-> (median ms of forward + backward, peak MiB above the inputs or None)."""
    def call():
        with backend.autocast():
            out = fn(*args)
        grads = torch.autograd.grad(out, grads_of, torch.ones_like(out))
        backend.mark_step()  # XLA: runs the traced graph while its outputs (grads) are alive
        return grads

    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        backend.wait()
        start = time.perf_counter()
        call()
        backend.wait()
        times.append((time.perf_counter() - start) * 1000)
    peak = None
    if backend.kind == "cuda":
        torch.cuda.reset_peak_memory_stats(backend.device)
        held = torch.cuda.memory_allocated(backend.device)
        call()
        backend.wait()
        peak = (torch.cuda.max_memory_allocated(backend.device) - held) / 2 ** 20
    return statistics.median(times), peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config whose shapes and device are benchmarked")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per implementation (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (compilation, autotuning)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    backend = train.Backend(cfg.device)
    torch.manual_seed(cfg.run.seed)
    m = cfg.model
    print(f"# tools.kernel_bench {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} config:{args.config} "
          f"overrides:{' '.join(args.overrides) or '-'} device:{backend.device} dtype:{backend.dtype_name}"
          f" tokens:{cfg.optim.micro_batch * cfg.data.seq_len} (micro_batch {cfg.optim.micro_batch} x seq_len "
          f"{cfg.data.seq_len}) n_embd:{m.n_embd} heads:{m.n_head} vocab:{m.vocab_size} "
          f"mlp_hidden:{m.mlp_mult * m.n_embd} repeats:{args.repeats} warmup:{args.warmup}")
    for impl in kernels.IMPLS:
        reason = kernels.unavailable(impl, backend.kind, backend.on_trainium)
        if reason:
            print(f"# {impl}: not run here: {reason}")
    print("| op | impl | fwd+bwd ms | ratio to torch | peak MiB |\n| --- | --- | --- | --- | --- |")
    for op in kernels.OPS:
        for impl in kernels.IMPLS:
            if kernels.unavailable(impl, backend.kind, backend.on_trainium):
                continue
            module = importlib.import_module("kernels.reference" if impl == "torch" else f"kernels.{impl}_{op}")
            call_args, grads_of = op_inputs(op, cfg, backend.device, backend.dtype)
            ms, peak = time_op(getattr(module, kernels.FUNCTIONS[op]), call_args, grads_of, backend,
                               args.repeats, args.warmup)
            if impl == "torch":  # first in IMPLS, always available
                reference_ms = ms
            print(f"| {op} | {impl} | {ms:.3f} | {ms / reference_ms:.2f} | {'-' if peak is None else f'{peak:.1f}'} |")


if __name__ == "__main__":
    main()
