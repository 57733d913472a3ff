"""tools/kit_prepare/prepare.py, the kit's prepare.py over an AION data folder (AION_KIT_DATA), and what
tools/lineage_run.py gives a lineage script: tiny shards of the kit's kind (test_kit_data's corpus and tokenizer,
vocab 384), no training; every loop stops by a count. FrontierForge's recipes/K82s4/train.py is never part of this
repository: the test that needs it skips unless AION_LINEAGE_SCRIPT names a copy."""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import kit
import ledger
import train
from config import ConfigError, load_config
from test_kit_data import VOCAB, corpus, reference_rows
from tools import equal_steps, lineage_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "kit_prepare"))
import prepare  # noqa: E402


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """test_kit_data's corpus prepared as its `prepared`: shards and a tokenizer of the kit's kind, vocab 384."""
    folder = tmp_path_factory.mktemp("kit_prepare")
    data.prepare(corpus(), folder, VOCAB, 0.3, progress=False, kind="tiktoken")
    return folder


@pytest.fixture
def kit_data(prepared, monkeypatch):
    """The prepared folder as AION_KIT_DATA, its vocabulary as the kit's -> (folder, tokenizer)."""
    folder = prepared
    monkeypatch.setenv("AION_KIT_DATA", str(folder))
    monkeypatch.setattr(prepare, "TOKENIZER_VOCAB_SIZE", VOCAB)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return folder, prepare.ensure_tokenizer()


def documents(folder, split):
    """The split's documents, each [BOS, ids...], from its shards."""
    bos = data.ByteTable(folder).bos_id
    stream = np.concatenate([data.load_shard(f) for f in data.split_files(folder, split)]).tolist()
    starts = [i for i, t in enumerate(stream) if t == bos] + [len(stream)]
    return [stream[a:b] for a, b in zip(starts, starts[1:])]


def test_the_data_folder_and_budget_errors_name_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("AION_KIT_DATA", raising=False)
    with pytest.raises(data.DataError, match="AION_KIT_DATA is not set") as e:
        prepare.ensure_tokenizer()
    assert "tokenizer.pkl" in str(e.value) and "fineweb_train_*.bin" in str(e.value)
    monkeypatch.setenv("AION_KIT_DATA", str(tmp_path))
    with pytest.raises(data.DataError) as e:
        next(prepare.make_dataloader(None, 1, 8, "train"))
    assert str(e.value).startswith(f"AION_KIT_DATA={tmp_path}: no tokenizer.pkl, token_bytes.pt, fineweb_train_*.bin, "
                                   f"fineweb_val_*.bin; expected")
    for value, seconds in (("", 600.0), ("20", 20.0)):
        monkeypatch.setenv("AION_KIT_SECONDS", value)
        assert prepare._budget_seconds() == seconds
    monkeypatch.setenv("AION_KIT_SECONDS", "ten")
    with pytest.raises(ValueError, match="AION_KIT_SECONDS=ten: expected the training budget in seconds"):
        prepare._budget_seconds()
    assert (prepare.TRAIN_STARTUP_STEPS_EXCLUDED, prepare.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS,
            prepare.TOKENIZER_VOCAB_SIZE) == (5, 900, 8192)


def test_document_batches_give_the_shards_documents_back(kit_data):
    folder, tok = kit_data
    docs = documents(folder, "val")
    batches = prepare._document_batches("val", 0, 1, 4)
    texts, epochs = [], []
    for _ in range(-(-len(docs) // 4) + 1):  # one epoch and the next epoch's first batch
        batch, epoch = next(batches)
        texts += batch
        epochs.append(epoch)
    assert epochs == [1] * (len(epochs) - 1) + [2]
    assert tok.encode(texts[:len(docs)], prepend=tok.get_bos_token_id()) == docs  # ids exactly, BOS first
    assert texts[len(docs):] == texts[:len(texts) - len(docs)]  # the stream repeats
    ranks = [next(prepare._document_batches("val", r, 2, len(docs)))[0] for r in range(2)]
    assert ranks[0] == texts[:len(docs)][0::2] and ranks[1] == texts[:len(docs)][1::2]
    assert tok.encode("<|reserved_0|>") != [tok.get_bos_token_id()]  # special-token text is ordinary text


def test_make_dataloader_packs_the_kits_rows(kit_data, monkeypatch):
    folder, tok = kit_data
    loader = prepare.make_dataloader(tok, 4, 32, "train")
    rows = []
    for i in range(6):
        x, y, state = next(loader)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 32) and state["epoch"] >= 1
        assert torch.equal(x[:, 1:], y[:, :-1]) and (x[:, 0] == tok.get_bos_token_id()).all()
        rows += torch.cat([x, y[:, -1:]], 1).tolist()
    assert rows == reference_rows(documents(folder, "train"), 24, 33, 1000, 128)  # autoresearch's packing, as written
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    x, y, _ = next(prepare.make_dataloader(tok, 2, 32, "train"))
    assert torch.cat([x, y[:, -1:]], 1).tolist() == rows[2:4]  # rank 1 of 2: the second half of the world's rows
    with pytest.raises(ValueError, match="packs from 1000 documents"):
        next(prepare.make_dataloader(tok, 2, 32, "train", buffer_size=64))


class Bigram(nn.Module):
    """forward(idx) -> logits [B, T, V]; causal by construction. mix > 0 leaks the row's mean (not causal)."""

    def __init__(self, mix=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.mix = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB), mix

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + self.mix * h.mean(1, keepdim=True))


