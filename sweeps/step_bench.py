"""The step's smaller items after attention, at configs/cpu.yaml's shape: are they worth changing?

    python sweeps/step_bench.py [--rounds 30] [--dtype bfloat16|float32] [--config PATH] [key.sub=value ...]

- `qkv`: one attention block's input projections, forward and backward under the autocast a step
  uses: q (96 -> 96) and k, v (96 -> 96) as two matmuls, as the model has them, against one fused
  96 -> 192 matmul (then split).
- `newton_schulz`: one Muon step's orthogonalisation of every block matrix of the model (optim.py's
  newton_schulz, 5 iterations) in float32, as on the CPU now, against bfloat16, as on GPUs.
- `ns_batched`: the same in float32, a call per matrix (as Muon did until 2026-12-04) against a
  call per batch of same-shape matrices (a tall one as its transpose), as Muon.step does now.

Each pair is timed in interleaved rounds (A B, B A, ...; the median call of each round), so the
machine's drift hits both alike; prints each side's median over the rounds and their median
per-round ratio. Run it alone on the machine.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import load_config  # noqa: E402
from model import GPT  # noqa: E402
from optim import newton_schulz  # noqa: E402

CALLS = 5  # calls per side per round; the round's figure is their median


def median_ms(fn):
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved(a, b, rounds):
    for fn in (a, b):  # warm-up
        fn()
    ms = {0: [], 1: []}
    for r in range(rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            ms[side].append(median_ms((a, b)[side]))
    ratio = statistics.median(y / x for x, y in zip(ms[0], ms[1]))
    return statistics.median(ms[0]), statistics.median(ms[1]), ratio


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="key.sub=value, as train.py takes them")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    m, rows = cfg.model, cfg.optim.micro_batch * cfg.data.seq_len
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, m.n_embd, generator=gen, requires_grad=True)
    kv_dim = 2 * m.n_kv_head * (m.n_embd // m.n_head)
    w_q, w_kv = (torch.randn(n, m.n_embd, generator=gen, requires_grad=True) for n in (m.n_embd, kv_dim))
    w_qkv = torch.cat([w_q, w_kv]).detach().requires_grad_()

    def separate():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            (x @ w_q.T).sum().add((x @ w_kv.T).sum()).backward()

    def fused():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            q, kv = (x @ w_qkv.T).split([m.n_embd, kv_dim], dim=1)
            q.sum().add(kv.sum()).backward()

    matrices = [p.detach() for block in GPT(m).blocks for p in block.parameters() if p.ndim == 2]
    grads = [torch.randn(g.shape, generator=gen) for g in matrices]

    def orthogonalise(dtype_):
        return lambda: [newton_schulz(g, cfg.optim.muon_ns_steps, dtype_) for g in grads]

    same_shape = {}
    for g in grads:
        same_shape.setdefault(tuple(sorted(g.shape)), []).append(g.mT if g.size(0) > g.size(1) else g)

    def batched():
        return [newton_schulz(torch.stack(batch), cfg.optim.muon_ns_steps, torch.float32)
                for batch in same_shape.values()]

    print(f"# step_bench {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {args.config} {' '.join(args.overrides)}, "
          f"{args.dtype}, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds of {CALLS} calls (ms per call); "
          f"{len(grads)} matrices in {len(same_shape)} shapes")
    for name, a, b, labels in (("qkv", separate, fused, ("q + kv", "fused")),
                               ("newton_schulz", orthogonalise(torch.float32), orthogonalise(torch.bfloat16),
                                ("float32", "bfloat16")),
                               ("ns_batched", orthogonalise(torch.float32), batched, ("per matrix", "batched"))):
        ms_a, ms_b, ratio = interleaved(a, b, args.rounds)
        print(f"{name:14s} {labels[0]} {ms_a:.3f}  {labels[1]} {ms_b:.3f}  ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
