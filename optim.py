"""Optimizers: Muon for the blocks' 2-D matrices, AdamW for the embeddings, the head and the vectors;
the LR and Muon-momentum schedules as functions of progress p = elapsed / budget (never of a step).
train.py builds them (make_optimizers) and sets each group's lr from lr_scale every step."""
import torch

from config import OptimConfig
from model import GPT


# Newton-Schulz coefficients (a, b, c) per iteration. quintic: Keller Jordan's Muon, one triple that
# favours speed over exact convergence. polar_express: Amsel et al. 2025 (arXiv 2505.16932), a
# triple per iteration tuned for 5 iterations, as the parameter-golf records use them since
# 2026-04-09; past the fifth the last (nearly converged) one repeats.
NS_COEFFICIENTS = {
    "quintic": ((3.4445, -4.7750, 2.0315),),
    "polar_express": ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                      (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                      (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                      (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                      (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)),
}


def newton_schulz(grad: torch.Tensor, steps: int, dtype=None, coefficients="quintic") -> torch.Tensor:
    """Approximately orthogonalise a matrix (U S V^T -> U V^T), or each of a batch of same-shape
    matrices (..., m, n), with `steps` quintic Newton-Schulz iterations, x <- a x + (b G + c G^2) x
    with G = x x^T, by NS_COEFFICIENTS[coefficients].
    dtype: what it computes in; by default bfloat16 on GPUs (safe here and fast there), float32
    on CPUs (sweeps/step_bench.py: bfloat16 took 2.0x as long on an AVX512-BF16 CPU without AMX)."""
    table = NS_COEFFICIENTS[coefficients]
    x = grad.to(dtype or (torch.bfloat16 if grad.is_cuda else torch.float32))
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)]
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transposed else x).to(grad.dtype)


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update for each matrix is orthogonalised. row_norm: each row
    of the update divided by its norm first (MuonEq-R); weight_decay: decoupled, times the LR.
    The updates of same-shape matrices (a tall one counts as its transpose: the MLP's two, the
    blocks' query and output projections) are orthogonalised as one batch: a few batched matmuls
    per iteration instead of three per matrix (sweeps/step_bench.py's ns_batched)."""

    def __init__(self, params, lr, momentum, ns_steps, coefficients="quintic", row_norm=False, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, coefficients=coefficients,
                                      row_norm=row_norm, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            same_shape = {}  # sorted shape -> [(parameter, tall, its update or, if tall, its transpose)]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"])
                if group["row_norm"]:
                    update = update / update.norm(dim=1, keepdim=True).clamp_min(1e-7)
                tall = update.size(0) > update.size(1)
                same_shape.setdefault(tuple(sorted(update.shape)), []).append((p, tall, update.mT if tall else update))
            for batch in same_shape.values():
                orthogonal = newton_schulz(torch.stack([wide for _, _, wide in batch]), group["ns_steps"],
                                           coefficients=group["coefficients"])
                for (p, tall, _), update in zip(batch, orthogonal):
                    if group["weight_decay"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    # An orthogonal update has unit singular values; scale tall matrices up to match RMS.
                    p.add_(update.mT if tall else update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)


def param_groups(model: GPT, o: OptimConfig):
    """Split parameters: (Muon matrices, AdamW groups). Every parameter lands in exactly one: the
    blocks' projections go to Muon, the tables and the untied head to their own AdamW groups, and
    everything else (gains, gates, mixes, routers, predictors: vectors, or tables of scalars such
    as Linear(C, 1) routers and per-head gates, nothing to orthogonalise) to the scalars' group."""
    matrices = [m.weight for block in model.blocks for m in block.modules() if isinstance(m, torch.nn.Linear)]
    tables = [t for t in (model.wte.weight, model.value_embed, model.bigram) if t is not None]
    head = [] if model.lm_head is None else [model.lm_head.weight]
    placed = {id(p) for p in matrices + tables + head}
    vectors = [p for p in model.parameters() if id(p) not in placed]
    adam = [dict(params=tables, lr=o.embed_lr, weight_decay=o.weight_decay),
            dict(params=vectors, lr=o.scalar_lr, weight_decay=0.0)]
    if head:
        adam.append(dict(params=head, lr=o.head_lr, weight_decay=o.weight_decay))
    return matrices, adam


def make_optimizers(model: GPT, o: OptimConfig, masters: dict):
    """masters: parameter -> the fp32 copy the optimizer updates instead (bf16 weights); may be empty."""
    matrices, adam_groups = param_groups(model, o)
    matrices = [masters.get(p, p) for p in matrices]
    for group in adam_groups:
        group["params"] = [masters.get(p, p) for p in group["params"]]
    optimizers = [Muon(matrices, lr=o.muon_lr, momentum=o.muon_momentum, ns_steps=o.muon_ns_steps, coefficients=o.muon_ns,
                       row_norm=o.muon_row_norm, weight_decay=o.muon_wd),
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
