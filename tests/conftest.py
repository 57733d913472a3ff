from pathlib import Path

import pytest

import data
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "builtin"  # the default data.path; prepared once, shared with real runs


@pytest.fixture(scope="session")
def builtin_1024():
    """The built-in corpus at vocab 1024 (prepared on first use: a few minutes on 2 cores)."""
    val_fraction = load_config(ROOT / "configs" / "base.yaml").data.val_fraction
    return data.prepare_builtin(BUILTIN / "sp1024", 1024, val_fraction, progress=False)
