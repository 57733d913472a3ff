"""The op profile of every run: run.profile_steps steady-state steps recorded into
runs/<id>/profile.txt and trace.json, kept out of the budget and the step times, the top three
ops in the ledger; torch-xla through its own profiler without adding graphs."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ledger
import kernels.profile
import train
from train import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
XLA_GRAPHS = 3  # as in test_backends: first train step, steady train step, eval


def overrides(tmp_path, *extra):
    return [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", "budget.seconds=600", *extra]


def op_rows(text: str) -> list:
    """profile.txt's table -> [(op, calls/step, self ms/step, share %)], from the lines after the column header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("op ")) + 1
    return [(m[1], float(m[2]), float(m[3]), float(m[4])) for m in
            (re.match(r"(.+?) +(\d+\.\d) +(\d+\.\d{3}) +(\d+\.\d)%  ", line) for line in lines[start:])]


def run_trainer(tmp_path, *extra):
    trainer = train.Trainer(load_config(SMOKE, overrides(tmp_path, *extra)))
    row = trainer.train()
    return trainer, row, trainer.run_dir


def test_smoke_run_writes_an_op_profile(tmp_path, builtin_1024, capsys):
    trainer, row, run_dir = run_trainer(tmp_path, "budget.max_steps=8", "run.profile_steps=3")
    text = (run_dir / "profile.txt").read_text()
    assert "3 steps profiled from step 3" in text and "self CPU time" in text
    rows = op_rows(text)
    assert rows and all(ms > 0 for _, _, ms, _ in rows)
    assert sum(share for *_, share in rows) <= 100.0
    # A share is the op's self time per step over the wall time of one profiled step.
    ms_per_step = float(re.search(r"([\d.]+) ms per step", text)[1])
    assert rows[0][3] == pytest.approx(100 * rows[0][2] / ms_per_step, abs=0.1)
    assert [share for *_, share in rows] == sorted((share for *_, share in rows), reverse=True)
    # The top three ops of the table, with their shares, are the ledger's profile column.
    (ledger_row,) = ledger.read(tmp_path / "ledger.csv")
    assert ledger_row["profile"] == row["profile"] == ", ".join(f"{name} {share:.1f}%" for name, _, _, share in rows[:3])
    assert any(name == "aten::mm" or name == "aten::addmm" for name, *_ in rows)
    trace = json.loads((run_dir / "trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    # The log line's names have '_' for spaces ("autograd::engine::evaluate_function: MmBackward0" may lead).
    assert f"profile:{run_dir / 'profile.txt'} top:{rows[0][0].replace(' ', '_')}=" in capsys.readouterr().out
    # Profiled steps are out of the step times and the budget: of 8 steps, 1 warm-up and 3 profiled.
    assert len(trainer.step_ms) == 8 - 1 - 3
    assert trainer.train_s == pytest.approx(sum(trainer.step_ms) / 1000, rel=1e-9)


def test_profile_steps_zero_writes_none(tmp_path, builtin_1024):
    trainer, row, run_dir = run_trainer(tmp_path, "budget.max_steps=8", "run.profile_steps=0")
    assert not (run_dir / "profile.txt").exists() and not (run_dir / "trace.json").exists()
    assert row["profile"] == "" and ledger.read(tmp_path / "ledger.csv")[0]["profile"] == ""
    assert len(trainer.step_ms) == 8 - 1
    assert trainer.train_s == pytest.approx(sum(trainer.step_ms) / 1000, rel=1e-9)


def test_a_run_that_ends_inside_the_profiled_steps_writes_what_it_profiled(tmp_path, builtin_1024):
    trainer, row, run_dir = run_trainer(tmp_path, "budget.max_steps=4", "run.profile_steps=5")
    assert "2 steps profiled from step 3" in (run_dir / "profile.txt").read_text()
    assert row["profile"] and len(trainer.step_ms) == 1


def test_a_profile_that_cannot_be_taken_does_not_fail_the_run(tmp_path, builtin_1024, monkeypatch):
    def unavailable(self, run_dir):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(train.Backend, "start_profile", unavailable)
    trainer, row, run_dir = run_trainer(tmp_path, "budget.max_steps=6", "run.profile_steps=2")
    assert row["status"] == "ok" and row["profile"] == ""
    assert "no profile: RuntimeError: no profiler here" in (run_dir / "profile.txt").read_text()
    assert len(trainer.step_ms) == 6 - 1 - 2  # the steps are still kept out of the step times


def test_negative_profile_steps_is_a_config_error():
    with pytest.raises(ConfigError, match=r"run.profile_steps: expected >= 0, got -1"):
        load_config(SMOKE, ["run.profile_steps=-1"])


def test_xla_trace_self_times_leave_out_nested_ops():
    """HLO ops nest on their thread (a call holds the ops inside it); each op's self time leaves
    out its children, and time on another thread is never a child."""
    def span(name, ts, dur, tid=1, module="SyncTensorsGraph.7"):
        return dict(ph="X", pid=1, tid=tid, ts=ts, dur=dur, name=name, args=dict(hlo_op=name, hlo_module=module))
    events = [span("call", 0, 100), span("tanh.4.clone", 10, 30), span("fusion.2", 50, 40),
              span("dot.3", 55, 20), span("dot.9", 60, 10, tid=2, module="SyncTensorsGraph.9"),
              dict(ph="X", pid=1, tid=1, ts=0, dur=500, name="SyncTensorsGraph"),  # host event: no hlo_op
              dict(ph="M", pid=1, name="process_name", args={})]
    ops, graphs = kernels.profile.xla_ops(events)
    assert {name: (calls, us) for name, (calls, us, _) in ops.items()} == {
        "call": (1, 30), "tanh": (1, 30), "fusion": (1, 20), "dot": (2, 30)}
    assert graphs == {"SyncTensorsGraph.7": 100, "SyncTensorsGraph.9": 10}
    text, top = kernels.profile.table(["header"], ops, 2, 100e-6, "xla", graphs)
    assert top == [("call", "15.0%"), ("tanh", "15.0%"), ("dot", "15.0%")]
    assert "# graph SyncTensorsGraph.7: 0.050 ms/step, 50.0% of the step" in text
    assert sum(share for *_, share in op_rows(text)) == pytest.approx(55.0)


def run_xla(tmp_path, *extra):
    args = ["--config", str(SMOKE), *overrides(tmp_path, "device.type=xla", "budget.max_steps=8", *extra)]
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return ledger.read(tmp_path / "ledger.csv")[-1]


@pytest.mark.xla
def test_xla_profile_records_the_graphs_ops_and_adds_no_graph(tmp_path, builtin_1024):
    profiled = run_xla(tmp_path, "run.profile_steps=3")
    plain = run_xla(tmp_path, "run.profile_steps=0")
    assert int(profiled["xla_compiles"]) == int(plain["xla_compiles"]) == XLA_GRAPHS
    run_dir = tmp_path / "runs" / profiled["run_id"]
    text = (run_dir / "profile.txt").read_text()
    assert "HLO op" in text and "device time per graph is what counts" in text
    assert "# graph SyncTensorsGraph" in text  # the steady train step's graph, with its time per step
    rows = op_rows(text)
    assert rows and sum(share for *_, share in rows) <= 100.0
    assert profiled["profile"].startswith(f"{rows[0][0]} ")
    assert any("hlo_op" in e.get("args", {}) for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"])
    assert not (tmp_path / "runs" / plain["run_id"] / "profile.txt").exists()
