"""The recipe search (search.py, `python sweep.py SEARCH.yaml`): bad input named before any trial,
invalid draws not counted, pruned runs that are never results, kill -9 and resume, two workers on
one study, one study per machine kind. Tiny smoke trials; they stop by the calibrated clock."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

import clock
import ledger
import locks
import search
import sweep
import sweeprun
from test_clock import args as extra
from test_faults import wait_for

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
SPACE = {"optim.muon_lr": {"float": [0.005, 0.08], "log": True}}


def write_search(tmp_path, space=None, overrides=(), **search_keys):
    """A search file of smoke trials (2 s by the calibrated clock, at a reference step of 25 ms) -> its path."""
    doc = dict(name="tiny", config=str(SMOKE), clock="calibrated",
               overrides=["budget.max_steps=0", "run.log_every=1", "eval.tokens=1024", "run.profile_steps=0",
                          "budget.reference_step_ms=25", *overrides],  # 80 steps of the base config however busy
               search={"trials": 3, "budget": 2, "calibration_rounds": 2, "space": space or SPACE, **search_keys})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def command(tmp_path, path, *more):
    return [sys.executable, str(ROOT / "sweep.py"), str(path), "--no-confirm", *more, *extra(tmp_path)]


def trials(tmp_path, name="tiny"):
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(tmp_path / name / "study.journal")))
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()


@pytest.mark.parametrize("space, keys, message", [
    ({"model.n_layers": {"int": [1, 3]}}, {}, "space: unknown key model.n_layers: neither a config key (did you mean "
                                              "model.n_layer?)"),
    ({"model.n_layer": {"int": [0, 3]}}, {}, "space.model.n_layer: the value 0 validates with none of 200 draws"),
    ({"model.n_layer": {"int": [3, 3]}}, {}, "an empty range [3, 3]"),
    ({"model.n_embd": {"choice": [66, 70]}}, {}, "space.model.n_embd: the value 66 validates with none"),
    ({"optim.muon_lr": {"float": [0, 0.1], "log": True}}, {}, "log: true needs low > 0"),
    ({"optim.muon_lr": {"uniform": [0, 1]}}, {}, "expected {int: [low, high]}"),
    (SPACE, {"prune": {"at": [0.3, 0.5]}}, "every fraction must be a multiple of the first (0.3)"),
    (SPACE, {"confirm": {"seeds": [1]}}, "confirm.seeds: expected at least two"),
    (SPACE, {"tirals": 3}, "unknown tirals"),
    (SPACE, {"confirm": {"against": "configs/nope.yaml"}}, "confirm.against: config file"),
    (SPACE, {"enqueue": [{"optim.muon_lr": 0.5}]}, "enqueue[0].optim.muon_lr: 0.5 is outside the space"),
    ({"model.n_layer": {"int": [2, 6], "step": 2}}, {"enqueue": [{"model.n_layer": 3}]},
     "enqueue[0].model.n_layer: 3 is outside the space"),  # in the range, off the step grid
    ({"model.n_layer": {"int": [2, 4]}}, {"enqueue": [{"model.n_layer": 2.5}]},
     "enqueue[0].model.n_layer: 2.5 is outside the space"),
    ({"optim.muon_lr": {"float": [0.01, 0.05], "step": 0.01}}, {"enqueue": [{"optim.muon_lr": 0.025}]},
     "enqueue[0].optim.muon_lr: 0.025 is outside the space"),
    (SPACE, {"enqueue": [{"optim.muon_rl": 0.02}]}, "enqueue[0]: expected a value for each space name; missing "
                                                    "['optim.muon_lr'], unknown ['optim.muon_rl']"),
    ({"start": {"float": [0.2, 0.6]}}, {"templates": {"schedule.stage": [{"at": 0}]}},
     "templates: unknown config key schedule.stage"),
])
def test_bad_input_is_named_before_any_trial(tmp_path, builtin_1024, capsys, space, keys, message):
    path = write_search(tmp_path, space, **keys)
    assert sweep.main([str(path), *extra(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and not (tmp_path / "tiny").exists(), err


@pytest.mark.parametrize("key, value, message", [
    ("search", {"trials": 3, "space": ["optim.muon_lr"]},
     "search.space: expected a mapping of at least one key to search, got ['optim.muon_lr']"),
    ("search", {"trials": 3, "space": SPACE, "confirm": {"seeds": [True, 7]}},
     "search.confirm.seeds: expected at least two non-negative integers (a paired verdict), got [True, 7]"),
    ("config", 3, "config: expected the path of a config file, got 3"),
    ("overrides", [3], "overrides: expected a list of key.sub=value strings, got [3]"),
])
def test_a_malformed_search_file_is_named_not_a_traceback(tmp_path, capsys, key, value, message):
    path = write_search(tmp_path)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), key: value}))
    assert sweep.main([str(path), *extra(tmp_path)]) == 2
    assert f"error: {path}: {message}" in capsys.readouterr().err


def test_bad_input_on_the_command_line_is_exit_2_and_one_line(tmp_path, builtin_1024):
    """From the shell (sweep.py as __main__, its main() catching sweeprun's SweepError, which search.py's
    SearchError subclasses) a bad search file is the same named error, not a traceback."""
    path = write_search(tmp_path, space={"model.mlp_mult": {"choice": [3]}})
    proc = subprocess.run(command(tmp_path, path), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"error: {path}: search.space.model.mlp_mult.choice: expected at "
                                                     f"least two different values, got [3]")


def test_a_search_needs_the_calibrated_clock(tmp_path, builtin_1024, capsys):
    path = write_search(tmp_path)
    path.write_text(path.read_text().replace("clock: calibrated", "clock: wall"))
    assert sweep.main([str(path), *extra(tmp_path)]) == 2
    assert "a search needs clock: calibrated" in capsys.readouterr().err


def test_templates_fill_sampled_names_and_the_rest_are_keys():
    spec = dict(search=dict(templates={"schedule.stages": [{"at": 0, "depth": "$d0"}, {"at": "$at", "depth": 4}]}))
    assert search.trial_overrides(spec, {"d0": 2, "at": 0.3, "optim.muon_lr": 0.02}) == [
        "optim.muon_lr=0.02", "schedule.stages=[{at: 0, depth: 2}, {at: 0.3, depth: 4}]"]


@pytest.mark.parametrize("d, value", [
    (optuna.distributions.IntDistribution(2, 6, step=2), 4), (optuna.distributions.IntDistribution(2, 6), 6),
    (optuna.distributions.FloatDistribution(0.01, 0.05, step=0.01), 0.03),
    (optuna.distributions.FloatDistribution(0.01, 0.05, log=True), 0.0123),
    (optuna.distributions.CategoricalDistribution([True, False]), False)])
def test_values_a_distribution_can_draw_are_in_its_space(d, value):
    assert search.in_space(d, value)


def test_enqueued_trials_are_asked_first_and_queued_once_per_study(tmp_path, builtin_1024):
    spec = search.load(write_search(tmp_path, enqueue=[{"optim.muon_lr": 0.02}]))
    for _ in range(2):  # a restarted worker does not queue it again
        worker = search.Worker(spec, extra(tmp_path))
    assert [t.state for t in worker.study.trials] == [optuna.trial.TrialState.WAITING]
    first, second = (worker.study.ask(spec["search"]["space"]) for _ in range(2))
    assert first.params == {"optim.muon_lr": 0.02} and second.params != first.params


def test_a_draw_that_does_not_validate_is_failed_and_not_counted(tmp_path, builtin_1024, capsys):
    """Heads 3 of width 64 do not divide: that draw (queued first) is an Optuna FAIL with its error,
    no run, no row; the search still ends with its 3 trials, each one ok row of its recipe."""
    path = write_search(tmp_path, {"model.n_embd": {"choice": [64, 96]}, "model.n_head": {"choice": [4, 3]}},
                        ["model.n_kv_head=1"], trials=2)
    spec = search.load(path)
    worker = search.Worker(spec, extra(tmp_path))
    worker.study.enqueue_trial({"model.n_embd": 64, "model.n_head": 3})
    assert worker.run(confirm=False) == 0
    out = capsys.readouterr().out
    done = trials(tmp_path)
    outcomes = [t.user_attrs["outcome"] for t in done]
    assert outcomes[0] == "invalid" and outcomes.count("ok") == 2 and set(outcomes) == {"invalid", "ok"}, out
    invalid = [t for t in done if t.user_attrs["outcome"] == "invalid"]
    assert all(t.state == optuna.trial.TrialState.FAIL and "n_head (3)" in t.user_attrs["error"] for t in invalid)
    rows = ledger.read(tmp_path / "ledger.csv")
    assert sorted(r["variant"] for r in rows) == [worker.variant(t.number) for t in done if t.user_attrs["outcome"] == "ok"]
    assert all(r["status"] == "ok" and r["sweep"] == "tiny" and "model.n_embd=" in r["overrides"] for r in rows)
    assert "trial 0 invalid, not counted" in out and "trial 2/2 " in out
    table = (tmp_path / "tiny" / f"trials-{worker.mhash}.md").read_text()
    assert table.count("| ok |") == 2 and "| invalid |" in table
    assert (tmp_path / "tiny" / f"history-{worker.mhash}.png").stat().st_size > 0


def test_the_confirmation_pairs_the_best_trials_against_the_against_config(tmp_path, builtin_1024, monkeypatch):
    """confirm.against makes the confirmation's base arm that config, with the trials on the search's."""
    path = write_search(tmp_path, overrides=["eval.tokens=2048"],  # one of cpu.yaml's windows (eval.seq_len 2048)
                        confirm={"best": 1, "seeds": [1, 2], "against": str(ROOT / "configs" / "cpu.yaml")})
    worker = search.Worker(search.load(path), extra(tmp_path))
    for number, value in enumerate((1.5, 1.4)):
        worker.study.add_trial(optuna.trial.create_trial(
            params={"optim.muon_lr": 0.01 * (number + 1)}, distributions={"optim.muon_lr": search.distribution(
                "lr", SPACE["optim.muon_lr"])}, value=value, user_attrs={"overrides": [f"optim.muon_lr={value}"]}))
    specs = []
    monkeypatch.setattr(sweeprun, "Sweep", lambda spec, *args, **kwargs: specs.append(spec) or type(
        "Ran", (), {"run": lambda self: 0})())
    assert worker.confirm() == 0
    (spec,) = specs
    assert spec["variants"] == {"base": [], worker.variant(1): ["optim.muon_lr=1.4"]} and spec["seeds"] == [1, 2]
    assert spec["variant_configs"] == {"base": str(ROOT / "configs" / "cpu.yaml")} and spec["config"] == str(SMOKE)


def test_sigusr1_prunes_a_run_into_a_row_no_verdict_reads(tmp_path, builtin_1024):
    """A pruned run: its own status, where it stopped and its last curve point in the notes, no
    evaluation, exit 0; `ledger.arm` (verdicts, show's arms) never takes it as a result."""
    out_log = tmp_path / "run.log"
    args = ["--config", str(SMOKE), *extra(tmp_path), "budget.max_steps=400", "run.log_every=1",
            "eval.every_seconds=1e-9", "eval.curve_tokens=64"]
    with open(out_log, "w") as out:
        child = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: "\nstep:3 " in out_log.read_text(), child)
    child.send_signal(signal.SIGUSR1)
    assert child.wait(timeout=300) == 0, out_log.read_text()[-2000:]
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "pruned" and not row["val_bpb"] and 3 <= int(row["steps"]) < 400
    assert "pruned at p=" in row["notes"] and "its last curve point val_bpb=" in row["notes"]
    with pytest.raises(ledger.LedgerError):
        ledger.arm(ledger.read(tmp_path / "ledger.csv"), row["run_id"])


