"""The AWS Trainium Frontier competition's rules, as AION applies them (the kit's prepare.py is not public:
its semantics come from karpathy/autoresearch's prepare.py, which the kit derives from, and public team
write-ups; README, "The competition's task"):

- scoring: `evaluate_bpb` recomputes cross-entropy from the logits of the model `load_for_eval` returns, over
  packed validation rows (data.packed_val_batches), and divides by the bytes of the kit's `token_bytes` table;
  targets with 0 bytes (the special tokens, BOS among them) are left out of both sums;
- launch: one trn2 chip, used whole: 8 processes at NEURON_LOGICAL_NC_CONFIG=1 or 4 at 2.

train.py imports this module; it imports nothing of AION's but config's error type.
"""
import math

import torch
import torch.nn.functional as F

from config import ConfigError

# NEURON_LOGICAL_NC_CONFIG -> the processes (one per logical core) that use a trn2 chip's 8 physical cores whole.
LAUNCH_SHAPES = {1: 8, 2: 4}


def launch_command(lnc: int, config: str) -> str:
    return (f"NEURON_LOGICAL_NC_CONFIG={lnc} torchrun --standalone --nproc_per_node={LAUNCH_SHAPES[lnc]} train.py "
            f"--config {config}")


def check_launch(world_size: int, lnc: str):
    """A launch the kit allows: the whole chip, as LAUNCH_SHAPES; else ConfigError naming both allowed shapes."""
    allowed = " or ".join(f"{n} processes at NEURON_LOGICAL_NC_CONFIG={k}" for k, n in LAUNCH_SHAPES.items())
    if not (lnc.isdigit() and LAUNCH_SHAPES.get(int(lnc)) == world_size):
        raise ConfigError(f"budget.charge=kit: the kit scores a run that uses one trn2 chip whole, {allowed}; got "
                          f"WORLD_SIZE={world_size} at NEURON_LOGICAL_NC_CONFIG={lnc}")


@torch.no_grad()
def evaluate_bpb(model, batches, token_bytes: torch.Tensor, backend) -> tuple:
    """The kit's val_bpb of `model` (load_for_eval's: forward(idx) -> logits [B, T, V]) over `batches` of
    (x, y) int64 [B, T] -> (val_bpb, nats, bytes, scored tokens). token_bytes: int [V], the kit's table.
    backend (train.Backend): the device, the step boundary (XLA: one graph per batch) and the sum dtype; the sums
    stay on the device and are read once, at the end. No autocast: the scorer calls the model as it is."""
    token_bytes = token_bytes.to(backend.device)
    nats = torch.zeros(1, dtype=backend.sum_dtype).to(backend.device)
    counts = torch.zeros(2, dtype=torch.int64).to(backend.device)  # bytes, scored tokens
    backend.mark_step()  # XLA: the model's 0-dim buffers become graph constants; made here, every batch is one graph
    for x, y in batches:
        x, y = x.to(backend.device), y.to(backend.device).flatten()
        nll = F.cross_entropy(model(x).float().flatten(0, 1), y, reduction="none")
        n_bytes = token_bytes[y]
        scored = n_bytes > 0
        nats += (nll * scored).sum().to(nats.dtype)
        counts += torch.stack([n_bytes.sum(), scored.sum()])
        backend.mark_step()
    (total_nats,), (total_bytes, tokens) = nats.tolist(), counts.tolist()
    return total_nats / (math.log(2) * total_bytes), total_nats, total_bytes, tokens