def test_evaluate_bpb_is_the_kits(kit_data):
    folder, tok = kit_data
    model, tokens = Bigram(), 3 * 2 * 32
    got = prepare.evaluate_bpb(model, tok, 2, 32, "cpu", split="public_val", max_tokens=tokens)
    backend = prepare._backend("cpu")
    assert backend.sum_dtype == torch.float64
    batches = data.packed_val_batches(data.split_files(folder, "val"), 32, 2, VOCAB, tok.get_bos_token_id(), tokens)
    bpb, nats, n_bytes, scored = kit.evaluate_bpb(model, batches, data.kit_token_bytes(folder), backend)
    assert (got["val_bpb"], got["nats"], got["bytes"], got["tokens"]) == (bpb, nats, n_bytes, scored)
    assert prepare.evaluate_bpb(model, tok, 2, 32, "cpu", split="val", max_tokens=tokens)["val_bpb"] == bpb
    by_hand, table = [0.0, 0], torch.load(folder / "token_bytes.pt").long()  # independently: 0-byte targets left out
    with torch.no_grad():
        for x, y in data.packed_val_batches(data.split_files(folder, "val"), 32, 2, VOCAB, tok.get_bos_token_id(),
                                            tokens):
            nll = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").double()
            by_hand[0] += float((nll * (table[y.flatten()] > 0)).sum())
            by_hand[1] += int(table[y].sum())
    assert bpb == pytest.approx(by_hand[0] / (math.log(2) * by_hand[1]), rel=1e-6)
    with pytest.raises(TimeoutError, match="EVAL_TIMEOUT_SECONDS"):
        prepare.evaluate_bpb(model, tok, 2, 32, "cpu", max_tokens=tokens, timeout_seconds=-1)


def test_causality_check(kit_data):
    _, tok = kit_data
    assert prepare.causality_check(Bigram(), tok, 2, 32, "cpu") == {"passed": True, "max_abs_diff": 0.0}
    leaky = prepare.causality_check(Bigram(mix=0.5), tok, 2, 32, "cpu")
    assert not leaky["passed"] and leaky["max_abs_diff"] > 1e-3


def test_step_boundaries_and_the_kits_clock(tmp_path, monkeypatch):
    log = tmp_path / "steps.log"
    monkeypatch.delenv("AION_KIT_STEP_LOG", raising=False)
    prepare.record_step_boundary(0)  # nowhere to write: nothing happens
    monkeypatch.setenv("AION_KIT_STEP_LOG", str(log))
    prepare.record_step_boundary(0)
    step, t = log.read_text().split()
    assert step == "0" and float(t) == pytest.approx(time.monotonic(), abs=60)
    log.write_text("".join(f"{i} {t}\n" for i, t in enumerate([0, 10, 11, 12, 13, 14, 15, 16, 18, 20])))
    assert lineage_run.step_clock(log) == dict(steps=10, train_s=7.0, step_ms_p50=1000.0)  # from the end of step 5
    assert lineage_run.step_clock(tmp_path / "none.log") == {}


LINEAGE = ROOT / "configs" / "cpu_lineage.yaml"  # the lineage's recipe: the script's width (96) and rows (1,024)
ONE_STAGE = "schedule.stages=[{at: 0}]"  # cpu.yaml's batch ramp, in AION's keys, needs micro-batches of 8 rows


