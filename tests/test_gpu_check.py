"""tools/gpu_check.py: without CUDA it refuses before any work; its steps are the four GPU checks
(CUDA training, the compiled Triton kernel tests, the kernel bench, a device.compile run) within
9 minutes; --only runs the steps named. The steps themselves run only on a GPU, as `python -m tools.gpu_check`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tools import gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal is checked where there is no GPU; here "
                                                      "`python -m tools.gpu_check` is the real check (minutes)")
def test_without_cuda_it_exits_2_before_any_work(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(out)], cwd=ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to "
                                   "check. Run it on a machine with an NVIDIA GPU.")
    assert proc.stdout == ""
    assert not out.exists()


def overrides(argv):
    """key -> value of the key.sub=value arguments, each value parsed as train.py parses it (YAML)."""
    return {a.split("=", 1)[0]: yaml.safe_load(a.split("=", 1)[1]) for a in argv if "=" in a and not a.startswith("-")}


def test_the_steps_are_the_gpu_checks_within_9_minutes():
    assert [name for name, *_ in gpu_check.STEPS] == ["train", "kernel_tests", "bench", "compile"]
    train_argv, tests_argv, bench_argv, compiled_argv = (argv for _, argv, _ in gpu_check.STEPS)
    assert train_argv[1:4] == ["train.py", "--config", "configs/base.yaml"]
    assert overrides(train_argv) == {"budget.seconds": 90, "device.type": "cuda", "run.profile_steps": 1,
                                     "run.name": "gpu_check", "ledger.notes": "gpu_check: CUDA path"}  # a string
    assert tests_argv[1:4] == ["-m", "pytest", "-q"] and "tests/test_kernels.py" in tests_argv
    assert bench_argv[1:] == ["-m", "tools.kernel_bench", "--config", "configs/base.yaml", "device.type=cuda"]
    assert compiled_argv[1:4] == ["train.py", "--config", "configs/base.yaml"]
    assert overrides(compiled_argv) == {"budget.seconds": 60, "device.type": "cuda", "device.compile": True,
                                        "run.profile_steps": 1, "run.name": "gpu_check_compile",
                                        "ledger.notes": "gpu_check: device.compile on CUDA"}
    assert all(argv[0] == sys.executable for _, argv, _ in gpu_check.STEPS)
    # The margin: GRACE_S of the 540 s is kept back to stop a step that overran and write the report.
    assert gpu_check.GRACE_S >= 10
    assert sum(timeout for *_, timeout in gpu_check.STEPS) + gpu_check.GRACE_S <= 540


def test_train_seconds_sets_the_first_runs_budget_and_timeout():
    default, shorter = gpu_check.steps()[0], gpu_check.steps(train_seconds=60)[0]
    assert overrides(shorter[1])["budget.seconds"] == 60
    assert default[2] - shorter[2] == 30
    assert gpu_check.steps(60)[1:] == gpu_check.STEPS[1:]
