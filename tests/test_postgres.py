"""A search's study in PostgreSQL, against a real server ($AION_TEST_POSTGRES, a role that may create
databases; .ci/run starts one): workers on two hosts (AION_HOST) share one study and split its
trials; a killed worker's trial waits for its own host; the workers outlive the server going away;
a URL Optuna cannot use is named before any trial. Tiny smoke trials, stopped by the calibrated clock."""
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
import sqlalchemy

import ledger
import search
import sweep
from test_faults import wait_for
from test_search import write_search

ROOT = Path(__file__).resolve().parents[1]
SERVER = os.environ.get("AION_TEST_POSTGRES")
_no_server = pytest.mark.skipif(not SERVER, reason="no PostgreSQL server: set AION_TEST_POSTGRES=postgresql://USER:"
                                                   "PASSWORD@HOST:PORT/DB (a role that may create databases)")


def needs_server(test):
    """Skipped without a server, and slow: left out of the README's command, run by .ci/run with this file's tests on
    one worker (one test restarts the server the others use)."""
    return pytest.mark.slow(_no_server(test))


@pytest.fixture
def database():
    """A database of this test's own on the server -> its URL; dropped after."""
    import psycopg
    name = f"aion_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(SERVER, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    yield sqlalchemy.engine.make_url(SERVER).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(SERVER, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def host_args(tmp_path, host):
    """Each host its own ledger and run folder, as on two machines (they share the search's folder)."""
    return [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / host / 'ledger.csv'}",
            f"run.out_dir={tmp_path / host / 'runs'}"]


@pytest.fixture
def worker(tmp_path):
    """-> start(path, url, host, log): `python sweep.py SEARCH.yaml --jobs 1 --storage URL` as host
    `host`, its output in `log`; one still running when the test ends (it failed) is killed."""
    started = []

    def start(path, url, host, log):
        with open(log, "a") as out:
            started.append(subprocess.Popen(
                [sys.executable, str(ROOT / "sweep.py"), str(path), "--no-confirm", "--jobs", "1", "--storage", url,
                 *host_args(tmp_path, host)], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "AION_HOST": host}))
        return started[-1]
    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def study(url):
    (summary,) = optuna.get_all_study_summaries(url)
    return optuna.load_study(study_name=summary.study_name, storage=url)


def check_every_trial_ran_once(tmp_path, url, trials):
    """`trials` ok trials and only surplus asks besides; each has exactly one row, ok, in its host's
    ledger (the hosts' ledgers merged), of its run."""
    done = study(url).get_trials()
    counted = [t for t in done if t.user_attrs.get("outcome") == "ok"]
    assert len(counted) == trials and all(t.user_attrs.get("outcome") in ("ok", "surplus") for t in done), done
    merged = tmp_path / "merged.csv"
    ledger.merge([tmp_path / host / "ledger.csv" for host in ("a", "b")], merged)
    mhash = study(url).study_name.split("-")[-1]
    for t in counted:
        (row,) = [r for r in ledger.read(merged) if r["variant"] == f"{mhash}-t{t.number:03d}" and r["status"] == "ok"]
        assert row["run_id"] == t.user_attrs["run_id"]
        assert row in ledger.read(tmp_path / t.user_attrs["host"] / "ledger.csv")
    return counted


@needs_server
def test_two_hosts_split_the_trials_of_one_study(tmp_path, builtin_1024, database, worker):
    path = write_search(tmp_path, trials=4)
    workers = [worker(path, database, host, tmp_path / f"{host}.log") for host in ("a", "b")]
    for w in workers:
        w.wait(timeout=900)
    outs = [(tmp_path / f"{host}.log").read_text() for host in ("a", "b")]
    assert [w.returncode for w in workers] == [0, 0], outs
    counted = check_every_trial_ran_once(tmp_path, database, 4)
    assert {t.user_attrs["host"] for t in counted} == {"a", "b"}, outs  # both ran trials


@needs_server
def test_a_killed_workers_trial_waits_for_its_own_host(tmp_path, builtin_1024, database, worker):
    """kill -9 of host a's worker while its trial trains: host b's worker never takes that trial and
    ends with it still running elsewhere; the same command on host a takes it over and resumes it."""
    path = write_search(tmp_path, trials=3)
    first = worker(path, database, "a", tmp_path / "a.log")
    other = worker(path, database, "b", tmp_path / "b.log")

    stopped = {}

    def stop_trial_of_a() -> bool:
        """Host a's trial once its run is past step 20 (its loss below a uniform guess: a run stopped
        earlier may be judged diverged), its run then stopped (SIGSTOP) so that it is killed there."""
        if not optuna.get_all_study_summaries(database):
            return False
        for t in study(database).get_trials(states=(optuna.trial.TrialState.RUNNING,)):
            log = tmp_path / "tiny" / "trials" / f"{study(database).study_name.split('-')[-1]}-t{t.number:03d}.log"
            if t.user_attrs.get("host") == "a" and log.is_file() and "\nstep:20 " in log.read_text():
                for child in Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text().split():
                    if "train.py" in Path(f"/proc/{child}/cmdline").read_text():
                        os.kill(int(child), signal.SIGSTOP)
                        stopped.update(trial=t, run=int(child))
                        return True
        return False

    wait_for(stop_trial_of_a, first)
    killed, run = stopped["trial"], stopped["run"]
    first.kill()
    first.wait()
    os.kill(run, signal.SIGCONT)  # it gets its parent's death (SIGTERM): checkpoint, interrupted row
    wait_for(lambda: any(r["status"] == "interrupted" for r in ledger.read(tmp_path / "a" / "ledger.csv")), other)
    assert other.wait(timeout=900) == 0
    out = (tmp_path / "b.log").read_text()
    assert "trials still run elsewhere" in out and "taken over" not in out, out
    assert study(database).trials[killed.number].state == optuna.trial.TrialState.RUNNING
    rerun = worker(path, database, "a", tmp_path / "a-again.log")
    assert rerun.wait(timeout=900) == 0, (tmp_path / "a-again.log").read_text()
    assert f"trial {killed.number} was left running by pid" in (tmp_path / "a-again.log").read_text()
    check_every_trial_ran_once(tmp_path, database, 3)
    rows = [r for r in ledger.read(tmp_path / "a" / "ledger.csv") if r["variant"].endswith(f"-t{killed.number:03d}")]
    assert [r["status"] for r in rows] == ["interrupted", "ok"] and "resumed from" in rows[1]["notes"]