def test_the_scripts_settings_for_cpu_lineage_yaml(tmp_path, capsys):
    cfg = load_config(LINEAGE)
    assert lineage_run.script_settings(cfg, 600, 73) == dict(
        FF_DEPTH="4", FF_ASPECT_RATIO="24", FF_HEAD_DIM="48", FF_KV_HEADS="1", FF_MB="8", FF_TOTAL_BATCH="8192",
        FF_SEED="73", FF_TIME_TARGET="595", FF_ATTN_SRC="2:3", FF_MUON_ZERO="0", FF_MUON_ZERO2="0", FF_ADAMW_ZERO="0",
        FF_ACCUM_SCHED="1", FF_ACCUM_LR="1")  # one micro-batch a step: no batch ramp
    ramp = lineage_run.script_settings(load_config(LINEAGE, ["optim.micro_batch=2", ONE_STAGE]), 20, 1)
    assert "FF_ACCUM_SCHED" not in ramp and ramp["FF_STREAM_MIX"] == "2" and ramp["FF_TIME_TARGET"] == "15"
    for overrides, message in ((["data.seq_len=512"], "rows of 1024"), (["model.n_layer=5", "model.n_head=4"],
                                                                       "model.n_embd=96: the script's width")):
        with pytest.raises(ConfigError, match=message):
            lineage_run.script_settings(load_config(LINEAGE, overrides), 600, 73)
    assert lineage_run.main(["--script", str(tmp_path / "train.py")]) == 2
    assert f"--script {tmp_path / 'train.py'}: no such file" in capsys.readouterr().err


SCRIPT = os.environ.get("AION_LINEAGE_SCRIPT", "")


@pytest.mark.skipif(not Path(SCRIPT).is_file(), reason="set AION_LINEAGE_SCRIPT to a copy of FrontierForge's "
                    "recipes/K82s4/train.py (github marker2601/trainium-simulator): it is never in this repository")
def test_the_scripts_checkpoint_scores_on_longer_windows(kit_data, tmp_path, monkeypatch):
    """Its model built and saved by its own code (no training), loaded by lineage_run through its load_for_eval: the
    kit's contract holds, and windows longer than its rows score their first positions as it would."""
    cfg = load_config(LINEAGE, ["model.n_layer=2", "model.n_embd=64", "optim.micro_batch=2",
                                                      ONE_STAGE, "model.attn_source_after=-1",
                                                      "model.attn_source_layers=[]"])
    env = lineage_run.script_settings(cfg, 20, 73)
    for name, value in env.items():  # restored after the test: load_model sets them in this process
        monkeypatch.setenv(name, value)
    short = lineage_run.load_model(Path(SCRIPT), env, save_untrained(Path(SCRIPT), tmp_path / "final.pt"), 0)
    model = lineage_run.load_model(Path(SCRIPT), env, tmp_path / "final.pt", 2 * 1024)
    assert model.config.sequence_len == 2048 and not model.training
    idx = torch.randint(0, VOCAB, (1, 2048), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[:, :1024], short(idx[:, :1024]), rtol=1e-5, atol=1e-5)
    assert prepare.causality_check(model, kit_data[1], 1, 2048, "cpu")["passed"]


def save_untrained(script: Path, path: Path) -> Path:
    module = lineage_run.import_script(script)
    config = module.build_config()
    config.bos_id = prepare.ensure_tokenizer().get_bos_token_id()
    model = module.GPT(config)
    model.init_weights()
    torch.manual_seed(1)
    with torch.no_grad():  # its zero-initialised projections would hide the positions
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    module.save_checkpoint(path, model, {})
    return path


STAND_IN = """import os, torch, prepare
def compute_dtype_for(device):
    \"\"\"The script's own choice off CUDA and Neuron.\"\"\"
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float32
print('saw', os.environ['FF_DEPTH'], os.environ['OMP_NUM_THREADS'], prepare.TRAIN_TIME_BUDGET_SECONDS,
      prepare.ensure_tokenizer().get_vocab_size(), compute_dtype_for(torch.device('cpu')))
print('inductor cache', os.environ['TORCHINDUCTOR_CACHE_DIR'])
raise SystemExit(int(os.environ['EXIT']))
"""


