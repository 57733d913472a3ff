"""The calibrated clock: runs that repeat exactly however busy the machine is, the calibration
(interleaved rounds, extension, the file's checks), sweeps under it, and verdicts that pair seeds
and never mix clocks."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy import stats

import clock
import config
import ledger
import sweep
import train
from config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
TWO_STAGES = "schedule.stages=[{at: 0, depth: 1}, {at: 0.5, depth: 2}]"


def args(tmp_path, *extra):
    return [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", *extra]


def stage_keys(tmp_path, *overrides):
    cfg = load_config(SMOKE, args(tmp_path, *overrides))
    flat, data_sha = config.flatten(dataclasses.asdict(cfg)), train.open_data(cfg)[3]
    return [clock.stage_key(flat, data_sha, stage) for stage in config.resolve_stages(cfg)]


def calibration(tmp_path, costs_ms, overrides=(), machine=None, name="cal.json"):
    """A calibration file for the stages of the smoke config with `overrides`, written by hand: these costs."""
    keys = stage_keys(tmp_path, *overrides)
    stages = {key: dict(name=f"smoke/{i}", config=str(SMOKE), overrides=list(overrides), dtype="float32", step_ms=ms,
                        ratio=ms / costs_ms[0], se=0.0, round_ms=[ms]) for i, (key, ms) in enumerate(zip(keys, costs_ms))}
    path = tmp_path / name
    clock.write(path, dict(version=clock.VERSION, id="c0ffee000001", machine=machine or clock.machine(), date="-",
                           method={}, baseline=keys[0], stages=stages))
    return path


def calibrated_run(tmp_path, path, *extra):
    """A smoke run under the calibrated clock: 1.25 s of 62.5 ms steps (exact in binary) = 20 counted
    steps, after the free warm-up step and the 5 profiled ones. -> (row, its training losses)."""
    before = len(ledger.read(tmp_path / "ledger.csv"))
    assert train.main(["--config", str(SMOKE), *args(tmp_path, "budget.clock=calibrated", f"budget.calibration={path}",
                                                    "budget.max_steps=0", "budget.seconds=1.25", *extra)]) == 0
    row = ledger.read(tmp_path / "ledger.csv")[before]
    losses = [r["loss"] for r in ledger.read_metrics(tmp_path / "runs", row["run_id"]) if r["kind"] == "train"]
    return row, losses


@pytest.mark.slow
def test_a_calibrated_run_repeats_exactly_even_on_a_busy_machine(tmp_path, builtin_1024):
    path = calibration(tmp_path, [62.5])
    first, losses = calibrated_run(tmp_path, path)
    assert first["steps"] == "26" and first["clock"] == "calibrated" and first["calibration"] == "c0ffee000001"
    assert first["step_cost_ms"] == "62.50" and float(first["train_s"]) == 1.25
    assert float(first["tokens_per_s"]) == 512 / 0.0625  # by the calibrated clock, not the machine's
    assert first["machine"] == clock.machine() and "measured_tokens_per_s=" in first["notes"]
    notes = dict(note.split("=", 1) for note in first["notes"].split("; ") if "=" in note)
    measured, peak = float(notes["measured_tokens_per_s"]), float(notes["peak_flops"].split()[0])
    # MFU from what the steps really took, against the peak measured under the same load
    assert float(first["mfu"]) == pytest.approx(float(first["flops_per_token"]) * measured / peak, rel=2e-3)
    again, losses_again = calibrated_run(tmp_path, path)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded, losses_loaded = calibrated_run(tmp_path, path)
    finally:
        for process in busy:
            process.kill()
    for row, row_losses in ((again, losses_again), (loaded, losses_loaded)):
        assert (row["steps"], row["stages"], row["val_bpb"], row_losses) == (first["steps"], first["stages"],
                                                                            first["val_bpb"], losses)
    assert len(losses) == 13  # every run.log_every=2 steps, and the last


def test_calibrated_stages_follow_their_costs(tmp_path, builtin_1024):
    """Each stage advances by its own cost: 0.5 s of 31.25 ms steps (16), then 0.5 s of 62.5 ms (8)."""
    path = calibration(tmp_path, [31.25, 62.5], [TWO_STAGES])
    row, _ = calibrated_run(tmp_path, path, TWO_STAGES, "budget.seconds=1", "run.profile_steps=0")
    assert row["stages"] == "0@0.0s:17:d1 1@0.5s:8:d2" and row["step_cost_ms"] == "31.25 62.50"


@pytest.mark.parametrize("extra, message", [
    (("budget.clock=sundial",), "budget.clock: expected one of wall | calibrated, got 'sundial'"),
    (("budget.clock=calibrated",), "budget.clock=calibrated needs budget.calibration"),
    (("budget.clock=calibrated", "budget.calibration=x.json", "budget.count_compile=true"),
     "and budget.count_compile=false (compile time is not calibrated)"),
    (("budget.reference_step_ms=400",), "budget.calibration and budget.reference_step_ms need budget.clock=calibrated"),
])
def test_clock_config_errors(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(SMOKE, extra)


def test_a_calibration_that_does_not_fit_the_run_is_refused(tmp_path, builtin_1024, capsys):
    def refused(path, *extra):
        assert train.main(["--config", str(SMOKE), *args(tmp_path, "budget.clock=calibrated", f"budget.calibration={path}",
                                                        *extra)]) == 2
        return capsys.readouterr().err

    other = calibration(tmp_path, [62.5], machine="Some Other CPU (family 6, model 143; avx2), 2 CPUs", name="o.json")
    assert (f"budget.calibration={other} was measured on Some Other CPU (family 6, model 143; avx2), 2 CPUs; this is "
            f"{clock.machine()}: calibrate again here") in refused(other)
    one_stage = calibration(tmp_path, [62.5], name="one.json")  # the full model: the second stage of TWO_STAGES
    assert f"budget.calibration={one_stage} has no stage 0 of this run (cost key" in refused(one_stage, TWO_STAGES)
    assert "; it has smoke/0: calibrate this config" in refused(one_stage, "model.n_layer=3")
    assert stage_keys(tmp_path, TWO_STAGES)[1] == stage_keys(tmp_path)[0]  # the same computation, the same cost
    # A stage without a loop keeps the key it had before loops existed (committed calibrations stay valid);
    # a loop, its span and its pass count are costs; a switch point in tokens is not.
    step_confirm = clock.read(ROOT / "sweeps" / "step_confirm" / "calibration-31b02d1d.json")
    cfg = load_config(ROOT / "configs" / "cpu_sp1024.yaml", args(tmp_path, "eval.every_seconds=0", "budget.reference_step_ms=0",
                                                          "model.n_head=4", "model.n_kv_head=2"))
    flat, data_sha = config.flatten(dataclasses.asdict(cfg)), train.open_data(cfg)[3]
    assert clock.stage_key(flat, data_sha, config.resolve_stages(cfg)[0]) == step_confirm["baseline"]
    loops = stage_keys(tmp_path, "schedule.stages=[{at: 0}, {at: 64 tokens, recur: 2, recur_span: [0, 1]}, "
                                 "{at: 128 tokens, recur: 3}, {at: 192 tokens, recur_span: [1, 1]}]")
    assert loops[0] == stage_keys(tmp_path)[0] and len(set(loops)) == 4
    assert stage_keys(tmp_path, "optim.muon_lr=0.1", "budget.seconds=9") == stage_keys(tmp_path)  # what a step learns
    (tmp_path / "bad.json").write_text("{}")
    assert "not a calibration file of version 1" in refused(tmp_path / "bad.json")
    assert "cannot read a calibration from it" in refused(tmp_path / "missing.json")


@pytest.mark.parametrize("field, value, message", [
    ("step_ms", "62.5", "stage smoke/0: step_ms: expected a finite number > 0, got '62.5'"),
    ("step_ms", 0, "stage smoke/0: step_ms: expected a finite number > 0, got 0"),
    ("step_ms", -62.5, "stage smoke/0: step_ms: expected a finite number > 0, got -62.5"),
    ("step_ms", float("nan"), "stage smoke/0: step_ms: expected a finite number > 0, got nan"),
    ("step_ms", float("inf"), "stage smoke/0: step_ms: expected a finite number > 0, got inf"),
    ("step_ms", True, "stage smoke/0: step_ms: expected a finite number > 0, got True"),
    ("ratio", None, "stage smoke/0: ratio: expected a finite number > 0, it is missing"),
    ("se", -0.01, "stage smoke/0: se: expected a finite number >= 0, got -0.01"),
    ("rounds", 2.5, "stage smoke/0: rounds: expected an integer > 0, got 2.5"),
    ("round_ms", [62.5, "x"], "stage smoke/0: round_ms[1]: expected a finite number > 0, got 'x'"),
    ("round_ms", [], "stage smoke/0: round_ms: expected a non-empty list (each round's median step), got []"),
    ("method", {"rounds": 0}, "method: rounds: expected an integer > 0, got 0"),
    ("baseline", "k", "baseline k is not one of its stages"),
])
def test_a_calibrations_numbers_are_checked_before_training(tmp_path, builtin_1024, capsys, field, value, message):
    """Each bad number: exit 2 before training, the file, the stage's name and the field named (Python's
    json reads and writes NaN and Infinity, so a file can carry them)."""
    path = calibration(tmp_path, [62.5])
    doc = json.loads(path.read_text())
    record = doc if field in ("method", "baseline") else next(iter(doc["stages"].values()))
    if value is None:
        del record[field]
    else:
        record[field] = value
    path.write_text(json.dumps(doc))
    assert train.main(["--config", str(SMOKE), *args(tmp_path, "budget.clock=calibrated", f"budget.calibration={path}")]) == 2
    assert f"budget.calibration={path}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.csv").exists()


BATCH_RAMP = "schedule.stages=[{at: 0, batch_tokens: 256}, {at: 0.5, batch_tokens: 512}]"  # half the batch, then all


def made_elsewhere(tmp_path, step_ms, **fields):
    """A calibration made elsewhere (a chip's step times, say), written by hand: costs by tokens per step."""
    path = tmp_path / "elsewhere.json"
    clock.write(path, {**dict(version=clock.VERSION, id="0ffc41000001", source="a made-up chip log",
                              machine="trn2 (made up)", step_ms=step_ms), **fields})
    return path


def test_a_calibration_made_elsewhere_gives_the_steps_its_costs_set(tmp_path, builtin_1024):
    """Costs by tokens per step, on a machine that is not theirs: the kit's 5 startup steps free, then 0.5 s of
    31.25 ms steps at 256 tokens (16) and 0.5 s of 62.5 ms steps at 512 (8), as computed by hand; "*" costs any."""
    path = made_elsewhere(tmp_path, {"256": 31.25, "512": 62.5})
    row, _ = calibrated_run(tmp_path, path, BATCH_RAMP, "budget.seconds=1", "budget.charge=kit", "run.profile_steps=0")
    assert row["stages"] == "0@0.0s:21:d2 1@0.5s:8:d2" and row["steps"] == "29" and float(row["train_s"]) == 1.0
    assert row["calibration"] == "0ffc41000001" and row["step_cost_ms"] == "31.25 62.50"
    assert "step costs made elsewhere, not measured here: a made-up chip log (trn2 (made up))" in row["notes"]
    flat = made_elsewhere(tmp_path, {"*": 62.5, "256": 31.25})  # an entry of its own wins over "*"
    assert calibrated_run(tmp_path, flat, BATCH_RAMP, "budget.seconds=1", "budget.charge=kit",
                          "run.profile_steps=0")[0]["stages"] == row["stages"]


@pytest.mark.parametrize("fields, message", [
    (dict(source=""), ": source: expected a non-empty string, got ''"),
    (dict(id=None), ": id: expected a non-empty string, got None"),
    (dict(machine=None), ": machine: expected a non-empty string, got None"),
    (dict(version=2), ": version: expected 1, got 2"),
    (dict(step_ms={}), ": step_ms: expected {tokens per step: ms} with at least one entry, got {}"),
    (dict(step_ms={"256": 31.25, "512": 0}), ": step_ms[512]: expected a finite number > 0, got 0"),
    (dict(step_ms={"256": 31.25, "512": float("nan")}), ": step_ms[512]: expected a finite number > 0, got nan"),
    (dict(step_ms={"256": float("inf"), "512": 62.5}), ": step_ms[256]: expected a finite number > 0, got inf"),
    (dict(step_ms={"256": 31.25, "0.5k": 62.5}), ": step_ms: key '0.5k': expected tokens per optimizer step"),
    (dict(step_ms={"512": 62.5}), " has no step_ms for 256 tokens per step (this run's stages); it has 512"),
])
def test_a_calibration_made_elsewhere_is_checked_before_training(tmp_path, builtin_1024, capsys, fields, message):
    """Exit 2 naming the file and the field, before a run trains and before --plan predicts its steps."""
    fields = dict(fields)
    path = made_elsewhere(tmp_path, fields.pop("step_ms", {"256": 31.25, "512": 62.5}), **fields)
    for plan in ((), ("--plan",)):
        assert train.main(["--config", str(SMOKE), *plan, *args(tmp_path, "budget.clock=calibrated",
                                                               f"budget.calibration={path}", BATCH_RAMP)]) == 2
        assert f"budget.calibration={path}{message}" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.csv").exists()


# trn2.yaml's batch ramp at the smoke config's size: the full batch for 6 steps, a quarter at LR x 0.35 until 6 % of the
# budget, a half at x 0.6 until 20 %, then the full batch; a made-up chip's costs for each, exact in binary.
CHIP_RAMP = ("schedule.stages=[{at: 0}, {at: '3072 tokens', batch_tokens: 128, lr: 0.35}, "
             "{at: 0.06, batch_tokens: 256, lr: 0.6}, {at: 0.2, batch_tokens: 512}]")
CHIP_MS = {"128": 31.25, "256": 62.5, "512": 125.0}
CHIP_RUN = (CHIP_RAMP, "budget.seconds=4", "budget.charge=kit", "run.profile_steps=0")


def test_a_chip_clock_gives_the_steps_and_switches_computed_by_hand(tmp_path, builtin_1024, capsys):
    """By hand, against 4 s: steps 1-5 free (the kit's startup), step 6 at 0.125 s (3,072 tokens: the ramp starts);
    steps 7-10 at 31.25 ms to 0.25 s >= 6 % (0.24 s); steps 11-19 at 62.5 ms to 0.8125 s >= 20 % (0.8 s); steps 20-45 at
    125 ms to 4.0625 s >= 4 s. --plan predicts the same before the run, reading no data."""
    path = made_elsewhere(tmp_path, CHIP_MS)
    row, _ = calibrated_run(tmp_path, path, *CHIP_RUN)
    assert (row["stages"], row["steps"], float(row["train_s"])) == ("0@0.0s:6:d2 1@0.1s:4:d2 2@0.2s:9:d2 3@0.8s:26:d2",
                                                                    "45", 4.0625)
    assert f"not measured here: a made-up chip log (trn2 (made up)); {clock.ASSUMED}" in row["notes"]
    capsys.readouterr()
    assert train.main(["--config", str(SMOKE), "--plan", *args(tmp_path, "budget.clock=calibrated",
                                                              f"budget.calibration={path}", "budget.max_steps=0",
                                                              *CHIP_RUN)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("clock:calibrated calibration:0ffc41000001 steps:45 train_s:4.1 "
                           "stage_first_steps:0@0,1@6,2@10,3@19 (step costs made elsewhere") and clock.ASSUMED in line


def test_a_run_under_a_chip_clock_resumed_ends_at_the_uninterrupted_runs_step(tmp_path, builtin_1024, monkeypatch):
    """Interrupted inside the free startup (step 3) and in the half-batch stage (step 15), resumed each time: the
    uninterrupted run's steps, stages, charged seconds and val_bpb."""
    path = made_elsewhere(tmp_path, CHIP_MS)
    reference, _ = calibrated_run(tmp_path / "reference", path, *CHIP_RUN)
    ckpt, resume, step = tmp_path / "run.pt", (), train.Trainer.step
    for n in (3, 15):
        monkeypatch.setattr(train.Trainer, "step", stop_at(n))
        assert train.main(["--config", str(SMOKE), *args(tmp_path, "budget.clock=calibrated", f"budget.calibration={path}",
                                                        "budget.max_steps=0", *CHIP_RUN, f"checkpoint.path={ckpt}",
                                                        *resume)]) == 128 + signal.SIGTERM
        resume = (f"checkpoint.resume={ckpt}",)
    monkeypatch.setattr(train.Trainer, "step", step)
    row, _ = calibrated_run(tmp_path, path, *CHIP_RUN, f"checkpoint.path={ckpt}", *resume)
    assert [(r["status"], r["steps"]) for r in ledger.read(tmp_path / "ledger.csv")[:-1]] == [("interrupted", "3"),
                                                                                            ("interrupted", "15")]
    assert (row["steps"], row["stages"], row["train_s"], row["val_bpb"]) == (
        reference["steps"], reference["stages"], reference["train_s"], reference["val_bpb"]) and row["steps"] == "45"


def test_a_calibration_made_elsewhere_is_not_scaled(tmp_path):
    path = made_elsewhere(tmp_path, {"*": 62.5})
    budget = load_config(SMOKE, ["budget.clock=calibrated", f"budget.calibration={path}",
                                 "budget.reference_step_ms=200"]).budget
    with pytest.raises(ConfigError, match="budget.reference_step_ms: scales a calibration measured here"):
        clock.costs(budget, ["k"], clock.machine(), [512])


def test_a_calibration_made_by_hand_elsewhere_is_checked_not_a_traceback(tmp_path):
    """A file written elsewhere, by hand: its stages without names, its baseline not a stage's key."""
    here, path = clock.machine(), tmp_path / "elsewhere.json"
    budget = dataclasses.replace(load_config(SMOKE).budget, calibration=str(path))
    doc = dict(version=clock.VERSION, id="c0ffee000009", machine=here, baseline="k0",
               stages={"k0": dict(step_ms=10.0, ratio=1.0, se=0.0, round_ms=[10.0])})
    clock.write(path, doc)
    with pytest.raises(ConfigError, match=r"has no stage 0 of this run \(cost key k1\); it has k0: calibrate"):
        clock.costs(budget, ["k1"], here, [512])
    clock.write(path, {**doc, "baseline": ["k0"]})
    with pytest.raises(ConfigError, match=f"budget.calibration={path}: not a calibration file of version"):
        clock.costs(budget, ["k0"], here, [512])


def test_a_reference_step_scales_every_cost_by_the_baselines(tmp_path):
    path = calibration(tmp_path, [50.0, 100.0], [TWO_STAGES])
    keys = list(json.loads(path.read_text())["stages"])
    budget = load_config(SMOKE, ["budget.clock=calibrated", f"budget.calibration={path}",
                                 "budget.reference_step_ms=200"]).budget
    assert clock.costs(budget, keys[::-1], clock.machine(), [8192, 8192]) == ("c0ffee000001", [0.4, 0.2])


class FakeTrainer:
    """What clock.measure uses of a Trainer: step times it is told, per stage index, on a machine
    that runs `slow` times slower in odd rounds (a drift that moves every stage alike)."""

    def __init__(self, name, seconds, calls, slow=1.0):
        self.name, self.seconds, self.calls, self.slow = name, seconds, calls, slow
        self.backend = type("Backend", (), {"dtype_name": "float32"})

    def timed_steps(self, index, steps):
        self.calls.append((self.name, index, steps))
        drift = self.slow if ((len(self.calls) - 1) // 4) % 2 else 1.0  # 4 stages: the warm-ups, then each round
        return [self.seconds[index] * drift] * steps


def test_calibration_interleaves_rounds_and_measures_ratios_to_the_baseline(tmp_path, monkeypatch):
    monkeypatch.setattr(clock, "ROUNDS", 4)
    calls, path = [], tmp_path / "cal.json"
    a, b, c = (FakeTrainer(n, s, calls, slow=1.5) for n, s in (("a", [0.1]), ("b", [0.2, 0.3]), ("c", [0.4])))
    stages = {"ka": ("a/0", "a.yaml", [], a, 0), "kb0": ("b/0", "b.yaml", ["x=1"], b, 0),
              "kb1": ("b/1", "b.yaml", ["x=1"], b, 1), "kc": ("c/0", "c.yaml", [], c, 0)}
    doc = clock.measure(stages, path, "kb0", "here", log=lambda line: None)
    units = [("b", 0), ("a", 0), ("b", 1), ("c", 0)]  # the baseline first, then in order
    timed = [(n, i, clock.SKIP + clock.STEPS) for n, i in units]
    assert calls == [(n, i, clock.WARMUP) for n, i in units] + (timed + timed[::-1]) * 2  # A B C, C B A, ...
    ratios = {k: s["ratio"] for k, s in doc["stages"].items()}
    assert doc["baseline"] == "kb0" and ratios == {"kb0": 1.0, "ka": 0.5, "kb1": 1.5, "kc": 2.0}
    assert doc["stages"]["kc"]["se"] == 0.0  # the drift cancels out of the ratios
    assert doc["stages"]["kb0"]["se"] > 0  # but not out of the baseline's level
    level = doc["stages"]["kb0"]["step_ms"]
    assert doc["stages"]["kc"]["step_ms"] == pytest.approx(2 * level)
    assert json.loads(path.read_text()) == doc
    assert clock.measure(stages, path, "kb0", "here") == doc  # nothing missing: nothing measured
    # A new stage is measured with the baseline, which now runs 2x slower: its cost comes from the ratio.
    more = {"kb0": ("b/0", "b.yaml", [], FakeTrainer("b", [0.4], calls), 0),
            "kd": ("d/0", "d.yaml", [], FakeTrainer("d", [1.0], calls), 0)}
    extended = clock.measure(more, path, "ka", "here", log=lambda line: None)  # the file's baseline wins
    assert extended["id"] == doc["id"] and extended["stages"]["kb0"] == doc["stages"]["kb0"]
    assert extended["stages"]["kd"]["step_ms"] == pytest.approx(2.5 * level)
    assert "ratio to the baseline" in extended["stages"]["kd"]["added"]
    with pytest.raises(ConfigError, match="was measured on here; this is elsewhere"):
        clock.measure(more, path, "kb0", "elsewhere")


def test_a_calibrated_sweep_calibrates_once_and_its_rows_name_the_calibration(tmp_path, builtin_1024, monkeypatch):
    monkeypatch.setattr(clock, "ROUNDS", 2)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"name: tiny\nconfig: {SMOKE}\nseeds: [1, 2]\nclock: calibrated\n"
                    f"overrides: [budget.max_steps=0, budget.seconds=0.5, eval.tokens=1024, run.profile_steps=0]\n"
                    f"variants:\n  narrow: []\n  lr: [optim.muon_lr=0.02]\n")
    assert sweep.main([str(spec), "--calibrate-only", *args(tmp_path)]) == 0
    (path,) = (tmp_path / "tiny").glob("calibration-*.json")
    doc = clock.read(path)
    assert [stage["name"] for stage in doc["stages"].values()] == ["narrow/0"]  # an LR does not change a step's cost
    assert sweep.main([str(spec), *args(tmp_path)]) == 0
    rows = ledger.read(tmp_path / "ledger.csv")
    assert len(rows) == 4 and {(r["clock"], r["calibration"]) for r in rows} == {("calibrated", doc["id"])}
    assert clock.read(path) == doc  # reused, not measured again
    assert "paired (2 seeds)" in (tmp_path / "tiny" / "verdict.md").read_text()
    spec.write_text(spec.read_text() + "  deep: [model.n_layer=3]\n")
    assert sweep.main([str(spec), "--max-runs", "0", "--calibrate-only", *args(tmp_path)]) == 0
    extended = clock.read(path)
    assert extended["id"] == doc["id"] and len(extended["stages"]) == 2


@pytest.mark.slow
def test_a_calibrated_sweep_runs_jobs_at_once_each_on_its_share_of_the_threads(tmp_path, builtin_1024):
    spec = tmp_path / "pair.yaml"
    text = (f"name: pair\nconfig: {SMOKE}\nseeds: [1, 2]\n"
            f"overrides: [budget.max_steps=0, budget.seconds=0.5, eval.tokens=1024, run.profile_steps=0]\n"
            f"variants:\n  narrow: []\n  lr: [optim.muon_lr=0.02]\n")
    spec.write_text(text)
    with pytest.raises(sweep.SweepError, match="--jobs 2 needs clock: calibrated"):
        sweep.Sweep(sweep.load_sweep(spec), [], nproc=1, jobs=2)
    with pytest.raises(sweep.SweepError, match="--jobs must be at least 1 .* \\(got 0 and None\\)"):
        sweep.Sweep(sweep.load_sweep(spec), [], nproc=1, jobs=0)
    spec.write_text(text + "clock: calibrated\n")
    threads, share = torch.get_num_threads(), max(1, (os.cpu_count() or 1) // 2)
    try:
        assert sweep.main([str(spec), "--jobs", "2", "--calibration-rounds", "2", *args(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (path,) = (tmp_path / "pair").glob("calibration-*.json")
    assert clock.read(path)["machine"].endswith(f", {share} threads, torch {torch.__version__}")
    assert clock.read(path)["method"]["rounds"] == 2
    rows = ledger.read(tmp_path / "ledger.csv")
    assert sorted((r["variant"], r["seed"]) for r in rows) == [("lr", "1"), ("lr", "2"), ("narrow", "1"), ("narrow", "2")]
    assert {r["machine"] for r in rows} == {clock.read(path)["machine"]}  # each run on the calibration's threads
    assert "paired (2 seeds)" in (tmp_path / "pair" / "verdict.md").read_text()


def test_a_sweep_file_names_a_clock_that_exists(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nconfig: {SMOKE}\nseeds: [1]\nclock: sundial\nvariants:\n  a: []\n")
    with pytest.raises(sweep.SweepError, match="clock: expected wall or calibrated, got 'sundial'"):
        sweep.load_sweep(spec)


def rows_of(recipe, seeds, values, **extra):
    return [dict(time=f"2026-12-0{i + 1}", run_id=f"{recipe}-{i}", config="c.yaml", recipe=recipe, seed=str(seed),
                 budget_s="150", status="ok", val_bpb=str(v), tokens_per_s=str(100 + i), **extra)
            for i, (seed, v) in enumerate(zip(seeds, values))]


def test_verdicts_pair_matching_seeds_and_never_mix_clocks(capsys):
    a = rows_of("ra", [1, 2, 3], [1.50, 1.60, 1.55])
    b = rows_of("rb", [3, 1, 2], [1.54, 1.49, 1.58])
    judged = ledger.judge(a, b)
    assert judged["pairs"] == ["1", "2", "3"]
    expected = stats.ttest_rel([1.49, 1.58, 1.54], [1.50, 1.60, 1.55])
    assert judged["val_bpb"]["p"] == pytest.approx(expected.pvalue) and judged["val_bpb"]["test"] == "paired t-test"
    assert judged["val_bpb"]["diff"] == pytest.approx(-0.04 / 3)
    assert ledger.judge(a, rows_of("rb", [4, 5], [1.5, 1.6]))["val_bpb"]["test"] == "Welch's t-test"
    ledger.print_verdict(a + b, "ra", "rb")
    out = capsys.readouterr().out
    assert "timebase: wall (machine not recorded)" in out and "paired t-test on the per-seed differences, seeds 1, 2, 3" in out
    calibrated = rows_of("rb", [1, 2], [1.5, 1.6], clock="calibrated", calibration="c1")
    with pytest.raises(ledger.LedgerError, match=r"a verdict never mixes clocks or calibrations \(arm 'ra': wall "
                                                 r"\(machine not recorded\) \(3 runs\); arm 'rb': calibrated c1 \(2 runs\)\)"):
        ledger.print_verdict(a + calibrated, "ra", "rb")
    both = a + rows_of("ra", [1, 2], [1.4, 1.5], clock="calibrated", calibration="c1") + b + calibrated
    ledger.print_verdict(both, "ra", "rb")  # calibrated preferred when both arms ran under it
    out = capsys.readouterr().out
    assert "timebase: calibrated c1 (also in common: wall (machine not recorded)" in out
    # Under it tokens/s are constants of the calibration: their ratio is stated, no t-test of constants.
    ratio = ledger.judge(both[3:5], calibrated)["tokens_per_s"]
    assert ratio["ratio"] == pytest.approx(100.5 / 100.5) and ratio["test"] == "calibrated cost ratio"
    tokens = out[out.index("tokens_per_s  A"):out.index("by the calibration")]
    assert "x1.000 by the calibration" in out and "nan" not in tokens
    ledger.print_verdict(both, "ra", "rb", "wall (machine not recorded)")
    assert "seeds 1, 2, 3" in capsys.readouterr().out


def stop_at(step):
    """A Trainer.step that, once the run has made `step` steps, asks it to stop as a SIGTERM would
    (the loop finishes that step, checkpoints and writes an interrupted row): deterministic."""
    step_once = train.Trainer.step

    def stepped(self, progress):
        loss = step_once(self, progress)
        if self.step_count == step:
            self.stop_signal = signal.SIGTERM
        return loss
    return stepped


@pytest.mark.parametrize("stops, costs_ms, extra", [((12,), [62.5], ()), ((4, 30), [31.25, 62.5], (TWO_STAGES,))])
def test_a_resumed_calibrated_run_gets_exactly_its_steps(tmp_path, builtin_1024, monkeypatch, stops, costs_ms, extra):
    """Interrupted once, or twice (once inside the free warm-up and profiled steps, 1-7, once in the
    second stage), and resumed each time: the uninterrupted run's steps, stages, clock and val_bpb."""
    path = calibration(tmp_path, costs_ms, extra)
    reference, _ = calibrated_run(tmp_path / "reference", path, *extra)
    ckpt, resume, step = tmp_path / "run.pt", (), train.Trainer.step
    for n in stops:
        monkeypatch.setattr(train.Trainer, "step", stop_at(n))
        assert train.main(["--config", str(SMOKE), *args(tmp_path, "budget.clock=calibrated", f"budget.calibration={path}",
                                                        "budget.max_steps=0", "budget.seconds=1.25", *extra,
                                                        f"checkpoint.path={ckpt}", *resume)]) == 128 + signal.SIGTERM
        resume = (f"checkpoint.resume={ckpt}",)
    monkeypatch.setattr(train.Trainer, "step", step)
    row, _ = calibrated_run(tmp_path, path, *extra, f"checkpoint.path={ckpt}", *resume)
    interrupted = ledger.read(tmp_path / "ledger.csv")[:-1]
    assert [(r["status"], r["steps"]) for r in interrupted] == [("interrupted", str(n)) for n in stops]
    assert (row["steps"], row["stages"], row["train_s"], row["val_bpb"]) == (
        reference["steps"], reference["stages"], reference["train_s"], reference["val_bpb"])
    # tokens/s counts the steady steps of every part of the run, not the last part's alone: with two stages whose
    # costs differ 2x it lies strictly between their rates (the steps that compile after a resume are left out, as
    # a run's first steps are, so it need not equal the uninterrupted run's)
    rates = [int(row["tokens"]) / int(row["steps"]) * 1000 / ms for ms in costs_ms]
    assert min(rates) < float(row["tokens_per_s"]) < max(rates) or rates == [float(row["tokens_per_s"])]
