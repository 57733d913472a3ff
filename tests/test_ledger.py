import csv
import multiprocessing

import pytest

import ledger


def run_row(run_id, **fields):
    return {"time": "2025-01-01T00:00:00", "run_id": run_id, "config": "tiny", "device": "cpu",
            "status": "ok", **fields}


def test_header_written_once_and_round_trip(tmp_path):
    path = tmp_path / "sub" / "ledger.csv"
    ledger.append(path, run_row("a1", steps=10, mfu=0.123456789, val_bpb=None, git_dirty=True,
                                notes='comma, "quote"\nnewline'))
    ledger.append(path, run_row("a2", status="diverged"))
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(ledger.COLUMNS)
    assert sum(line == lines[0] for line in lines) == 1
    rows = ledger.read(path)
    assert [r["run_id"] for r in rows] == ["a1", "a2"]
    assert list(rows[0]) == ledger.COLUMNS
    assert rows[0]["steps"] == "10"
    assert rows[0]["mfu"] == "0.123457"
    assert rows[0]["val_bpb"] == ""
    assert rows[0]["git_dirty"] == "true"
    assert rows[0]["notes"] == 'comma, "quote"\nnewline'
    assert rows[1]["status"] == "diverged" and rows[1]["steps"] == ""


def test_read_missing_is_empty(tmp_path):
    assert ledger.read(tmp_path / "none.csv") == []


def test_unknown_key_rejected(tmp_path):
    path = tmp_path / "ledger.csv"
    with pytest.raises(ledger.LedgerError, match="bogus"):
        ledger.append(path, run_row("a", bogus=1))
    assert not path.exists() or path.read_text() == ""


@pytest.mark.parametrize("status", ["great", None])
def test_bad_status_rejected(tmp_path, status):
    with pytest.raises(ledger.LedgerError, match="status"):
        ledger.append(tmp_path / "ledger.csv", run_row("a", status=status))


def test_header_mismatch_rejected_and_file_untouched(tmp_path):
    path = tmp_path / "ledger.csv"
    old = "time,run_id,val_loss,status\n2024,old,3.0,ok\n"
    path.write_text(old)
    with pytest.raises(ledger.LedgerError) as error:
        ledger.append(path, run_row("new"))
    assert str(path) in str(error.value) and "val_bpb" in str(error.value)
    assert path.read_text() == old


def _append_many(path, worker, count):
    for i in range(count):
        # Rows far larger than a page make any interleaving of writes visible.
        ledger.append(path, run_row(f"w{worker}-{i}", steps=i, notes=f"{worker}" * 10000))


def test_concurrent_appends(tmp_path):
    path = tmp_path / "ledger.csv"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_append_many, args=(path, w, 50)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join()
    assert all(p.exitcode == 0 for p in workers)
    with open(path, newline="") as f:
        records = list(csv.reader(f))
    assert records[0] == ledger.COLUMNS
    assert len(records) == 201
    assert all(len(r) == len(ledger.COLUMNS) for r in records)
    rows = ledger.read(path)
    assert sorted(r["run_id"] for r in rows) == sorted(f"w{w}-{i}" for w in range(4) for i in range(50))
    assert all(r["notes"] == r["run_id"][1] * 10000 for r in rows)


@pytest.fixture
def filled(tmp_path):
    path = tmp_path / "ledger.csv"
    ledger.append(path, run_row("abc123", steps=100, tokens_per_s=1000.0, val_bpb=1.5,
                                seed=1, notes="x" * 100))
    ledger.append(path, run_row("abd456", steps=150, tokens_per_s=1250.5, val_bpb=1.25, seed=2))
    ledger.append(path, run_row("zzz789", steps=7, status="failed"))
    return str(path)


