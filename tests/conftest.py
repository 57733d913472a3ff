import os
from pathlib import Path

import pytest

import data
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "builtin"  # the default data.path; prepared once, shared with real runs

# XLA's CPU backend at LLVM's -O0: the same graphs and graph counts, the same numbers to float summation order,
# and each graph compiles in a twentieth of the time (the block-routed smoke run's 4 graphs: 137 s at the default
# level, 6.4 s at 0, on an AMD EPYC). Set before torch-xla starts here, and inherited by every train.py the tests
# start. Runs outside the tests keep XLA's default.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=2"]).strip()


@pytest.fixture(scope="session")
def builtin_1024():
    """The built-in corpus at vocab 1024 (prepared on first use: a few minutes on 2 cores)."""
    val_fraction = load_config(ROOT / "configs" / "base.yaml").data.val_fraction
    return data.prepare_builtin(BUILTIN / "sp1024", 1024, val_fraction, progress=False)
