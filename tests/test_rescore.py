"""tools/rescore.py: a tiny AION run scored again (at its own windows: its row's val_bpb; at shorter ones another), a
lineage run of a stand-in script (FrontierForge's is never in this repository) whose row's command line rebuilds the
settings the script loads with, and the errors that name the run."""
import csv
import json
import math
import os
import sys
from pathlib import Path

import torch

import config
import data
import ledger
import train
from tools import lineage_run, nanogpt, rescore

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def tiny_run(tmp_path) -> dict:
    """A smoke run of 4 steps -> its row."""
    assert train.main(["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}",
                       f"run.out_dir={tmp_path / 'runs'}", f"ledger.path={tmp_path / 'ledger.csv'}",
                       "budget.max_steps=4", "run.profile_steps=0"]) == 0
    return ledger.read(tmp_path / "ledger.csv")[-1]


def lines(out: str) -> list:
    return [dict(field.split(":", 1) for field in line.split()) for line in out.splitlines()]


def test_an_aion_run_scores_its_row_at_its_windows_and_another_value_at_shorter_ones(tmp_path, builtin_1024, capsys):
    row = tiny_run(tmp_path)
    capsys.readouterr()
    common = ["--ledger", str(tmp_path / "ledger.csv"), "--out", str(tmp_path / "scores.csv")]
    assert rescore.main(["--seq-len", "64", row["run_id"], *common]) == 0
    assert rescore.main(["--seq-len", "32", str(tmp_path / "runs" / row["run_id"]), *common]) == 0  # its folder
    own, short = lines(capsys.readouterr().out)
    final = [json.loads(r) for r in (tmp_path / "runs" / row["run_id"] / "metrics.jsonl").open()][-1]
    assert own["val_bpb"] == own["row_val_bpb"] == row["val_bpb"] == format(final["val_bpb"], ".6g")
    assert (own["row_seq_len"], own["seq_len"], short["seq_len"], own["steps"]) == ("64", "64", "32", "4")
    assert own["config"] == short["config"] == str(SMOKE)
    assert math.isfinite(float(short["val_bpb"])) and short["val_bpb"] != own["val_bpb"]
    with open(tmp_path / "scores.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [own, short]  # the header once
    assert ledger.read(tmp_path / "ledger.csv") == [row]  # no row appended


def test_errors_name_the_run_and_what_is_missing(tmp_path, builtin_1024, capsys):
    row = tiny_run(tmp_path)
    args = ["--seq-len", "32", "--ledger", str(tmp_path / "ledger.csv")]
    assert rescore.main([*args, "nope-1"]) == 2
    assert f"error: run nope-1: no row in {tmp_path / 'ledger.csv'}" in capsys.readouterr().err
    gone = tmp_path / "gone.csv"
    ledger.append(gone, {**row, "config": str(tmp_path / "gone.yaml")})
    assert rescore.main(["--seq-len", "32", "--ledger", str(gone), row["run_id"]]) == 2
    assert f"run {row['run_id']}: its config file {tmp_path / 'gone.yaml'} no longer exists" in capsys.readouterr().err
    checkpoint = tmp_path / "runs" / row["run_id"] / "checkpoint.pt"
    checkpoint.rename(tmp_path / "elsewhere.pt")
    assert rescore.main([*args, row["run_id"]]) == 2
    assert f"run {row['run_id']}: its checkpoint {checkpoint} is missing" in capsys.readouterr().err


STAND_IN = """import os, torch, torch.nn as nn
from types import SimpleNamespace
SEEN = {k: v for k, v in os.environ.items() if k.startswith(("FF_", "AION_KIT"))}  # its module-level settings
def load_for_eval(path, device):
    model = nn.Sequential(nn.Embedding(8192, 8), nn.Linear(8, 8192))  # a bigram model's logits
    model.load_state_dict(torch.load(path))
    model.config = SimpleNamespace(sequence_len=1024)
    return model.eval()
"""


def test_a_lineage_run_loads_with_the_settings_its_rows_command_line_gave_it(tmp_path, monkeypatch, capsys):
    """The row as tools/lineage_run.py writes it (its command line in overrides), the run folder its script copy and
    final.pt: the script imported in the settings lineage_run ran it with, scored by lineage_run.score."""
    overrides = ["eval.tokens=2048", f"data.path={ROOT / 'data' / 'builtin'}", f"run.out_dir={tmp_path / 'runs'}"]
    cfg = config.load_config(ROOT / "configs" / "cpu_lineage.yaml", overrides)
    folder = tmp_path / "runs" / "lineage-1"
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(STAND_IN)
    torch.manual_seed(0)
    bigram = torch.nn.Sequential(torch.nn.Embedding(8192, 8), torch.nn.Linear(8, 8192))
    torch.save(bigram.state_dict(), folder / "final.pt")
    ledger.append(tmp_path / "ledger.csv", dict(run_id="lineage-1", config="lineage:K0", seed=5, steps=9, status="ok",
                                                overrides=" ".join(["--script /gone/K0/train.py --seconds 20 --seed 5 "
                                                                    "--threads 1 --dtype aion", *overrides])))
    train_files, val_files, tokenizer, _ = train.open_data(cfg)
    settings = {**lineage_run.script_settings(cfg, 20, 5),
                **lineage_run.kit_env(train_files[0].parent.resolve(), 20, folder)}
    for name in settings:  # restored after the test: load_model sets them in this process
        monkeypatch.setenv(name, "")
    assert rescore.main(["--seq-len", "512", "lineage-1", "--ledger", str(tmp_path / "ledger.csv")]) == 0
    assert {k: v for k, v in sys.modules["lineage_script"].SEEN.items() if k in settings} == settings
    model = lineage_run.NextTokenNLL(lineage_run.load_model(folder / "train.py", settings, folder / "final.pt", 512),
                                     8192)
    expected = nanogpt.evaluate(model, val_files, 512, config.eval_rows(cfg, 512), data.ByteTable(tokenizer), 2048)[1]
    assert lines(capsys.readouterr().out)[0]["val_bpb"] == format(expected, ".6g")
    os.remove(folder / "train.py")
    assert rescore.main(["--seq-len", "512", str(folder), "--ledger", str(tmp_path / "ledger.csv")]) == 2
    assert f"run lineage-1: its script {folder / 'train.py'} is missing" in capsys.readouterr().err