def test_pruning_stops_a_trial_worse_than_those_before_at_the_same_point(tmp_path, builtin_1024):
    """The worker reports a curve point at a prune fraction and, where Optuna prunes, sends SIGUSR1."""
    path = write_search(tmp_path, prune={"at": [0.25, 0.5], "keep": 0.5, "after": 1})
    worker = search.Worker(search.load(path), extra(tmp_path))
    for value in (1.0, 1.1):  # two finished trials, 1.0 and 1.1 at p = 0.25
        t = worker.study.ask(worker.s["space"])
        t.report(value, 250)
        worker.study.tell(t, value)
    sent = []

    class Child:
        def send_signal(self, signum):
            sent.append(signum)

    good = dict(trial=worker.study.ask(worker.s["space"]), child=Child(), reported=set(), points=[(0.0, 3.0), (0.5, 0.9)])
    worker.prune_check(good)  # p = 0 is no prune point; 0.9 at p = 0.25 is the best there
    bad = dict(trial=worker.study.ask(worker.s["space"]), child=Child(), reported=set(), points=[(0.51, 1.2)])
    worker.prune_check(bad)
    assert sent == [signal.SIGUSR1] and bad["pruning"] == (0.25, 1.2) and "pruning" not in good
    assert good["trial"].study.trials[2].intermediate_values == {250: 0.9}


