"""Causal attention, forward + backward, at configs/cpu.yaml's shape: which implementation and head
size train fastest on this machine. Attention was 27 % of the float32 step of configs/cpu.yaml in
its op profile on an AVX2 CPU (SDPA's flash backward alone 19 %) and 51 % of the bfloat16 step on
an AMX CPU.

    python sweeps/attention_bench.py [--dtype float32|bfloat16] [--reps 20]

Implementations: `sdpa` (F.scaled_dot_product_attention, the model's; its CPU flash kernel),
`sdpa_math` (SDPA's math backend), `explicit` (masked softmax(q k^T) v written out, keys and values
repeated for grouped-query attention), `explicit_compiled` (the same under torch.compile), and for
bfloat16 `sdpa_fp32` (the inputs cast to float32 for SDPA, the output cast back). Head layouts keep
the width (96) and change how it splits: heads x head size, with the key/value heads. Prints the
median milliseconds of one call (forward and backward) per implementation and layout. Run it alone
on the machine.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH, SEQ, WIDTH = 32, 256, 96
LAYOUTS = [(4, 2), (4, 4), (2, 1), (2, 2), (1, 1)]  # (heads, kv heads): head size WIDTH / heads


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v)


def explicit(q, k, v):
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.size(-1) ** -0.5  # (B, H, T, T)
    causal = torch.ones(q.size(2), q.size(2), dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


def sdpa_fp32(q, k, v):
    return sdpa(q.float(), k.float(), v.float()).to(q.dtype)


def time_call(fn, heads, kv_heads, dtype, reps):
    head_dim = WIDTH // heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, heads, SEQ, head_dim, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(BATCH, kv_heads, SEQ, head_dim, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(BATCH, heads, SEQ, head_dim, generator=gen).to(dtype)
    times = []
    for i in range(reps + 3):  # 3 warm-up calls (compile, allocator)
        start = time.perf_counter()
        fn(q, k, v).backward(grad)
        if i >= 3:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    impls = {"sdpa": sdpa, "sdpa_math": sdpa_math, "explicit": explicit,
             "explicit_compiled": torch.compile(explicit, dynamic=False)}
    if dtype == torch.bfloat16:
        impls["sdpa_fp32"] = sdpa_fp32
    print(f"# causal attention fwd+bwd, batch {BATCH} x seq {SEQ}, width {WIDTH}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, median of {args.reps} calls (ms)")
    print("heads kv head_dim " + " ".join(f"{name:>17}" for name in impls))
    for heads, kv_heads in LAYOUTS:
        row = [time_call(fn, heads, kv_heads, dtype, args.reps) for fn in impls.values()]
        print(f"{heads:5} {kv_heads:2} {WIDTH // heads:8} " + " ".join(f"{ms:17.1f}" for ms in row), flush=True)


if __name__ == "__main__":
    main()
