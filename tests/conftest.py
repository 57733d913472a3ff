import os
from pathlib import Path

import pytest

import data
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "builtin"  # the default data.path; prepared once, shared with real runs

# XLA's CPU backend at optimization level 2, not its default 3: the same graphs and graph counts, and the block-routed
# smoke run's 4 graphs compile in 8.3 s instead of 38.6 s (AMD EPYC, family 25 model 17, alone). Level 0 moved the
# every-item run's val_bpb 2e-3 from eager's, past what the tests allow for summation order; level 2 keeps it inside.
# Set before torch-xla starts here, and inherited by every train.py the tests start; runs outside the tests keep 3.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=2"]).strip()


@pytest.fixture(scope="session")
def builtin_1024():
    """The built-in corpus at vocab 1024 (prepared on first use: a few minutes on 2 cores)."""
    val_fraction = load_config(ROOT / "configs" / "base.yaml").data.val_fraction
    return data.prepare_builtin(BUILTIN / "sp1024", 1024, val_fraction, progress=False)
