"""Optimizers: Muon for the blocks' 2-D matrices, AdamW for the embeddings, the head and the vectors;
the LR and Muon-momentum schedules as functions of progress p = elapsed / budget (never of a step).
train.py builds them (make_optimizers) and sets each group's lr from lr_scale every step."""
import torch

from config import OptimConfig
from model import GPT


def newton_schulz(grad: torch.Tensor, steps: int, dtype=None) -> torch.Tensor:
    """Approximately orthogonalise a matrix (U S V^T -> U V^T) with a quintic Newton-Schulz
    iteration whose coefficients favour speed over exact convergence (Keller Jordan's Muon).
    dtype: what it computes in; by default bfloat16 on GPUs (safe here and fast there), float32
    on CPUs (sweeps/step_bench.py: bfloat16 took 2.0x as long on an AVX512-BF16 CPU without AMX)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.to(dtype or (torch.bfloat16 if grad.is_cuda else torch.float32))
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transposed else x).to(grad.dtype)


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update for each matrix is orthogonalised."""

    def __init__(self, params, lr, momentum, ns_steps):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = newton_schulz(p.grad.add(buf, alpha=group["momentum"]), group["ns_steps"])
                # An orthogonal update has unit singular values; scale tall matrices up to match RMS.
                p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)


def param_groups(model: GPT, o: OptimConfig):
    """Split parameters: (Muon matrices, AdamW groups). Every parameter lands in exactly one."""
    matrices = [p for block in model.blocks for p in block.parameters() if p.ndim == 2]
    # Routers and predictors are Linear(C, 1): a row, not a matrix to orthogonalise.
    vectors = ([p for block in model.blocks for p in block.parameters() if p.ndim != 2]
               + list(model.routers.parameters()) + list(model.gates.parameters()))
    tables = [t for t in (model.wte.weight, model.value_embed, model.bigram) if t is not None]
    adam = [dict(params=tables, lr=o.embed_lr, weight_decay=o.weight_decay),
            dict(params=vectors, lr=o.scalar_lr, weight_decay=0.0)]
    if model.lm_head is not None:
        adam.append(dict(params=[model.lm_head.weight], lr=o.head_lr, weight_decay=o.weight_decay))
    return matrices, adam


def make_optimizers(model: GPT, o: OptimConfig, masters: dict):
    """masters: parameter -> the fp32 copy the optimizer updates instead (bf16 weights); may be empty."""
    matrices, adam_groups = param_groups(model, o)
    matrices = [masters.get(p, p) for p in matrices]
    for group in adam_groups:
        group["params"] = [masters.get(p, p) for p in group["params"]]
    optimizers = [Muon(matrices, lr=o.muon_lr, momentum=o.muon_momentum, ns_steps=o.muon_ns_steps),
                  torch.optim.AdamW(adam_groups, betas=(o.beta1, o.beta2), eps=1e-10)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return optimizers


def muon_momentum(p: float, o: OptimConfig) -> float:
    """Muon's momentum at progress p: linear from muon_momentum_start to muon_momentum over the first
    muon_momentum_warmup of the budget (modded-nanogpt record 9: 0.85 -> 0.95), then constant."""
    if p >= o.muon_momentum_warmup:
        return o.muon_momentum
    return o.muon_momentum_start + (o.muon_momentum - o.muon_momentum_start) * max(p, 0.0) / o.muon_momentum_warmup


def lr_scale(p: float, o: OptimConfig) -> float:
    """LR multiplier at progress p in [0, 1]: linear warmup, constant, linear warmdown to lr_floor."""
    p = min(max(p, 0.0), 1.0)
    if o.warmup > 0 and p < o.warmup:
        return p / o.warmup
    if o.warmdown > 0 and p > 1 - o.warmdown:
        return o.lr_floor + (1 - o.lr_floor) * (1 - p) / o.warmdown
    return 1.0
