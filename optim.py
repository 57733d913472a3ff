"""Optimizers: Muon for the blocks' 2-D matrices, AdamW for the embeddings, the head and the vectors;
the LR and Muon-momentum schedules as functions of progress p = elapsed / budget (never of a step).
train.py builds them (make_optimizers) and sets each group's lr from lr_scale every step."""
import math

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
    on CPUs (sweeps/step_bench.py: bfloat16 took 2.0x as long on an AVX512-BF16 CPU without AMX).
    The normalisation is in the gradient's own precision (float32) before the cast: a norm summed in
    bfloat16 (XLA's CPU reduction) comes out too small, the iteration then starts above its
    convergent range and overflows (trn2.yaml with optim.muon_bf16 on XLA: a NaN at step 2)."""
    table = NS_COEFFICIENTS[coefficients]
    transposed = grad.size(-2) > grad.size(-1)
    x = grad.mT if transposed else grad
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype or (torch.bfloat16 if grad.is_cuda else torch.float32))
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
    per iteration instead of three per matrix (sweeps/step_bench.py's ns_batched).

    The momentum is buf <- mu buf + g and the update g + mu buf. The competition lineage (FrontierForge
    K82s4, recipes/K82s4/train.py, github marker2601/trainium-simulator) keeps an EMA, M <- mu M +
    (1 - mu) g, and updates by (1 - mu) g + mu M: for a constant mu that is (1 - mu) times this
    update, a scale Newton-Schulz's normalisation removes (the same orthogonalised update to float
    tolerance; tests/test_lineage_optim.py). While mu ramps (optim.muon_momentum_warmup) the two
    forms weigh past gradients slightly differently.

    Two more of that recipe's items, both off by default:
    - normuon_beta2 > 0 (NorMuon; K82s4: 0.9): after Newton-Schulz, each neuron along the matrix's
      larger side (the rows of a square one) keeps a second moment S <- beta2 S + (1 - beta2) mean(X^2),
      the mean over the other side, no bias correction; X <- X / sqrt(max(S, 1e-10)), rescaled to the
      Frobenius norm X had: only the neurons' relative scales change.
    - cautious_wd: the decay applies only where the update and the weight have the same sign,
      w <- w - lr wd w [update * w >= 0] (K82s4's cautious decay; coupled to the LR as weight_decay is)."""

    def __init__(self, params, lr, momentum, ns_steps, coefficients="quintic", row_norm=False, weight_decay=0.0,
                 normuon_beta2=0.0, cautious_wd=False, ns_dtype=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, coefficients=coefficients,
                                      row_norm=row_norm, weight_decay=weight_decay, normuon_beta2=normuon_beta2,
                                      cautious_wd=cautious_wd, ns_dtype=ns_dtype))

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
                                           group["ns_dtype"], group["coefficients"])
                if group["normuon_beta2"]:
                    orthogonal = self.normuon([p for p, _, _ in batch], orthogonal, group["normuon_beta2"])
                for (p, tall, _), update in zip(batch, orthogonal):
                    update = update.mT if tall else update
                    if group["weight_decay"] and group["cautious_wd"]:
                        p.sub_(p * (update * p >= 0), alpha=group["lr"] * group["weight_decay"])
                    elif group["weight_decay"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    # An orthogonal update has unit singular values; scale tall matrices up to match RMS.
                    p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)

    def normuon(self, params: list, orthogonal: torch.Tensor, beta2: float) -> torch.Tensor:
        """NorMuon on a batch of orthogonalised updates, each wide (a tall matrix as its transpose): the
        neurons are the columns of a rectangular one (its original larger side either way) and the rows
        of a square one. Each parameter's state keeps its S, one value per neuron."""
        square = orthogonal.size(-2) == orthogonal.size(-1)
        over = -1 if square else -2  # the axis each neuron's mean runs over
        moments = [self.state[p].setdefault("normuon_buffer", orthogonal.new_zeros(orthogonal.size(-2 if square else -1)))
                   for p in params]
        moment = torch.stack(moments).mul_(beta2).add_(orthogonal.square().mean(over), alpha=1 - beta2)
        for state, new in zip(moments, moment):
            state.copy_(new)
        scaled = orthogonal / moment.clamp_min(1e-10).sqrt().unsqueeze(over)
        before, after = (x.norm(dim=(-2, -1), keepdim=True) for x in (orthogonal, scaled))
        return scaled * (before / after.clamp_min(1e-10))


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
    adam = [dict(params=tables, lr=o.embed_lr, weight_decay=o.weight_decay, betas=o.embed_betas),
            dict(params=vectors, lr=o.scalar_lr, weight_decay=0.0, betas=o.scalar_betas)]
    if head:  # optim.head_wd: its own decay (K82s4: 0.01, the tables 0.001); -1 = optim.weight_decay
        adam.append(dict(params=head, lr=o.head_lr, weight_decay=o.weight_decay if o.head_wd < 0 else o.head_wd,
                         betas=o.head_betas))
    for group in adam:  # optim.<group>_betas: the group's own (K82s4's per group), else optim.beta1 and beta2
        group["betas"] = tuple(group["betas"]) or (o.beta1, o.beta2)
    return matrices, adam


