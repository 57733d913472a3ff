import os

# Set before torch loads (libgomp reads its thread count then), and inherited by every train.py the tests start (runs
# outside the tests keep their defaults). The figures: CPU seconds (user + system, children included) on an AMD EPYC
# (family 25 model 17), measured beside two nice-19 runs:
# - One torch thread per process. The README's command runs a test on each core (pytest-xdist), and torch's default
#   of a thread per core in each spins against the other: tests/test_kit_contract.py at -n 2 took 98 CPU-s with the
#   default and 48 with one.
# - Inductor compiles in the run's own process, not in a pool of workers that each start torch again: the
#   every-item smoke run's cold compile took 86 CPU-s against 93 with a pool of two.
# - XLA's CPU backend at LLVM optimization level 0 (its default is 3): the same graphs and graph counts; a 4-layer smoke
#   run on XLA took 13.6 CPU-s against 19.9 at level 2. Level 0 moves the every-item run's val_bpb 2e-3 from eager's,
#   past the tolerance for summation order, and runs a full-size model slower: those tests use `xla_level_2`.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = f"{XLA_FLAGS} --xla_backend_optimization_level=0".strip()

from pathlib import Path

import pytest

import data
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "builtin"  # the default data.path; prepared once, shared with real runs


@pytest.fixture
def xla_level_2(monkeypatch):
    """XLA's CPU backend at optimization level 2 for the train.py runs this test starts."""
    monkeypatch.setenv("XLA_FLAGS", f"{XLA_FLAGS} --xla_backend_optimization_level=2".strip())


@pytest.fixture(scope="session")
def builtin_1024():
    """The built-in corpus at vocab 1024 (prepared on first use: a few minutes on 2 cores)."""
    val_fraction = load_config(ROOT / "configs" / "base.yaml").data.val_fraction
    return data.prepare_builtin(BUILTIN / "sp1024", 1024, val_fraction, progress=False)