def test_the_table_and_plots_are_rewritten_as_each_trial_ends(tmp_path, builtin_1024, monkeypatch):
    """A long search shows where it stands: the plots are drawn after each trial that ends, not only at
    the search's end (3 trials: after the first, second and third, then once more at the end)."""
    spec = search.load(write_search(tmp_path))
    worker = search.Worker(spec, extra(tmp_path))
    drawn, draw = [], worker.write_plots
    monkeypatch.setattr(worker, "write_plots", lambda: (drawn.append(len(
        worker.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))), draw()))
    assert worker.run(confirm=False) == 0
    assert drawn == [1, 2, 3, 3]
    assert (tmp_path / "tiny" / f"importance-{worker.mhash}.png").stat().st_size > 0


@pytest.mark.slow
def test_kill_9_then_the_same_command_loses_repeats_and_double_counts_no_trial(tmp_path, builtin_1024):
    """kill -9 of the search while its second trial trains: the trial's run checkpoints and writes an
    interrupted row (its parent's death sends SIGTERM), and stays RUNNING in the study. The same
    command takes it over and resumes it from its checkpoint: 3 trials, one ok row each."""
    path = write_search(tmp_path)
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(command(tmp_path, path), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    logs = tmp_path / "tiny" / "trials"
    second = lambda: next(iter(logs.glob("*-t001.log")), None) if logs.is_dir() else None  # noqa: E731
    wait_for(lambda: second() and "\nstep:5 " in second().read_text(), first)
    trial = int(Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split()[0])  # its train.py
    first.kill()
    first.wait()
    deadline = time.monotonic() + 600  # (only so that a bug cannot hang the suite)
    while locks.alive(trial):  # the trial's run saves, writes its row and exits, however long that takes
        assert time.monotonic() < deadline, second().read_text()[-2000:]
        time.sleep(0.2)
    assert any(r["status"] == "interrupted" for r in ledger.read(tmp_path / "ledger.csv")), second().read_text()[-2000:]
    rerun = subprocess.run(command(tmp_path, path), cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "trial 1 was left running by pid" in rerun.stdout and "taken over" in rerun.stdout
    assert "(2/3 trials counted so far, 1 of them left running)" in rerun.stdout
    done = trials(tmp_path)
    assert [(t.number, t.user_attrs["outcome"]) for t in done] == [(0, "ok"), (1, "ok"), (2, "ok")], rerun.stdout
    rows = ledger.read(tmp_path / "ledger.csv")
    by_variant = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r["status"])
    assert sorted(by_variant.values()) == [["interrupted", "ok"], ["ok"], ["ok"]], by_variant
    resumed = [r for r in rows if r["status"] == "ok" and "resumed from" in r["notes"]]
    assert len(resumed) == 1 and resumed[0]["variant"].endswith("-t001")


def children(pid):
    """The command lines of a process's children."""
    listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode() for child in listed]


