"""eval.seq_len: AION's val_bpb scored on windows of another length than the training rows (issue 50), so runs
trained on rows of different lengths are judged on the same windows; a model trained on short rows is scored at
positions it never trained at (rotary angles exist for any position; nothing in the model is sized by the rows)."""
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import ledger
import train
from config import ConfigError, flatten, load_config, recipe
from test_backends import XLA_GRAPHS, run, smoke_args
from test_lineage_model import trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def trained(tmp_path, *extra):
    t = trainer(tmp_path, "budget.max_steps=3", f"checkpoint.path={tmp_path / 'c.pt'}", *extra)
    t.train()
    return t


def scored_at(t, seq_len):
    t.cfg = dataclasses.replace(t.cfg, eval=dataclasses.replace(t.cfg.eval, seq_len=seq_len))
    return t.evaluate(t.cfg.eval.tokens)


def test_zero_scores_the_training_rows_windows_bitwise(tmp_path, builtin_1024):
    t = trained(tmp_path)
    assert t.cfg.eval.seq_len == 0 and t.cfg.data.seq_len == 64
    assert scored_at(t, 0) == scored_at(t, 64)
    assert scored_at(t, 128) != scored_at(t, 64)


@pytest.mark.parametrize("extra", [(), ("model.key_offset=0.3", "model.doc_mask=true", "model.value_embed=true")])
def test_longer_windows_score_by_hand(tmp_path, builtin_1024, extra):
    """Trained on rows of 64, scored on windows of 256 (with eval.tokens=4096: 16 windows, 2 per forward):
    the first 16 x 256 targets of the validation stream, each once, through load_for_eval's model."""
    t = trained(tmp_path, *extra)
    loss, bpb, n_tokens, n_bytes = scored_at(t, 256)
    assert train.eval_rows(t.cfg, 256) == 2  # eval.batch_size 8 rows of 64 tokens: the same tokens per forward
    stream = torch.from_numpy(np.concatenate([data.load_shard(f, 1024) for f in t.val_files]).astype(np.int64))
    x, y = stream[:16 * 256].view(16, 256), stream[1:16 * 256 + 1].view(16, 256)
    model = train.load_for_eval(tmp_path / "c.pt", "cpu")
    with torch.no_grad():
        nll = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum").item()
    assert n_tokens == 16 * 256 and n_bytes == int(t.bytes.target_bytes(x, y).sum())
    assert loss == pytest.approx(nll / n_tokens, rel=1e-5)
    assert bpb == pytest.approx(nll / (math.log(2) * n_bytes), rel=1e-5)


def test_eval_seq_len_is_in_the_recipe_and_neutral_at_zero(tmp_path):
    flat = flatten(dataclasses.asdict(load_config(SMOKE)))
    assert recipe({**flat, "eval.seq_len": 0}, "d") == recipe(flat, "d")
    assert recipe({**flat, "eval.seq_len": 2048}, "d") != recipe(flat, "d")
    with pytest.raises(ConfigError, match="eval.seq_len"):
        load_config(SMOKE, ["eval.seq_len=-1"])


@pytest.mark.xla
def test_longer_windows_on_xla_compile_one_eval_graph(tmp_path, builtin_1024):
    run(smoke_args(tmp_path, "device.type=xla", "eval.seq_len=256", "budget.max_steps=4"))
    run(smoke_args(tmp_path, "eval.seq_len=256", "budget.max_steps=4"))
    xla, eager = ledger.read(tmp_path / "ledger.csv")
    assert int(xla["xla_compiles"]) == XLA_GRAPHS
    assert float(xla["val_bpb"]) == pytest.approx(float(eager["val_bpb"]), rel=1e-3)
    assert xla["val_tokens"] == eager["val_tokens"] == "4096" and xla["val_bytes"] == eager["val_bytes"]