def test_show(filled, capsys):
    assert ledger.main(["show", "--path", filled]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ledger.SHOW_COLUMNS
    assert [line.split()[1] for line in lines[1:]] == ["abc123", "abd456", "zzz789"]
    assert "x" * 37 + "..." in lines[1] and "x" * 41 not in lines[1]
    status_at = lines[0].index("status")  # fixed-width: every status sits under its header
    assert [line[status_at - 1:].split()[0] for line in lines[1:]] == ["ok", "ok", "failed"]
    assert all(line[status_at - 1] == " " for line in lines[1:])

    assert ledger.main(["show", "-n", "1", "--path", filled]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "zzz789" in lines[1]


def test_show_empty(tmp_path, capsys):
    path = str(tmp_path / "missing.csv")
    assert ledger.main(["show", "--path", path]) == 0
    assert capsys.readouterr().out.strip() == f"no runs in {path}"


def test_compare_with_prefixes(filled, capsys):
    assert ledger.main(["compare", "abc", "abd4", "--path", filled]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["column", "abc123", "abd456", "delta"]
    by_column = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(by_column) == set(ledger.COLUMNS)
    assert by_column["steps"] == ["steps", "100", "150", "+50"]
    assert by_column["tokens_per_s"] == ["tokens_per_s", "1000", "1250.5", "+250.5"]
    assert by_column["val_bpb"] == ["val_bpb", "1.5", "1.25", "-0.25"]
    assert by_column["seed"] == ["seed", "1", "2"]  # not a quantity: no delta
    assert by_column["config"] == ["config", "tiny", "tiny"]


@pytest.mark.parametrize("a, b, message", [
    ("ab", "zzz", "ambiguous run id 'ab' matches: abc123, abd456"),
    ("abc", "nope", "unknown run id 'nope'"),
])
def test_compare_bad_ids(filled, capsys, a, b, message):
    assert ledger.main(["compare", a, b, "--path", filled]) == 2
    assert message in capsys.readouterr().err


def test_compare_empty(tmp_path, capsys):
    path = str(tmp_path / "missing.csv")
    assert ledger.main(["compare", "a", "b", "--path", path]) == 2
    assert f"no runs in {path}" in capsys.readouterr().err


def host_ledgers(tmp_path):
    """Two hosts' ledgers: arm tiny/a ran on host A, tiny/b on B (3 seeds each); B holds a copy of one of
    A's rows and a row torn by a kill."""
    paths = [tmp_path / "a" / "ledger.csv", tmp_path / "b" / "ledger.csv"]
    for host, (path, variant, bpb) in enumerate(zip(paths, "ab", (1.50, 1.40))):
        for seed in (1, 2, 3):
            ledger.append(path, run_row(f"{variant}{seed}", time=f"2026-12-0{seed}T0{host}:00:00Z", sweep="tiny",
                                        variant=variant, recipe=f"r{variant}", seed=seed, budget_s=2, machine="m",
                                        tokens_per_s=1000, val_bpb=bpb + seed / 100))
    ledger.append(paths[1], ledger.read(paths[0])[0])
    with open(paths[1], "a") as f:
        f.write("2026-12-04T00:00:00Z,b4,torn-off")
    return paths


def test_merge_keeps_each_run_once_and_sets_torn_rows_apart(tmp_path, capsys):
    a, b = host_ledgers(tmp_path)
    out = tmp_path / "ledger.csv"
    assert ledger.main(["merge", str(a), str(b), "--out", str(out)]) == 0
    rows = ledger.read(out)
    assert [r["run_id"] for r in rows] == ["a1", "b1", "a2", "b2", "a3", "b3"]  # oldest first, a1 once
    assert list(rows[0]) == ledger.COLUMNS and rows[0] == ledger.read(a)[0]
    err = capsys.readouterr().err
    torn = tmp_path / "ledger.torn.csv"
    assert f"set apart in {torn}: {b} line 6: 3 fields" in err
    with open(torn, newline="") as f:
        assert list(csv.reader(f))[1] == [f"{b} line 6: 3 fields, expected {len(ledger.COLUMNS)} (a torn row?)",
                                          "2026-12-04T00:00:00Z", "b4", "torn-off"]
    assert ledger.main(["verdict", "tiny/a", "tiny/b", "--path", str(out)]) == 0  # arms of both hosts
    assert "paired t-test on the per-seed differences, seeds 1, 2, 3" in capsys.readouterr().out


@pytest.mark.parametrize("notes", ["cut short", "cut, short"])  # the last field plain, or quoted (it holds a comma)
def test_a_last_row_cut_in_its_last_field_is_set_apart_and_stays_torn(tmp_path, capsys, notes):
    """`head -c -6 ledger.csv`: every field there, the final newline and the notes' end gone."""
    a, _ = host_ledgers(tmp_path)
    ledger.append(a, run_row("a4", notes=f"the whole note: {notes}"))
    cut = tmp_path / "cut.csv"
    cut.write_bytes(a.read_bytes()[:-6])
    out = tmp_path / "ledger.csv"
    assert ledger.main(["merge", str(cut), "--out", str(out)]) == 0
    assert [r["run_id"] for r in ledger.read(out)] == ["a1", "a2", "a3"]
    problem = f"{cut} line 5: no final newline, expected every row to end with one"
    assert f"warning: set apart in {tmp_path / 'ledger.torn.csv'}: {problem}" in capsys.readouterr().err
    with open(tmp_path / "ledger.torn.csv", newline="") as f:
        _, (reason, *cells) = csv.reader(f)
    assert reason.startswith(problem) and len(cells) == len(ledger.COLUMNS) and cells[1] == "a4"
    # the next run's row starts on a line of its own, and the cut one still reads as torn
    ledger.append(cut, run_row("a5"))
    rows, problems = ledger.read_checked(cut)
    assert [r["run_id"] for r in rows] == ["a1", "a2", "a3", "a5"]
    assert problems == [f"{cut} line 5: {len(ledger.COLUMNS) + 1} fields, expected {len(ledger.COLUMNS)} (a torn row?)"]


def test_merge_refuses_a_run_with_two_different_rows_another_schema_and_an_existing_out(tmp_path, capsys):
    a, b = host_ledgers(tmp_path)
    changed = tmp_path / "changed.csv"
    ledger.append(changed, {**ledger.read(a)[1], "val_bpb": "1.3"})
    out = tmp_path / "ledger.csv"
    assert ledger.main(["merge", str(a), str(changed), "--out", str(out)]) == 2
    assert f"error: run a2: its rows in {a} and {changed} differ (in val_bpb)" in capsys.readouterr().err
    old = tmp_path / "old.csv"
    old.write_text("time,run_id,val_loss,status\n2024,old,3.0,ok\n")
    assert ledger.main(["merge", str(a), str(old), "--out", str(out)]) == 2
    assert f"error: {old}: header differs from ledger.COLUMNS" in capsys.readouterr().err
    assert not out.exists()
    out.write_text("")
    assert ledger.main(["merge", str(a), "--out", str(out)]) == 2
    assert f"error: {out} exists" in capsys.readouterr().err


def test_verdict_judges_the_kits_figure_where_every_run_has_it():
    def arm(bpb, kit, jitter=0.0):
        return [dict(seed=str(seed), val_bpb=str(bpb + d), kit_val_bpb="" if kit is None else str(kit + d),
                     tokens_per_s="100", clock="wall") for seed, d in ((1, 0.0), (2, 0.01 + jitter), (3, -0.005))]
    both = ledger.judge(arm(1.5, 1.4), arm(1.4, 1.45, jitter=0.002))
    assert both["val_bpb"]["verdict"] == "keep" and both["kit_val_bpb"]["verdict"] == "revert"
    assert "kit_val_bpb" not in ledger.judge(arm(1.5, 1.4), arm(1.4, None))  # one arm without it: not judged
    lines, _ = ledger.verdict_lines("A", arm(1.5, None), "B", arm(1.4, None))
    assert [line[0] for line in lines[1:] if line[0]] == ["val_bpb", "tokens_per_s"]