@pytest.mark.slow
def test_sigterm_while_a_trial_calibrates_then_the_same_command_calibrates_and_runs_it(tmp_path, builtin_1024):
    """SIGTERM of the search while it calibrates its first trial's shape: it stops as a stop does (exit
    143, no traceback), the trial left RUNNING; the same command takes it over, calibrates it first
    (train.py would refuse a stage without a cost) and runs it."""
    path = write_search(tmp_path, space={"model.mlp_mult": {"choice": [3, 4]}}, trials=1)
    log = tmp_path / "first.log"
    with open(log, "w") as to_log:
        first = subprocess.Popen(command(tmp_path, path), cwd=tmp_path, stdout=to_log, stderr=subprocess.STDOUT)
    wait_for(lambda: any(" calibrate " in c for c in children(first.pid)), first)
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=120)
    out = log.read_text()
    assert first.returncode == 128 + signal.SIGTERM and "Traceback" not in out, out
    assert "stopped by signal 15" in out and [t.state for t in trials(tmp_path)] == [optuna.trial.TrialState.RUNNING]
    rerun = subprocess.run(command(tmp_path, path), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "trial 0 was left running by pid" in rerun.stdout
    assert [t.user_attrs["outcome"] for t in trials(tmp_path)] == ["ok"], rerun.stdout
    assert [r["status"] for r in ledger.read(tmp_path / "ledger.csv")] == ["ok"]


@pytest.mark.slow
def test_two_workers_share_one_study_and_split_its_trials(tmp_path, builtin_1024):
    """Two processes on one journal storage: 4 trials between them, each run once, each by one worker."""
    path = write_search(tmp_path, trials=4)
    journal = tmp_path / "shared.journal"
    workers = [subprocess.Popen(command(tmp_path, path, "--storage", str(journal)), cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [w.communicate(timeout=900)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outs
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    (summary,) = optuna.get_all_study_summaries(storage)
    done = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()
    counted = [t for t in done if t.user_attrs.get("outcome") == "ok"]
    assert len(counted) == 4 and all(t.user_attrs.get("outcome") in ("ok", "surplus") for t in done), outs
    assert {t.user_attrs["pid"] for t in counted} == {w.pid for w in workers}, outs  # both ran trials
    rows = ledger.read(tmp_path / "ledger.csv")
    assert sorted(r["variant"] for r in rows) == sorted(f"{summary.study_name.split('-')[-1]}-t{t.number:03d}"
                                                       for t in counted)


def test_another_machine_kind_gets_a_study_of_its_own(tmp_path, builtin_1024, monkeypatch):
    """A study is one machine kind: on another (here a stand-in CPU name) the search starts that
    kind's study in the same storage and leaves the first one's trials as they were."""
    spec = search.load(write_search(tmp_path))
    here = search.Worker(spec, extra(tmp_path))
    t = here.study.ask(here.s["space"])
    here.study.tell(t, 1.5)
    monkeypatch.setattr(clock, "machine", lambda accelerator="": "Another CPU (family 6, model 207; avx2), 2 CPUs, "
                                                                 "2 threads, torch 2.9.0")
    there = search.Worker(spec, extra(tmp_path))
    assert there.study_name != here.study_name and there.study_name.startswith("tiny-")
    assert there.study.trials == [] and len(here.study.trials) == 1 and here.study.trials[0].value == 1.5
    assert there.base.calibration != here.base.calibration  # and its own calibration file


def state(pid):
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("ends", ["measured", "killed"])
def test_a_calibration_pauses_the_running_trials_and_continues_them_however_it_ends(tmp_path, monkeypatch, ends):
    # The stand-in trial says when it sleeps: before that a loaded machine may show it reading its files (D).
    trial = subprocess.Popen([sys.executable, "-c", "import time; print('asleep', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    assert trial.stdout.readline() == "asleep\n"
    seen = []

    class Runner:  # stands in for trial_sweep's Sweep: its calibrate() looks at the trial
        calibration = tmp_path / "calibration.json"

        def calibrate(self, before_rounds):
            seen.append(state(trial.pid))  # the warm-up's compiles: not stopped
            before_rounds()
            for _ in range(100):  # SIGSTOP takes effect asynchronously
                if state(trial.pid) == "T":
                    break
                time.sleep(0.05)
            seen.append(state(trial.pid))
            if ends == "killed":
                signal.raise_signal(signal.SIGTERM)  # as the worker's death or its stop would send

    monkeypatch.setattr(search, "trial_sweep", lambda **job: Runner())
    handler = signal.getsignal(signal.SIGTERM)
    try:
        if ends == "killed":
            with pytest.raises(SystemExit):
                search.calibrate_main('{"paused": [%d]}' % trial.pid)
        else:
            assert search.calibrate_main('{"paused": [%d]}' % trial.pid) == 0
        assert seen[0] in "SR" and seen[1] == "T" and state(trial.pid) in "SR"  # stopped while it measured only
    finally:
        signal.signal(signal.SIGTERM, handler)
        trial.kill()
        trial.communicate()