def test_a_failed_run_is_named_and_recorded(tmp_path, monkeypatch, capsys):
    """A stand-in script: it sees the shim and its settings, computes in the dtype train.py would here, on train.py's
    threads, then fails (exit 3) or exits 0 without a checkpoint."""
    script = tmp_path / "K0" / "train.py"
    script.parent.mkdir()
    script.write_text(STAND_IN)
    args = ["--script", str(script), "--seconds", "20", f"data.path={ROOT / 'data' / 'builtin'}",
            f"ledger.path={tmp_path / 'ledger.csv'}", f"run.out_dir={tmp_path / 'runs'}"]
    monkeypatch.setenv("EXIT", "3")
    threads, dtype = torch.get_num_threads(), train.compute_dtype(load_config(LINEAGE).device, "cpu", False)
    assert lineage_run.main(args) == 1
    assert torch.get_num_threads() == threads  # --threads is the script's: this process (pytest's) keeps its own
    out, err = capsys.readouterr()
    assert f"saw 4 {threads} 20.0 8192 {dtype}" in out and "error: the script exited with code 3; its last lines:\nsaw 4" in err
    assert re.search(rf"inductor cache .*{os.sep}threads-{threads}\n", out)  # its compiled kernels' thread count
    assert lineage_run.main(args + ["--dtype", "script", "--threads", "1"]) == 1
    out = capsys.readouterr().out
    assert "saw 4 1 20.0 8192 torch.float32" in out and re.search(rf"inductor cache .*{os.sep}threads-1\n", out)
    monkeypatch.setenv("EXIT", "0")
    assert lineage_run.main(args) == 1
    assert "final.pt: the script exited 0 but saved no checkpoint" in capsys.readouterr().err
    rows = ledger.read(tmp_path / "ledger.csv")
    assert [(r["config"], r["status"], r["seed"]) for r in rows] == [("lineage:K0", "failed", "73")] * 3
    assert f"dtype={str(dtype)[6:]} threads={threads}" in rows[0]["notes"] and "--dtype aion" in rows[0]["overrides"]
    assert "dtype=its own (compute_dtype_for) threads=1" in rows[1]["notes"] and "unchanged" in rows[1]["notes"]
    assert rows[0]["recipe"] != rows[1]["recipe"] and rows[0]["clock"] == "wall"
    assert "the script exited with code 3" in rows[0]["notes"] and rows[0]["val_bpb"] == ""


def test_the_dtype_is_set_by_replacing_the_functions_body_alone(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STAND_IN)
    source = lineage_run.with_dtype(script, "bfloat16")
    assert source.splitlines() == (STAND_IN.splitlines()[:2] + ["    return torch.bfloat16  # tools/lineage_run.py --dtype"]
                                   + STAND_IN.splitlines()[6:])  # its docstring and body replaced, nothing else
    script.write_text("import torch\ndtype = torch.float32\n")
    with pytest.raises(ConfigError, match="has no top-level compute_dtype_for"):
        lineage_run.with_dtype(script, "bfloat16")


def test_the_virtual_clock_charges_each_step_after_the_startup(tmp_path):
    """A stand-in for the script's loop (K82s4: its charged clock restarts at the end of the 5th step and reads
    time.monotonic() after record_step_boundary): under AION_KIT_STEP_SECONDS every step reads 0.25 s, the startup's
    too, whatever the steps took; the script's time keeps the rest of the time module; the shim's own is real."""
    script = tmp_path / "loop.py"
    script.write_text("import time\n"
                      "import prepare\n"
                      "from prepare import record_step_boundary\n"
                      "assert time.sleep is prepare.time.sleep and prepare.time.monotonic is not time.monotonic\n"
                      "budget_started = time.monotonic()\n"
                      "for step in range(9):\n"
                      "    time.sleep(0.01)\n"
                      "    record_step_boundary(step)\n"
                      "    if step + 1 == 5:\n"
                      "        budget_started = time.monotonic()\n"
                      "    print(step, time.monotonic() - budget_started)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools" / "kit_prepare"), AION_KIT_STEP_SECONDS="0.25",
               AION_KIT_STEP_LOG=str(tmp_path / "steps.log"))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True).stdout
    charged = [float(line.split()[1]) for line in out.splitlines()]
    assert charged == [0.25, 0.5, 0.75, 1.0, 0.0, 0.25, 0.5, 0.75, 1.0]
    real = [float(line.split()[1]) for line in (tmp_path / "steps.log").read_text().splitlines()]
    assert len(real) == 9 and all(b - a >= 0.01 for a, b in zip(real, real[1:]))  # steps.log keeps the real seconds
    for bad in ("0", "-1", "nan", "x"):
        env["AION_KIT_STEP_SECONDS"] = bad
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
        assert run.returncode == 1 and f"AION_KIT_STEP_SECONDS={bad}: expected the charged seconds of one step" in run.stderr
    env["AION_KIT_STEP_SECONDS"] = "0.25"  # a script without `time` would run on the real clock: refused
    script.write_text("import prepare\n")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "has no `time` module yet to charge by steps" in run.stderr


