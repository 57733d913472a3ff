"""A live view of a study: Optuna's own dashboard (optuna-dashboard, the README's command) on a
search's storage, a journal file or PostgreSQL, serves the study's trials through its HTTP API."""
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

import search
from test_postgres import SERVER, database  # noqa: F401 (a fixture)

DASHBOARD = Path(sys.executable).parent / "optuna-dashboard"  # the venv's, as the README runs it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("kind", ["journal", "postgresql"])
def test_the_dashboard_shows_a_studys_trials(tmp_path, request, kind):
    if kind == "postgresql" and not SERVER:
        pytest.skip("no PostgreSQL server: set AION_TEST_POSTGRES")
    storage = str(tmp_path / "study.journal") if kind == "journal" else request.getfixturevalue("database")
    study = optuna.create_study(study_name="tiny-0123abcd", storage=search.open_storage(storage, None))
    for number, value in enumerate((1.5, 1.4)):
        study.add_trial(optuna.trial.create_trial(params={"optim.muon_lr": 0.01 * (number + 1)}, value=value,
                                                  distributions={"optim.muon_lr": search.distribution(
                                                      "lr", {"float": [0.005, 0.08], "log": True})},
                                                  user_attrs={"outcome": "ok", "run_id": f"run-{number}"}))
    port = free_port()
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:
        dashboard = subprocess.Popen([str(DASHBOARD), storage, "--port", str(port), "--host", "127.0.0.1"],
                                     stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(3000):  # until it listens (ends a bug's wait after some minutes)
            assert dashboard.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail(f"optuna-dashboard never listened on port {port}")
        (listed,) = get(port, "/api/studies")["study_summaries"]
        assert listed["study_name"] == "tiny-0123abcd"
        trials = get(port, f"/api/studies/{listed['study_id']}?after=0")["trials"]
        assert [(t["number"], t["values"], t["state"]) for t in trials] == [(0, [1.5], "Complete"),
                                                                          (1, [1.4], "Complete")]
        assert {a["key"]: a["value"] for a in trials[1]["user_attrs"]} == {"outcome": "ok", "run_id": "run-1"}
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=60)
