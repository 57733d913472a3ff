"""Fused kernels for AION's hot ops, switchable per op from the config section `kernels`.

Every op has one definition, kernels/reference.py (plain torch, what the model computed before
kernels existed); `triton` (CUDA) and `nki` (Trainium) implementations have the same signature
and are tested against it. This package imports nothing else of AION's: model.py imports it.
Implementation modules are imported only when resolved, so neither triton nor nki has to be
installed for the reference.
"""

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

from kernels import reference

# op (the config key) -> its function name, the same in reference.py and in every
# kernels/<impl>_<op>.py module.
FUNCTIONS = {"head": "head_nll", "rmsnorm": "rms_norm", "qk_norm_rope": "qk_norm_rope", "relu2": "relu2"}
OPS = tuple(FUNCTIONS)
IMPLS = ("torch", "triton", "nki")

# What `auto` picks, per platform (platform()). The rule: an implementation is listed only where
# `python -m tools.kernel_bench` measured it faster than the reference on that platform, and a training
# run used it there; elsewhere the reference. CUDA, NVIDIA H200, 2026-12-04 (`python -m tools.kernel_bench
# --config configs/base.yaml device.type=cuda`, eager bf16, fwd+bwd, Triton / reference): head 1.64x,
# rmsnorm 2.22x, qk_norm_rope 0.72x, relu2 0.84x. The two that win have not yet trained on a GPU (eager
# or under torch.compile), so cuda stays the reference (docs/experiments.md, "The first GPU check").
# No Trainium run has been made. Record the bench command, date and numbers here with a change.
AUTO = {
    platform: {op: "torch" for op in OPS}
    for platform in ("cpu", "cuda", "xla-cpu", "xla-neuron", "neuron")
}


class KernelError(ValueError):
    """An implementation chosen in the config cannot run on this backend."""


@dataclass(frozen=True)
class Kernels:
    """The resolved implementation of every op: callables with the reference signatures, and
    `chosen`, op -> implementation name (for the log)."""
    head: Callable
    rmsnorm: Callable
    qk_norm_rope: Callable
    relu2: Callable
    chosen: dict

    def __str__(self):
        return " ".join(f"{op}:{impl}" for op, impl in self.chosen.items())


REFERENCE = Kernels(**{op: getattr(reference, name) for op, name in FUNCTIONS.items()},
                    chosen={op: "torch" for op in OPS})


def platform(kind: str, on_trainium: bool = False) -> str:
    """The AUTO key of a backend: device kind cpu | cuda | xla | neuron; torch-xla splits by
    the device it drives (its CPU backend, or Trainium)."""
    assert kind in ("cpu", "cuda", "xla", "neuron"), kind
    return f"xla-{'neuron' if on_trainium else 'cpu'}" if kind == "xla" else kind


def unavailable(impl: str, kind: str, on_trainium: bool) -> str:
    """Why `impl` cannot run on this backend, or "" if it can."""
    if impl == "triton":
        if kind != "cuda":
            return f"Triton kernels need device.type=cuda, this run's device is {kind}"
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not importable"
    if impl == "nki":
        if not (kind == "neuron" or (kind == "xla" and on_trainium)):
            return (f"NKI kernels need device.type=neuron or device.type=xla on Trainium, this run's device is "
                    f"{kind}{' (CPU PJRT)' if kind == 'xla' else ''}")
        if importlib.util.find_spec("nki") is None:
            return "the nki package (Neuron SDK) is not importable"
    return ""


def resolve(choices: dict, kind: str, on_trainium: bool = False) -> Kernels:
    """choices: op -> auto | torch | triton | nki (the config section `kernels`) -> Kernels for
    device kind cpu | cuda | xla | neuron. Raises KernelError naming the key when an explicit
    choice (or the AUTO table's) cannot run here."""
    assert set(choices) == set(OPS), sorted(choices)
    chosen, fns = {}, {}
    for op, choice in choices.items():
        impl = AUTO[platform(kind, on_trainium)][op] if choice == "auto" else choice
        if impl not in IMPLS:
            raise KernelError(f"kernels.{op}={choice}: expected auto | {' | '.join(IMPLS)}")
        reason = unavailable(impl, kind, on_trainium)
        if reason:
            via = f" (auto picks {impl} here, kernels/__init__.py AUTO)" if choice == "auto" else ""
            raise KernelError(f"kernels.{op}={choice}{via}: {reason}")
        module = reference if impl == "torch" else importlib.import_module(f"kernels.{impl}_{op}")
        chosen[op], fns[op] = impl, getattr(module, FUNCTIONS[op])
    return Kernels(**fns, chosen=chosen)