def test_equal_steps_need_a_clock_made_elsewhere_and_steps(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(STAND_IN)
    clock_file = tmp_path / "eq.json"
    assert equal_steps.main(["40", "--seconds", "60", "--out", str(clock_file)]) == 0
    doc = json.loads(clock_file.read_text())
    assert doc["step_ms"] == {"*": 1000 * (55 - 5) / 37} and doc["id"] == equal_steps.equal_steps(40, 60)["id"]
    assert "budget.seconds=55 budget.max_steps=40" in capsys.readouterr().out
    base = ["--script", str(script), f"ledger.path={tmp_path / 'ledger.csv'}", f"run.out_dir={tmp_path / 'runs'}"]
    assert lineage_run.main(base + ["--clock", str(clock_file)]) == 2
    assert "equal steps need both" in capsys.readouterr().err
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(dict(version=1, id="x", machine="m", baseline="k", stages={
        "k": dict(name="a/0", step_ms=1.0, ratio=1.0, se=0.0, round_ms=[1.0])})))  # measured on a machine
    assert lineage_run.main(base + ["--clock", str(measured), "--steps", "40"]) == 2
    assert "expected a calibration made elsewhere with one cost for every step" in capsys.readouterr().err
    assert equal_steps.main(["8", "--out", str(clock_file)]) == 2
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.csv").exists()


ROWS_STAND_IN = """import os, torch
STREAM_MIX, DEVICE_BATCH_SIZE, TRAIN_SEQ = int(os.environ["FF_STREAM_MIX"]), int(os.environ["FF_MB"]), 1024
def compute_dtype_for(device):
    return torch.float32
class Tokenizer:
    def get_bos_token_id(self):
        return 5
def ensure_tokenizer():
    return Tokenizer()
def make_train_stream_loader(tokenizer, batch, seq, device, world):
    step = 0
    while True:
        rows = (torch.arange(batch * (seq + 1)).view(batch, seq + 1) + 1000 * step + int(os.environ["FF_SEED"])) % 8192
        y = rows[:, 1:].clone()
        y[0, -1] = -1  # a masked BOS target
        yield rows[:, :-1].int(), y, None
        step += 1
"""


def test_rows_only_writes_the_rows_of_the_steps_without_a_run(tmp_path, monkeypatch, capsys):
    """A stand-in for the script's training loader: --rows-only writes the rows of --steps full batches (the
    micro-batches' rows in order, each its inputs and last target, a masked BOS target BOS again), trains nothing,
    appends no row; it needs --steps."""
    script = tmp_path / "train.py"
    script.write_text(ROWS_STAND_IN)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # record_rows sets the FF_* variables in this process
    out = tmp_path / "rows" / "rows.bin"
    base = ["--script", str(script), "--seed", "9", "optim.micro_batch=2", "schedule.stages=[]",
            f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}"]
    assert lineage_run.main(base + ["--rows-only", str(out)]) == 2
    assert f"--rows-only {out}: expected --steps N" in capsys.readouterr().err
    assert lineage_run.main(base + ["--rows-only", str(out), "--steps", "3"]) == 0
    rows = data.load_shard(out).reshape(-1, 1025)
    assert rows.shape == (3 * 8192 // 1024, 1025)  # 3 steps of 8,192 tokens: 12 micro-batches of 2 rows
    expected = (np.arange(2 * 1025).reshape(2, 1025)[None] + 1000 * np.arange(12)[:, None, None] + 9) % 8192
    expected[:, 0, -1] = 5
    assert np.array_equal(rows, expected.reshape(-1, 1025))
    assert not (tmp_path / "ledger.csv").exists() and not (tmp_path / "runs").exists()
    script.write_text(ROWS_STAND_IN.replace('int(os.environ["FF_STREAM_MIX"])', "0"))  # its rows off the streams
    assert lineage_run.main(base + ["--rows-only", str(out), "--steps", "3"]) == 2
    assert "trains on its stream rows only with FF_STREAM_MIX > 0" in capsys.readouterr().err
