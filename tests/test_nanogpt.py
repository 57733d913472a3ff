"""tools/nanogpt.py, the textbook trainer: its records and ledger row, its evaluation scoring the same targets
and bytes as train.py's, its units (an untrained model's val_loss is about ln(vocab)), its schedule, SIGTERM,
and bad input. Every run is stopped by --max-steps or a signal, never by time."""
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ledger
import train
from config import load_config
from tools import nanogpt

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
EVAL_TOKENS = 5000  # not a multiple of 256: whole windows of 256, 19 of them, are scored


def args(tmp_path, *extra):
    return ["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory, builtin_1024):
    """Two steps, a curve point at step 0 only, a final evaluation of EVAL_TOKENS -> (row, metrics records)."""
    tmp_path = tmp_path_factory.mktemp("nanogpt")
    assert nanogpt.main(["--max-steps", "2", *args(tmp_path, "run.log_every=1", "eval.every_seconds=1000",
                                                   "eval.curve_tokens=2048", f"eval.tokens={EVAL_TOKENS}")]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    return row, ledger.read_metrics(tmp_path / "runs", row["run_id"])


def test_a_run_writes_train_curve_final_records_and_one_row(run):
    row, records = run
    assert [(r["kind"], r["step"], r["tokens"]) for r in records] == [
        ("curve", 0, 0), ("train", 1, 4096), ("train", 2, 8192), ("final", 2, 8192)]
    assert records[0]["train_s"] == 0 < records[1]["train_s"] < records[2]["train_s"]
    assert records[3]["train_s"] == records[2]["train_s"]  # evaluation is kept out of training seconds
    assert row["recipe"] == "nanogpt" and row["status"] == "ok" and row["config"] == "tools/nanogpt.py"
    assert int(row["steps"]) == 2 and int(row["tokens"]) == 2 * 16 * 256
    assert row["run_id"].startswith("nanogpt-") and row["clock"] == "wall" and row["device"] == "cpu"
    assert row["overrides"].startswith("--config configs/smoke.yaml --seconds 600 --seed 1337 --max-steps 2 ")
    assert float(row["val_bpb"]) == pytest.approx(records[3]["val_bpb"], rel=1e-5)
    assert float(row["train_s"]) == pytest.approx(records[2]["train_s"], abs=1e-3)


def test_the_final_evaluation_scores_the_targets_and_bytes_train_py_scores(run, tmp_path):
    row, records = run
    assert train.main(args(tmp_path, "data.seq_len=256", "optim.batch_tokens=1024", "budget.max_steps=1",
                           "run.profile_steps=0", f"eval.tokens={EVAL_TOKENS}")) == 0
    (aion,) = ledger.read(tmp_path / "ledger.csv")
    assert int(row["val_tokens"]) == int(aion["val_tokens"]) == EVAL_TOKENS // 256 * 256
    assert int(row["val_bytes"]) == int(aion["val_bytes"])
    final = records[-1]  # full precision (the ledger keeps 6 digits): nats = bits * ln 2, per token and per byte
    assert final["val_bpb"] * math.log(2) * int(row["val_bytes"]) == pytest.approx(
        final["val_loss"] * int(row["val_tokens"]), rel=1e-12)


def test_a_longer_block_keeps_the_tokens_per_step_and_scores_windows_of_eval_seq_len(tmp_path, builtin_1024):
    """--block 1024: 4 windows of 1,024 per step, learned positions up to 1,024; scored on windows of 512 (eval.seq_len),
    4 of them per forward (eval.batch_size 2 rows of the block's tokens), the targets train.py scores there."""
    assert nanogpt.main(["--max-steps", "1", "--block", "1024",
                         *args(tmp_path, "eval.every_seconds=0", "eval.seq_len=512", "eval.batch_size=2",
                               f"eval.tokens={EVAL_TOKENS}")]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert int(row["tokens"]) == 4096 and int(row["val_tokens"]) == EVAL_TOKENS // 512 * 512
    assert " --block 1024 " in row["overrides"] and "4x1024 random windows" in row["notes"]
    assert nanogpt.eval_windows(load_config(SMOKE, ["eval.seq_len=512", "eval.batch_size=2"]), 1024) == (512, 4)
    x, y = nanogpt.batch(np.arange(5000), np.random.default_rng(0), 1024)
    assert x.shape == y.shape == (4, 1024) and bool((y[:, :-1] == x[:, 1:]).all())


def test_the_default_block_is_the_configs_eval_seq_len(tmp_path, builtin_1024):
    """No --block: the block is eval.seq_len (cpu.yaml's 2,048; 1,024 here), recorded in the row as if given."""
    assert nanogpt.main(["--max-steps", "1", *args(tmp_path, "eval.every_seconds=0", "eval.seq_len=1024",
                                                   f"eval.tokens={EVAL_TOKENS}")]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert " --block 1024 " in row["overrides"] and "4x1024 random windows" in row["notes"]
    assert int(row["val_tokens"]) == EVAL_TOKENS // 1024 * 1024


def test_an_untrained_model_scores_about_ln_vocab(run):
    _, records = run
    assert records[0]["step"] == 0 and abs(records[0]["val_loss"] - math.log(1024)) < 0.1


def test_lr_warms_up_by_step_then_decays_by_time():
    assert nanogpt.lr_at(0, 0.0) == pytest.approx(6e-4 / 101)
    assert nanogpt.lr_at(99, 0.5) == pytest.approx(6e-4 * 100 / 101)
    assert nanogpt.lr_at(100, 0.0) == pytest.approx(6e-4)
    assert nanogpt.lr_at(5000, 0.5) == pytest.approx((6e-4 + 6e-5) / 2)
    assert nanogpt.lr_at(5000, 1.0) == nanogpt.lr_at(5000, 1.2) == pytest.approx(6e-5)


def test_sigterm_stops_between_steps_with_an_interrupted_row(tmp_path, builtin_1024):
    proc = subprocess.Popen([sys.executable, "-m", "tools.nanogpt", "--max-steps", "50",
                             *args(tmp_path, "run.log_every=1")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step:1 "):
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "interrupted" and row["val_bpb"] == "" and 1 <= int(row["steps"]) < 50
    records = [json.loads(line) for line in (tmp_path / "runs" / row["run_id"] / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train"} and records[-1]["step"] == int(row["steps"])


@pytest.mark.parametrize("extra, message", [
    (["--seconds", "0"], "--seconds: expected > 0, got 0"),
    (["--max-steps", "-1"], "--max-steps: expected >= 0, got -1"),
    (["eval.batch_size=0"], "eval.batch_size: expected > 0, got 0"),
    (["--block", "300"], "--block: expected a divisor of 4096 (the tokens per step), got 300"),
    (["--block", "512", "eval.seq_len=1024"], "eval.seq_len: expected at most --block (512: the learned positions), got 1024"),
])
def test_bad_input_stops_before_any_work(tmp_path, capsys, extra, message):
    assert nanogpt.main([*extra, *args(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.csv").exists()


def test_a_crash_is_recorded_as_failed(tmp_path, builtin_1024, monkeypatch):
    def crash(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(nanogpt, "train_step", crash)
    with pytest.raises(RuntimeError, match="boom"):
        nanogpt.main(args(tmp_path))
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "failed" and row["steps"] == "0" and row["notes"].endswith("RuntimeError: boom")