def muon_groups(model: GPT, matrices: list, o: OptimConfig) -> list:
    """Muon's parameter groups: one, or with optim.mlp_proj_lr != 1 the MLP output projections in a
    second at muon_lr * mlp_proj_lr (K82s4's FF_MLP_PROJ_LR = 0.8: "about -0.0004 bpb, step-normalised",
    its docs/FINDINGS.md section 3). The split also splits Newton-Schulz's batches by group."""
    if o.mlp_proj_lr == 1:
        return [dict(params=matrices)]
    projections = {id(block.mlp.c_proj.weight) for block in model.blocks}
    return [dict(params=[p for p in matrices if id(p) not in projections]),
            dict(params=[p for p in matrices if id(p) in projections], lr=o.muon_lr * o.mlp_proj_lr)]


def make_optimizers(model: GPT, o: OptimConfig, masters: dict):
    """masters: parameter -> the fp32 copy the optimizer updates instead (bf16 weights); may be empty."""
    matrices, adam_groups = param_groups(model, o)
    muon = muon_groups(model, matrices, o)
    for group in muon + adam_groups:
        group["params"] = [masters.get(p, p) for p in group["params"]]
    optimizers = [Muon(muon, lr=o.muon_lr, momentum=o.muon_momentum, ns_steps=o.muon_ns_steps, coefficients=o.muon_ns,
                       row_norm=o.muon_row_norm, weight_decay=o.muon_wd, normuon_beta2=o.normuon_beta2,
                       cautious_wd=o.muon_wd_cautious, ns_dtype=torch.bfloat16 if o.muon_bf16 else None),
                  torch.optim.AdamW(adam_groups, eps=1e-10)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return optimizers


def muon_momentum(p: float, o: OptimConfig, full_batches: float = 0.0) -> float:
    """Muon's momentum at progress p: linear from muon_momentum_start to muon_momentum over the first
    muon_momentum_warmup of the budget (modded-nanogpt record 9: 0.85 -> 0.95), then constant; with
    muon_momentum_warmup_steps = N over the first N full batches trained instead (FrontierForge K82s4's
    muon_momentum over its micro-batches done / per step: 300)."""
    if o.muon_momentum_warmup_steps:
        done = min(full_batches / o.muon_momentum_warmup_steps, 1.0)
    elif p >= o.muon_momentum_warmup:
        return o.muon_momentum
    else:
        done = max(p, 0.0) / o.muon_momentum_warmup
    return o.muon_momentum_start + (o.muon_momentum - o.muon_momentum_start) * done


def lr_scale(p: float, o: OptimConfig, step: int = 0) -> float:
    """LR multiplier at progress p in [0, 1] for the optimizer step `step` (0-based): linear warmup (with
    optim.warmup_steps = N over steps instead: (step + 1) / N, K82s4's), constant, warmdown to lr_floor: linear,
    or with optim.warmdown_steps = N in N equal drops, lr_floor + (1 - lr_floor) * level / (N + 1) with
    level N, N - 1, ..., 1 in turn over the warm-down's N equal parts, the last held to the end (never
    lr_floor itself). FrontierForge K82s4's cool-down (recipes/K82s4/train.py, cooldown_level) is
    warmdown 0.7, N 19, lr_floor 0: 0.95, 0.90, ..., 0.05."""
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    p = min(max(p, 0.0), 1.0)
    if o.warmup > 0 and p < o.warmup:
        return p / o.warmup
    if o.warmdown > 0 and p > 1 - o.warmdown:
        if o.warmdown_steps:
            n = o.warmdown_steps
            level = max(1, n - math.floor((p - (1 - o.warmdown)) / o.warmdown * n))
            return o.lr_floor + (1 - o.lr_floor) * level / (n + 1)
        return o.lr_floor + (1 - o.lr_floor) * (1 - p) / o.warmdown
    return 1.0


# -- the lineage's training-loss and averaging levers (FrontierForge K82s4: recipes/K82s4/train.py of
# github marker2601/trainium-simulator; effects measured there, docs/FINDINGS.md) ---------------------------

def mtp_weights(p: float, o: OptimConfig) -> list:
    """optim.mtp_weights at progress p, as GPT.set_mtp_weights takes them: extra target k's weight fades linearly
    from optim.mtp_weights[k] to 0 between the progress where the next one's fade ended (for the farthest, 0) and
    optim.mtp_until[k]. The farthest fades first, as in K82s4 (mtp_weight_table, mtp_stage_of: t+3's 0.25 by
    p = 0.2, then t+2's 0.5 by 0.45). K82s4 steps through 4 levels per fade at each level's midpoint weight;
    here the fade is continuous, equal at those midpoints (a device buffer, so no graph is added); with
    optim.mtp_levels = N it steps as K82s4's does: N levels per fade, each the continuous fade's value at its
    midpoint, 1 - (j + 0.5) / N of the weight in the fade's j-th N-th (K82s4's first: 0.25 x 7/8 = 0.21875)."""
    starts = (*o.mtp_until[1:], 0.0)
    if not o.mtp_levels:
        return [w * min(1.0, max(0.0, (until - p) / (until - start)))
                for w, until, start in zip(o.mtp_weights, o.mtp_until, starts)]
    n, p = o.mtp_levels, max(p, 0.0)
    level = [min(n - 1, math.floor((p - start) / (until - start) * n)) for until, start in zip(o.mtp_until, starts)]
    return [w if p < start else 0.0 if p >= until else w * (1 - (j + 0.5) / n)
            for w, until, start, j in zip(o.mtp_weights, o.mtp_until, starts, level)]


EMA_PREWARM_STEP = 4  # optim.ema_prewarm: the extra update follows this optimizer step (K82s4's startup steps - 1)


def ema_weight(step: int, o: OptimConfig) -> float:
    """w of optim.ema's update after optimizer step `step` (0-based), average <- average + w (weights - average):
    1 - (ema^ema_every)^n for the n updates due then, one every ema_every steps and, with ema_prewarm, one after
    step EMA_PREWARM_STEP; 0 without one. ema_every 1 without prewarm: 1 - ema every step, the EMA as before."""
    updates = ((step + 1) % o.ema_every == 0) + (o.ema_prewarm and step + 1 == EMA_PREWARM_STEP)
    return 1 - (o.ema ** o.ema_every) ** updates


class WeightAverage(dict):
    """optim.ema: each tensor the optimizers update (a parameter, or its fp32 master) -> its moving average, started
    at the initial weights; empty when optim.ema is 0. Training never reads it; evaluation and load_for_eval use
    weights + ema_blend * (average - weights): the average itself at 1.
    From K82s4 (ema_update, ema_blend_host): decay 0.99 applied every 32 steps (ema_every: decay 0.99^32 = 0.725
    per update), blend 0.6, measured about -0.0005 val_bpb (FINDINGS §3, one pair); prewarm, one extra update after
    the 4th step: there it compiled the update before the charged clock started (about -0.0003, 15-30 steps
    recovered); here it is only that update, long decayed by a run's end."""

    def __init__(self, weights, o: OptimConfig):
        super().__init__({w: w.detach().clone() for w in weights} if o.ema else {})
        self.o, self.rates, self.evaluating = o, {}, False  # rates: ema_weight -> it as a device tensor (XLA)
        self.held = {w: w.detach().clone() for w in self} if o.ema_blend != 1 else {}  # the weights during evaluation

    @torch.no_grad()
    def update_(self, step: int):
        """The update after optimizer step `step` (ema_weight), on the device, no host sync. On XLA with ema_every
        or ema_prewarm, w is a device tensor made once per value on the host: data, where a Python 0 (a step
        without an update) would be a graph constant, a graph of its own; so every step is one graph. Elsewhere a
        step without an update skips it (a lerp by 0 would change nothing)."""
        w, weights = ema_weight(step, self.o), list(self)
        if not weights:
            return
        if weights[0].device.type == "xla" and (self.o.ema_every > 1 or self.o.ema_prewarm):
            if w not in self.rates:
                self.rates[w] = torch.tensor([w]).to(weights[0].device)  # 1 element: a 0-dim one would be a constant
            w = [self.rates[w].view(())] * len(weights)
        elif not w:
            return
        torch._foreach_lerp_(list(self.values()), weights, w)

    @torch.no_grad()
    def swap_(self):
        """Exchange the weights with what evaluation uses, in place (a compiled loss stays bound to the same
        tensors); the next call exchanges them back. ema_blend 1: weights and average trade places. Otherwise the
        weights go to `held` and become lerp(weights, average, ema_blend), and come back on the next call: both
        directions are one computation, told apart by a flag made on the host, so on XLA one graph as the trade."""
        if self.o.ema_blend == 1:
            for weights, average in self.items():
                held = weights.clone()
                weights.copy_(average)
                average.copy_(held)
            return
        self.evaluating = not self.evaluating
        back = torch.tensor([not self.evaluating]).to(next(iter(self)).device).view(())
        for weights, average in self.items():
            held = self.held[weights]
            evaluated = torch.where(back, held, torch.lerp(weights, average, self.o.ema_blend))
            held.copy_(torch.where(back, held, weights))
            weights.copy_(evaluated)