def pg_ctl(*args):
    """pg_ctl on the test server's data folder, as its owner (the server refuses to run as root)."""
    data = os.environ["AION_TEST_POSTGRES_DATA"]
    owner = pwd.getpwuid(os.stat(data).st_uid).pw_name
    as_owner = ["runuser", "-u", owner, "--"] if os.geteuid() == 0 and owner != "root" else []
    # The server's own output to a file in its folder: a pipe it inherited would keep this waiting on it.
    subprocess.run([*as_owner, "pg_ctl", "-D", data, "-l", f"{data}/restarted.log", "-w", *args], check=True,
                   capture_output=True, timeout=300)


@needs_server
@pytest.mark.skipif(not os.environ.get("AION_TEST_POSTGRES_DATA") or not shutil.which("pg_ctl"),
                    reason="the server cannot be restarted from here: set AION_TEST_POSTGRES_DATA to its data folder "
                           "and put its pg_ctl on PATH (.ci/run does)")
def test_the_workers_wait_out_a_database_restart_and_lose_no_trial(tmp_path, builtin_1024, database, worker):
    """The server stops while trials train and starts again once both workers have found it gone:
    each waits for it (no trial failed, lost or run twice) and the study ends with its 4 trials."""
    path = write_search(tmp_path, trials=4)
    logs = [tmp_path / f"{host}.log" for host in ("a", "b")]
    workers = [worker(path, database, host, log) for host, log in zip(("a", "b"), logs)]
    trial_logs = tmp_path / "tiny" / "trials"
    wait_for(lambda: trial_logs.is_dir() and any("\nstep:3 " in f.read_text() for f in trial_logs.glob("*-t*.log")),
             workers[0])
    pg_ctl("stop", "-m", "fast")
    try:
        deadline = time.monotonic() + 600  # so that a bug cannot hang the suite
        while not all("search: lost the database" in log.read_text() for log in logs):
            assert all(w.poll() is None for w in workers) and time.monotonic() < deadline, [
                log.read_text() for log in logs]
            time.sleep(0.1)
    finally:
        pg_ctl("start")
    for w in workers:
        w.wait(timeout=900)
    outs = [log.read_text() for log in logs]
    assert [w.returncode for w in workers] == [0, 0] and all("is back after" in out for out in outs), outs
    check_every_trial_ran_once(tmp_path, database, 4)


@pytest.mark.parametrize("url, message", [
    ("postgresql://aion:secret@localhost:1/aion", "cannot open the database (connection failed: connection to server "
                                                  "at \"127.0.0.1\", port 1 failed: Connection refused)"),
    ("nosuchdb://localhost/aion", "Optuna cannot use this URL (Can't load plugin: sqlalchemy.dialects:nosuchdb)"),
    ("postgresql+pg8000://aion@localhost/aion", "Optuna cannot use this URL (No module named 'pg8000')"),
    ("wrong-password", "password authentication failed for user"),
])
def test_a_storage_url_optuna_cannot_use_is_named_before_any_trial(tmp_path, builtin_1024, capsys, url, message):
    if url == "wrong-password":
        if not SERVER:
            pytest.skip("no PostgreSQL server to refuse a password: set AION_TEST_POSTGRES")
        url = sqlalchemy.engine.make_url(SERVER).set(password="not-its-password").render_as_string(hide_password=False)
    path = write_search(tmp_path)
    assert sweep.main([str(path), "--storage", url, *host_args(tmp_path, "a")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    assert line.startswith(f"error: --storage {shown}: ") and message in line and "expected" in line, line
    assert "secret" not in line and "not-its-password" not in line  # the password never printed
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "a").exists()


def test_a_call_that_lost_the_database_is_retried_until_it_is_back_or_the_worker_stops(capsys):
    class Storage:  # stands in for RetryingStorage
        url, stopped = "postgresql://aion:secret@db/aion", False

    calls = []

    def call(storage, fail, stop_at=None):
        calls.append(1)
        if len(calls) == stop_at:
            storage.stopped = True  # as the worker's SIGTERM does
        if len(calls) <= fail:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))
        return "answer"

    assert search.retried(call)(Storage(), 2) == "answer" and len(calls) == 3
    out = capsys.readouterr().out
    assert "search: lost the database postgresql://aion:***@db/aion (server closed the connection)" in out
    assert "search: the database postgresql://aion:***@db/aion is back after" in out
    calls.clear()
    with pytest.raises(search.SearchError, match="stopped by a signal while the database was unreachable"):
        search.retried(call)(Storage(), 5, stop_at=2)
    assert len(calls) == 2  # no call after the stop
