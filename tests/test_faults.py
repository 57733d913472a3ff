"""Faults and bad input (issue 11): kill -9 at seeded points then resume, signals during the final
save and evaluation, a full disk (RLIMIT_FSIZE), crafted and damaged checkpoints, divergence, and
each bad input stopping before training with exit code 2 and the file or key named; sweeps killed
alone or after their run, and the per-pair locks that keep two processes off one pair (issue 38)."""
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import data
import ledger
import locks
import sweep
import train
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def args(tmp_path, *extra):
    return ["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", *extra]


def file_size_limit(n_bytes):
    """preexec_fn: a disk that is full after n_bytes of any one file (Python ignores SIGXFSZ, so a
    write past it raises OSError EFBIG)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


def assert_stopped_before_training(tmp_path):
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.csv").exists()


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, builtin_1024):
    tmp_path = tmp_path_factory.mktemp("good")
    path = tmp_path / "good.pt"
    assert train.main(args(tmp_path, "budget.max_steps=2", f"checkpoint.path={path}")) == 0
    return path


# -- checkpoints ------------------------------------------------------------------------------

class Payload:
    """Unpickling this creates the file `marker`: what a crafted checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_crafted_checkpoint_runs_no_code(tmp_path, good_checkpoint, capsys):
    control, marker = tmp_path / "control", tmp_path / "marker"
    torch.save({"model": Payload(str(control))}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()  # the payload is live: an unsafe load runs it
    evil = tmp_path / "evil.pt"
    torch.save({**torch.load(good_checkpoint, weights_only=True), "model": Payload(str(marker))}, evil)
    with pytest.raises(train.CheckpointError, match=f"checkpoint {evil}: cannot be loaded"):
        train.load_for_eval(evil, "cpu")
    assert train.main(args(tmp_path, f"checkpoint.resume={evil}")) == 2
    assert f"checkpoint {evil}: cannot be loaded as a train.py checkpoint" in capsys.readouterr().err
    assert not marker.exists()
    assert_stopped_before_training(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign"])
def test_a_damaged_checkpoint_is_a_named_error(tmp_path, good_checkpoint, capsys, damage):
    bad = tmp_path / "bad.pt"
    if damage == "truncated":
        bad.write_bytes(good_checkpoint.read_bytes()[:good_checkpoint.stat().st_size // 2])
    elif damage == "garbage":
        bad.write_bytes(b"\x00not a checkpoint" * 100)
    else:
        torch.save({"weights": torch.zeros(3)}, bad)
    assert train.main(args(tmp_path, f"checkpoint.resume={bad}")) == 2
    assert f"checkpoint {bad}: " in capsys.readouterr().err
    with pytest.raises(train.CheckpointError, match=f"checkpoint {bad}: "):
        train.load_for_eval(bad, "cpu")
    assert_stopped_before_training(tmp_path)


@pytest.mark.slow
def test_kill_9_at_seeded_points_then_resume_is_exact(tmp_path, builtin_1024):
    """SIGKILL at three seeded points (a step line, then a seeded delay: during a step, a
    checkpoint save or between them), each time resuming from the checkpoint left behind; every
    step's logged loss and the final row equal those of an uninterrupted run."""
    steps, ckpt = 12, tmp_path / "run.pt"
    common = (f"budget.max_steps={steps}", "run.log_every=1", "checkpoint.every_seconds=1e-9", f"checkpoint.path={ckpt}")
    reference_dir = tmp_path / "reference"
    assert train.main(args(reference_dir, *common[:3], f"checkpoint.path={reference_dir / 'ref.pt'}")) == 0
    (reference,) = ledger.read(reference_dir / "ledger.csv")
    reference_log = (reference_dir / "runs" / reference["run_id"] / "log.txt").read_text()

    def losses(log):
        return {line.split()[0]: line.split()[1] for line in log.splitlines() if line.startswith("step:")}

    rng = random.Random(11)
    points = sorted(rng.sample(range(3, 9), 3))
    delays_s = [rng.uniform(0, 0.1) for _ in points]
    logs, resume = [], ()
    for point, delay_s in zip(points, delays_s):
        proc = subprocess.Popen([sys.executable, "train.py", *args(tmp_path, *common, *resume)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step:") and int(line.split()[0][5:]) >= point:
                time.sleep(delay_s)
                proc.kill()
                break
        lines.append(proc.communicate(timeout=600)[0])
        assert proc.returncode == -signal.SIGKILL, "".join(lines)
        logs.append("".join(lines))
        assert train.load_checkpoint(ckpt)["step"] >= 1  # what a kill leaves always loads
        resume = (f"checkpoint.resume={ckpt}",)
    out = subprocess.run([sys.executable, "train.py", *args(tmp_path, *common, *resume)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (row,) = ledger.read(tmp_path / "ledger.csv")  # killed runs write no row; the finished one does
    assert row["status"] == "ok" and row["steps"] == str(steps)
    assert (row["val_bpb"], row["val_tokens"]) == (reference["val_bpb"], reference["val_tokens"])
    expected = losses(reference_log)
    for log in [*logs, out.stdout]:
        assert all(expected[step] == loss for step, loss in losses(log).items()), log
    assert not Path(f"{ckpt}.tmp").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("where", ["save_checkpoint", "evaluate"])
def test_a_signal_during_the_final_save_or_evaluation_leaves_an_interrupted_row(tmp_path, builtin_1024,
                                                                                 monkeypatch, where, signum):
    owner = train if where == "save_checkpoint" else train.Trainer
    original = getattr(owner, where)

    def signalled(*a, **kw):
        os.kill(os.getpid(), signum)  # a real signal, delivered while the final save / evaluation runs
        return original(*a, **kw)

    monkeypatch.setattr(owner, where, signalled)
    assert train.main(args(tmp_path, "budget.max_steps=2")) == 128 + signum
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "interrupted" and row["steps"] == "2" and row["val_bpb"] == ""
    assert train.load_checkpoint(tmp_path / "runs" / row["run_id"] / "checkpoint.pt")["step"] == 2


# -- a full disk --------------------------------------------------------------------------------

def test_a_full_disk_at_the_checkpoint_keeps_the_last_one_and_records_failed(tmp_path, good_checkpoint):
    shared = tmp_path / "shared.pt"
    shared.write_bytes(good_checkpoint.read_bytes())
    size = shared.stat().st_size
    out = subprocess.run([sys.executable, "train.py", *args(tmp_path, "budget.max_steps=2", f"checkpoint.path={shared}")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=file_size_limit(size // 2))
    assert out.returncode == 1, out.stderr[-2000:]
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "failed" and "File too large" in row["notes"] and row["steps"] == "2"
    assert shared.read_bytes() == good_checkpoint.read_bytes()  # the last good checkpoint survives
    assert not Path(f"{shared}.tmp").exists()


def ledger_row(run_id, **fields):
    return {"time": "2025-01-01T00:00:00", "run_id": run_id, "config": "tiny", "status": "ok", **fields}


def test_a_full_disk_tears_a_row_but_not_the_next_one(tmp_path, capsys):
    path = tmp_path / "ledger.csv"
    ledger.append(path, ledger_row("first"))
    size = path.stat().st_size
    script = f"import ledger; ledger.append({str(path)!r}, {ledger_row('torn', notes='x' * 500)!r})"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         preexec_fn=file_size_limit(size + 40))
    assert out.returncode == 1 and "File too large" in out.stderr
    assert path.stat().st_size == size + 40  # the torn start of a row stays
    ledger.append(path, ledger_row("after"))
    rows, problems = ledger.read_checked(path)
    assert [r["run_id"] for r in rows] == ["first", "after"]
    assert len(problems) == 1 and f"{path} line 3: " in problems[0] and f"fields, expected {len(ledger.COLUMNS)}" in problems[0]
    assert ledger.main(["show", "--path", str(path)]) == 0
    captured = capsys.readouterr()
    assert f"{path} line 3: " in captured.err and "after" in captured.out


def test_show_reports_a_bad_status_by_line(tmp_path, capsys):
    path = tmp_path / "ledger.csv"
    ledger.append(path, ledger_row("first"))
    text = path.read_text().splitlines()
    path.write_text("\n".join([*text, text[1].replace(",ok,", ",great,")]) + "\n")
    assert [r["run_id"] for r in ledger.read(path)] == ["first"]
    assert ledger.main(["show", "--path", str(path)]) == 0
    assert f"{path} line 3: status 'great', expected one of ok, diverged, failed, interrupted" in capsys.readouterr().err


# -- bad input: exit code 2 before training, the file or key named --------------------------------

@pytest.mark.parametrize("override, message", [
    ("run.seed=-1", "run.seed: expected in [0, 2**32) (numpy's seed range), got -1"),
    ("budget.seconds=.inf", "budget.seconds: expected a finite number, got inf"),
    ("model.qk_gain_init=.nan", "model.qk_gain_init: expected a finite number, got nan"),
    ("optim.muon_lr=nan", "optim.muon_lr: expected a finite number, got nan"),
    ("schedule.stages=[{at: 0, attn_scale: .nan}]", "schedule.stages[0].attn_scale: expected a finite number"),
    ("run.name=../../x", "run.name: expected a plain name (no '/', not empty or '..'), got '../../x'"),
    ("run.name=", "run.name: expected a plain name"),
    ("model.n_layer=[1,", "override 'model.n_layer=[1,': the value is not valid YAML"),
])
def test_bad_config_values_stop_with_exit_2(tmp_path, capsys, override, message):
    assert train.main(args(tmp_path, override)) == 2
    assert message in capsys.readouterr().err
    assert_stopped_before_training(tmp_path)


def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, capsys):
    assert train.main(args(tmp_path, "model.n_layer=100000")) == 2
    err = capsys.readouterr().err
    assert "model.n_layer=100000" in err and "GiB is available" in err
    assert_stopped_before_training(tmp_path)


@pytest.fixture
def shards(tmp_path, builtin_1024):
    """A shards folder: the built-in train shards (linked) and its tokenizer; the val shard is the test's."""
    folder = tmp_path / "shards"
    folder.mkdir()
    source = Path(builtin_1024["tokenizer"]).parent
    for f in data.split_files(source, "train"):
        (folder / f.name).symlink_to(f)
    return folder, [f"data.source=shards", f"data.path={folder}", f"data.tokenizer={builtin_1024['tokenizer']}"]


@pytest.mark.parametrize("damage, message", [
    ("id", "token id 1024 found, expected ids < vocab_size 1024"),
    ("empty", "data.seq_len=64: a validation window is 64 + 1 tokens, the validation split ("),
    ("truncated", "truncated: header says 1000 tokens"),
    ("magic", "magic 0, expected"),
])
def test_a_bad_validation_shard_stops_before_training(tmp_path, shards, capsys, damage, message):
    folder, overrides = shards
    val = folder / "fineweb_val_000000.bin"
    data.write_shard(val, [1024 if damage == "id" else 5] * (0 if damage == "empty" else 1000))
    if damage == "truncated":
        val.write_bytes(val.read_bytes()[:-10])
    elif damage == "magic":
        val.write_bytes(bytes(1024) + val.read_bytes()[1024:])
    assert train.main(args(tmp_path, *overrides)) == 2
    err = capsys.readouterr().err
    assert str(val) in err and message in err
    assert_stopped_before_training(tmp_path)


def test_a_garbled_tokenizer_is_a_named_error(tmp_path, shards, capsys):
    folder, overrides = shards
    data.write_shard(folder / "fineweb_val_000000.bin", [5] * 1000)
    garbled = tmp_path / "garbled.model"
    garbled.write_bytes(b"\x08\x01garbage" * 50)
    assert train.main(args(tmp_path, *overrides, f"data.tokenizer={garbled}")) == 2
    assert f"{garbled}: not a sentencepiece model" in capsys.readouterr().err
    assert_stopped_before_training(tmp_path)


@pytest.mark.parametrize("key", ["checkpoint.path", "run.out_dir", "ledger.path"])
def test_an_unwritable_path_stops_before_training(tmp_path, builtin_1024, capsys, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    value = blocker / "sub" / ("x.pt" if key == "checkpoint.path" else "x.csv" if key == "ledger.path" else "")
    assert train.main(args(tmp_path, f"{key}={value}")) == 2
    assert f"{key}: {blocker} is a file, expected a directory" in capsys.readouterr().err
    assert_stopped_before_training(tmp_path)


def test_an_older_ledger_is_refused_before_training_and_migrated_beside_it(tmp_path, builtin_1024, capsys):
    path = tmp_path / "ledger.csv"
    old = "time,run_id,val_loss,status\n2024,old,3.0,ok\n"
    path.write_text(old)
    assert train.main(args(tmp_path)) == 2
    assert f"`python ledger.py migrate {path}`" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and path.read_text() == old
    assert ledger.main(["migrate", str(path)]) == 0
    migrated = tmp_path / "ledger.migrated.csv"
    assert path.read_text() == old  # never touched
    (row,) = ledger.read(migrated)
    assert list(row) == ledger.COLUMNS and (row["run_id"], row["val_loss"], row["val_bpb"]) == ("old", "3.0", "")
    assert ledger.main(["migrate", str(path)]) == 2  # never overwrites an earlier migration
    migrated.replace(path)
    assert train.main(args(tmp_path)) == 0
    assert [r["run_id"] for r in ledger.read(path)][0] == "old"


# -- resume and divergence ----------------------------------------------------------------------

def test_resume_applies_the_new_configs_optimizer_settings(tmp_path, good_checkpoint):
    first = train.load_checkpoint(good_checkpoint)["optimizers"]
    new = ("optim.muon_lr=0.01", "optim.muon_momentum=0.9", "optim.muon_ns_steps=3", "optim.embed_lr=0.02",
           "optim.scalar_lr=0.03", "optim.beta1=0.8", "optim.weight_decay=0.1")
    resumed = train.Trainer(load_config(SMOKE, args(tmp_path, f"checkpoint.resume={good_checkpoint}", *new)[2:]))
    muon, adam = resumed.optimizers
    assert [(g["peak_lr"], g["momentum"], g["ns_steps"]) for g in muon.param_groups] == [(0.01, 0.9, 3)]
    assert [(g["peak_lr"], g["betas"], g["weight_decay"]) for g in adam.param_groups] == [
        (0.02, (0.8, 0.95), 0.1), (0.03, (0.8, 0.95), 0.0)]
    # The optimizer state itself carries on.
    assert [len(o.state_dict()["state"]) for o in resumed.optimizers] == [len(s["state"]) for s in first]
    assert torch.equal(adam.state_dict()["state"][0]["exp_avg"], first[1]["state"][0]["exp_avg"])
    resumed.loader.close()


def test_a_loss_stuck_at_the_uniform_level_is_diverged(tmp_path, builtin_1024):
    """The rule on its own (a run that reaches it depends on the clock): a logged loss >= ln(1024)
    once p >= max(optim.warmup, 0.25) and at least 10 steps have run."""
    trainer = train.Trainer(load_config(SMOKE, args(tmp_path, "optim.warmup=0.3")[2:]))
    trainer.loader.close()
    for step, progress, loss, diverged in [(10, 0.29, 7.0, False), (9, 0.5, 7.0, False), (10, 0.5, 6.93, False),
                                           (10, 0.3, 6.94, True), (10, 0.1, float("nan"), True)]:
        trainer.step_count, trainer.train_s, trainer.diverged = step, progress * trainer.cfg.budget.seconds, ""
        trainer.judge(loss)
        assert bool(trainer.diverged) == diverged, (step, progress, loss)
    trainer.step_count, trainer.train_s = 10, 0.3 * trainer.cfg.budget.seconds
    trainer.judge(7.0)
    assert trainer.diverged == "training loss 7.0000 >= ln(model.vocab_size) = 6.9315 (a uniform guess) at p=0.300"


def test_the_loss_is_judged_at_the_end_of_every_run(tmp_path, builtin_1024):
    """A run ended by budget.max_steps long before STUCK_AFTER of its budget is still judged on its
    last loss: every learning rate at 1e6 is never recorded ok; healthy short runs never flagged."""
    absurd = [f"optim.{lr}=1e6" for lr in ("muon_lr", "embed_lr", "head_lr", "scalar_lr")]
    assert train.main(args(tmp_path, *absurd, "budget.seconds=600", "budget.max_steps=40")) == 1
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "diverged" and float(row["train_s"]) < 0.25 * 600
    assert train.main(args(tmp_path, "budget.seconds=600", "budget.max_steps=40")) == 0  # the same run, sane LRs
    assert train.main(args(tmp_path)) == 0  # the smoke run as it is: 8 steps, under STUCK_MIN_STEPS
    assert [r["status"] for r in ledger.read(tmp_path / "ledger.csv")] == ["diverged", "ok", "ok"]
    trainer = train.Trainer(load_config(SMOKE, args(tmp_path, "optim.warmup=0.3")[2:]))
    trainer.loader.close()
    trainer.step_count, trainer.train_s = 10, 0.05 * trainer.cfg.budget.seconds
    trainer.judge(7.0, final=True)
    assert not trainer.diverged  # still in warmup: the LR has not reached its peak
    trainer.train_s = 0.3 * trainer.cfg.budget.seconds
    trainer.judge(7.0, final=True)
    assert trainer.diverged.startswith("training loss 7.0000 >= ln(model.vocab_size)")


def test_a_run_stopped_early_with_its_loss_above_uniform_is_interrupted_not_diverged(tmp_path, builtin_1024,
                                                                                      monkeypatch):
    """SIGTERM at step 12 of 600 s with every logged loss above ln(1024): the run has not ended (it will
    resume), so the stuck rule, which waits for STUCK_AFTER of the budget, does not call it diverged."""
    loss, step = train.GPT.loss, train.Trainer.step

    def stepped(self, progress):
        out = step(self, progress)
        if self.step_count == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(train.GPT, "loss", lambda self, *a, **kw: loss(self, *a, **kw) + 10.0)
    monkeypatch.setattr(train.Trainer, "step", stepped)
    assert train.main(args(tmp_path, "budget.seconds=600", "budget.max_steps=0", "run.log_every=5")) == 128 + signal.SIGTERM
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "interrupted" and row["steps"] == "12", row["notes"]


def test_a_diverged_run_never_overwrites_a_good_checkpoint(tmp_path, good_checkpoint, monkeypatch):
    shared = tmp_path / "shared.pt"
    shared.write_bytes(good_checkpoint.read_bytes())
    monkeypatch.setattr(train.GPT, "loss", lambda self, x, y, reduction="mean", micro_step=0: (self(x) * float("nan")).mean())
    assert train.main(args(tmp_path, f"checkpoint.path={shared}", "checkpoint.every_seconds=1e-9")) == 1
    assert ledger.read(tmp_path / "ledger.csv")[0]["status"] == "diverged"
    assert shared.read_bytes() == good_checkpoint.read_bytes()
    trainer = train.Trainer(load_config(SMOKE, args(tmp_path, f"checkpoint.path={shared}")[2:]))
    trainer.log_file = open(tmp_path / "log.txt", "w")
    with torch.no_grad():
        trainer.model.wte.weight[0, 0] = float("inf")
    trainer.save()  # skipped: non-finite parameters
    trainer.log_file.close()
    trainer.loader.close()
    assert shared.read_bytes() == good_checkpoint.read_bytes()
    assert "skipped: non-finite parameters" in (tmp_path / "log.txt").read_text()


# -- sweeps killed alone, and the per-pair locks ----------------------------------------------------

def tiny_sweep(tmp_path, *overrides):
    """A sweep of one variant, two seeds, 30 logged steps each -> its command, the first pair's lock and checkpoint."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"name: tiny\nconfig: {SMOKE}\nseeds: [1, 2]\nvariants:\n  a: []\noverrides: "
                    f"[{', '.join(['budget.max_steps=30', 'run.log_every=1', 'eval.tokens=1024', *overrides])}]\n")
    command = [sys.executable, str(ROOT / "sweep.py"), str(spec), *args(tmp_path)[2:]]
    return command, tmp_path / "locks" / "tiny" / "a-seed1.lock", tmp_path / "runs" / "sweeps" / "tiny" / "a-seed1.pt"


def wait_for(condition, proc):
    """Poll until condition(), failing if `proc` ends first (or, so that a bug cannot hang the suite, after 10 minutes)."""
    deadline = time.monotonic() + 600
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, f"exit {proc.poll()} before the awaited state"
        time.sleep(0.1)


def start_and_reach_step_3(command, tmp_path):
    """The sweep, its output in a file; -> (it, its first train.py's pid) once that run logged step 3."""
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: "\nstep:3 " in log.read_text(), first)
    (child,) = Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()
    return first, int(child)


def start_until_it_waits(command, tmp_path):
    """The sweep -> (it, its output lines up to the one that says it waits for a pair's lock)."""
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "waits for it" in line:
            break
    return proc, lines


@pytest.mark.slow
def test_a_sweep_killed_alone_stops_its_run_and_the_rerun_waits_for_it(tmp_path, builtin_1024):
    """kill -9 of sweep.py alone: its train.py gets SIGTERM, finishes its step, checkpoints and writes
    an interrupted row. It is held stopped meanwhile, so that the rerun meets it still running: the
    rerun waits for the pair's lock, which that child holds, runs the other pair, then resumes this one."""
    command, lock, _ = tiny_sweep(tmp_path)
    first, child = start_and_reach_step_3(command, tmp_path)
    os.kill(child, signal.SIGSTOP)
    try:
        first.kill()  # the sweep alone: its child is in the same process group, untouched
        first.wait()
        rerun, lines = start_until_it_waits(command, tmp_path)
        assert (f"lock {lock} held (sweep tiny a seed 1: pid {first.pid} dead, child pid {child} alive on host "
                f"{socket.gethostname()}, since ") in lines[-1] and lines[-1].endswith("): a seed 1 waits for it\n"), lines
    finally:
        os.kill(child, signal.SIGCONT)  # it takes the SIGTERM its sweep's death sent
    out = "".join(lines) + rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, out
    rows = ledger.read(tmp_path / "ledger.csv")
    assert [(r["status"], r["seed"]) for r in rows] == [("interrupted", "1"), ("ok", "2"), ("ok", "1")], out
    assert rows[2]["steps"] == "30" and f"resumed from {rows[0]['run_id']} at step {rows[0]['steps']}" in rows[2]["notes"]
    assert out.count("stale lock") == 1 and f"stale lock {lock} (" in out and not lock.exists()


@pytest.mark.slow
def test_a_run_killed_before_its_sweep_is_reported_and_resumed(tmp_path, builtin_1024):
    """kill -9 of the running train.py, then of its sweep (held stopped in between, so that it cannot
    notice): the rerun says in one line each that it found a stale lock and a checkpoint without a
    row, and resumes the pair from that checkpoint: one ok row per pair, no other."""
    command, lock, ckpt = tiny_sweep(tmp_path, "checkpoint.every_seconds=1e-9")
    first, child = start_and_reach_step_3(command, tmp_path)
    os.kill(first.pid, signal.SIGSTOP)
    os.kill(child, signal.SIGKILL)
    first.kill()
    first.wait()
    saved = train.load_checkpoint(ckpt)
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stale = [line for line in out.stdout.splitlines() if "stale lock" in line]
    assert len(stale) == 1 and stale[0].startswith(f"sweep:tiny stale lock {lock} (sweep tiny a seed 1: pid {first.pid} "
                                                   f"dead, child pid {child} dead on host {socket.gethostname()}")
    assert stale[0].endswith("; no process holds it): removed")
    orphaned = [line for line in out.stdout.splitlines() if "has no ledger row" in line]
    assert orphaned == [f"sweep:tiny checkpoint {ckpt} (run {saved['run_id']}, step {saved['step']}) has no ledger row: "
                        f"its run was killed (kill -9, the OOM killer, a reboot); a seed 1 resumes from it"]
    rows = ledger.read(tmp_path / "ledger.csv")
    assert [(r["status"], r["seed"], r["steps"]) for r in rows] == [("ok", "1", "30"), ("ok", "2", "30")]
    assert f"resumed from {saved['run_id']} at step {saved['step']}" in rows[0]["notes"] and not lock.exists()


@pytest.mark.slow
def test_two_sweeps_never_run_one_pair(tmp_path, builtin_1024):
    """A pair whose lock another process holds (here the test, as a second sweep would) is waited
    for; once that process has finished the pair and let go, the sweep skips it."""
    command, lock, _ = tiny_sweep(tmp_path)
    other, _ = locks.take(lock, what="another sweep")
    runs, lines = start_until_it_waits(command, tmp_path)
    recipe = sweep.Sweep(sweep.load_sweep(Path(command[2])), command[3:], nproc=1).recipes["a"]
    ledger.append(tmp_path / "ledger.csv", dict(time="t", run_id="other-run", config=str(SMOKE), seed=1, status="ok",
                                                recipe=recipe, sweep="tiny", variant="a", val_bpb=3.0, tokens_per_s=1.0))
    other.release()
    out = "".join(lines) + runs.communicate(timeout=600)[0]
    assert runs.returncode == 0, out
    assert "sweep:tiny a seed 1 was finished by another process: skipped" in out
    assert [(r["run_id"], r["seed"]) for r in ledger.read(tmp_path / "ledger.csv")][0] == ("other-run", "1")
    assert [r["seed"] for r in ledger.read(tmp_path / "ledger.csv")] == ["1", "2"]


def test_a_lock_is_exclusive_inherited_and_stale_only_once_nobody_holds_it(tmp_path):
    path = tmp_path / "locks" / "x.lock"
    lock, found = locks.take(path, what="x")
    assert found == {} and json.loads(path.read_text()) == lock.info
    assert locks.take(path) == (None, lock.info)  # another open of the file, even in this process
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=(lock.fd,))
    lock.note(child=child.pid)
    os.close(lock.fd)  # its taker gone (as a sweep killed alone): the child still holds it
    assert locks.take(path)[0] is None and locks.clear_stale(path.parent) == []
    child.communicate(b"")
    assert locks.clear_stale(path.parent) == [(path, lock.info)] and not path.exists()
    here = socket.gethostname()
    assert locks.holder(lock.info) == (f"x: pid {os.getpid()} alive, child pid {child.pid} dead on host {here}, "
                                       f"since {lock.info['since']}")
    path.write_text(json.dumps(dict(host="elsewhere", pid=os.getpid(), what="x", since="t")))
    taken, found = locks.take(path, what="y")  # judged by its flock, which nobody holds, not by that pid
    assert locks.holder(found) == (f"x: pid {os.getpid()} on host elsewhere (another machine: its pids are not "
                                   f"checked here), since t")
    taken.release()
    assert not path.exists()
