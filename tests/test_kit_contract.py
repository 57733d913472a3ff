"""The competition kit's contract, as its scorer uses AION (kit.py, train.load_for_eval): train.py imported by its
file path from another folder yields a working load_for_eval and runs nothing; the model it returns, for every model
feature, is in eval mode, hook-free, on one device, and its logits depend on nothing but each sequence's own tokens
up to each position; a 2-rank checkpoint scores as the 1-rank one. The kit's val_bpb against an independent
computation, and the kit's task end to end (parquet shards, its tokenizer, packed rows, its charged clock, the
ledger's kit_val_bpb), with every bad input named before training (exit 2)."""
import dataclasses
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch

import clock
import config
import data
import kit
import ledger
import train
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def smoke(tmp_path, *extra):
    return [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", "run.profile_steps=0", *extra]


def trained(tmp_path, *overrides, steps=4) -> Path:
    """A smoke run of `steps` steps with the overrides -> its checkpoint."""
    cfg = load_config(SMOKE, smoke(tmp_path, f"budget.max_steps={steps}", *overrides))
    trainer = train.Trainer(cfg)
    trainer.train()
    return trainer.checkpoint_path


# Every model feature load_for_eval must rebuild: routing at each granularity, loops (gated, routed), annealing
# stages, the EMA, the record items (switching stages by tokens: 512 tokens per smoke step), the lineage's model
# levers, and its training-loss levers (its forward without them) with its EMA blend.
LOOP = "schedule.stages=[{at: 0}, {at: '1024 tokens', recur: 2, recur_span: [0, 1]}]"
FEATURES = {
    "dense": (),
    "block": ("mod.granularity=block", "mod.layers=[1]", "mod.block_size=16"),
    "token": ("mod.granularity=token", "mod.layers=[1]"),
    "layer": ("mod.granularity=layer", "mod.layers=[1]"),
    "microbatch": ("mod.granularity=microbatch", "mod.layers=[1]"),
    "loop": (LOOP, "schedule.recur_gate=true"),
    "mor": (LOOP, "mod.granularity=token", "mod.recur=true", "mod.capacity=0.5"),
    "anneal": ("schedule.stages=[{at: 0, depth: 1, seq_len: 32}, {at: '1024 tokens', depth: 2, seq_len: 64}]",
               "schedule.grow_init=copy"),
    "ema": ("optim.ema=0.9",),
    "items": ("model.value_embed=true", "model.x0_shortcut=true", "model.bigram_buckets=64", "model.smear_gate=true",
              "model.attn_gate=sparse", "model.rope_fraction=0.5", "model.ln_scale=true", "model.xsa_layers=1",
              "model.mlp=leaky_relu2"),
    "unet": ("model.unet=true", "model.skip_gates=true", "model.parallel_layers=1"),
    "lanes": ("model.parallel_layers=2", "model.parallel_lanes=2", "model.mlp=swiglu"),
    "doc_mask": ("model.doc_mask=true",),
    "lineage": ("model.mlp=leaky_relu2", "model.leaky_slope=0.35", "model.qk_gain_learned=false",
                "model.qk_gain_init=1.44", "model.key_offset=0.3", "model.attn_source_after=0",
                "model.attn_source_layers=[1]", "model.value_embed=true", "model.x0_shortcut=true"),
    "lineage_loss": ("optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.45,0.2]", "optim.mask_bos_targets=true",
                     "optim.ema=0.9", "optim.ema_every=2", "optim.ema_blend=0.6", "optim.ema_prewarm=true"),
}


def check_contract(model, vocab_size: int, seq_len=96):
    """The kit's contract on load_for_eval's model; seq_len longer than the training rows (64)."""
    assert not model.training and not any(m.training for m in model.modules())
    for m in model.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("cpu")}
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab_size, (8, seq_len), generator=g)
    with torch.no_grad():
        logits = model(idx)
        assert logits.shape == (8, seq_len, vocab_size)
        for i in (0, 5):  # batch size 1 against 8
            torch.testing.assert_close(model(idx[i:i + 1])[0], logits[i], rtol=1e-5, atol=1e-5)
        others = torch.cat([idx[:1], torch.randint(0, vocab_size, (7, seq_len), generator=g)])
        torch.testing.assert_close(model(others)[0], logits[0], rtol=1e-5, atol=1e-5)  # other sequences in the batch
        for t in (0, 31, seq_len - 2):  # changing the tokens after t changes no logit at or before t
            later = idx.clone()
            later[:, t + 1:] = torch.randint(0, vocab_size, (8, seq_len - t - 1), generator=g)
            torch.testing.assert_close(model(later)[:, :t + 1], logits[:, :t + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature", FEATURES)
def test_load_for_eval_keeps_the_contract(tmp_path, builtin_1024, feature):
    checkpoint = trained(tmp_path, *FEATURES[feature])
    model = train.load_for_eval(checkpoint, "cpu")
    check_contract(model, 1024)


def test_train_py_imported_by_its_path_from_elsewhere(tmp_path, builtin_1024):
    """As the kit's scorer (`prepare.py eval-public --train-py PATH`) imports a submission: by file path, from another
    folder, nothing of AION on sys.path; importing runs nothing (no output, no file written)."""
    checkpoint = trained(tmp_path, steps=2)
    elsewhere = tmp_path / "scorer"
    elsewhere.mkdir()
    script = (
        "import importlib.util, sys, torch\n"
        f"assert not any(p and {str(ROOT)!r} == p for p in sys.path)\n"
        f"spec = importlib.util.spec_from_file_location('submission', {str(ROOT / 'train.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"model = module.load_for_eval({str(checkpoint)!r}, 'cpu')\n"
        "logits = model(torch.zeros(1, 8, dtype=torch.long))\n"
        "sys.stderr.write(f'logits {tuple(logits.shape)}')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr.endswith("logits (1, 8, 1024)")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_a_two_rank_checkpoint_scores_as_the_one_rank_one(tmp_path, builtin_1024):
    """Same global batch: 1 process x 2 micro-batches against 2 gloo ranks x 1; rank 0's checkpoint, loaded on one
    device, gives the 1-rank run's logits (to the reduction order of the gradient all-reduce)."""
    args = ["--config", str(SMOKE), *smoke(tmp_path, "budget.max_steps=4")]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    for launcher in ([], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]):
        out = subprocess.run([sys.executable, *launcher, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    one, two = ledger.read(tmp_path / "ledger.csv")
    assert (one["world_size"], two["world_size"]) == ("1", "2")
    models = [train.load_for_eval(tmp_path / "runs" / row["run_id"] / "checkpoint.pt", "cpu") for row in (one, two)]
    check_contract(models[1], 1024)
    idx = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(models[1](idx), models[0](idx), rtol=1e-4, atol=1e-4)


# -- the kit's task on parquet shards made here ------------------------------------------------------------------

VOCAB = 320


WORDS = ["".join(np.random.default_rng(i).choice(list("abcdefghijklmnopqrstuvwxyzäü数据"), size=2 + i % 7))
         for i in range(400)] + ["\n"]


def documents(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 120)))) for _ in range(n)]


@pytest.fixture(scope="module")
def kit_task(tmp_path_factory):
    """A kit-format task: shard_00000..2.parquet (the last the validation shard: 60 documents, 16,484 tokens, so that
    scoring all of it stays a small part of a run) and a tokenizer folder trained on the training shards."""
    root = tmp_path_factory.mktemp("kit")
    (root / "data").mkdir()
    for i, n in enumerate((300, 300, 60)):
        pq.write_table(pa.table({"text": documents(n, i)}), root / "data" / f"shard_{i:05d}.parquet")
    data.train_tiktoken(documents(300, 0) + documents(300, 1), root / "tokenizer", VOCAB)
    return root


def kit_args(tmp_path, task, *extra):
    return ["data.source=parquet", f"data.path={task / 'data'}", f"data.tokenizer={task / 'tokenizer'}",
            "data.tokenizer_kind=tiktoken", f"model.vocab_size={VOCAB}", "data.order=packed", "eval.kit_seq_len=128",
            "eval.kit_tokens=4096", "eval.tokens=0", *smoke(tmp_path, *extra)[1:]]


def test_the_kit_task_trains_to_a_row_with_both_val_bpb_figures(tmp_path, kit_task):
    assert train.main(["--config", str(SMOKE), *kit_args(tmp_path, kit_task, "budget.max_steps=6")]) == 0
    row, = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "ok" and 0 < float(row["val_bpb"]) < 20 and 0 < float(row["kit_val_bpb"]) < 20
    checkpoint = tmp_path / "runs" / row["run_id"] / "checkpoint.pt"
    model = train.load_for_eval(checkpoint, "cpu")
    check_contract(model, VOCAB, seq_len=128)
    # The kit's figure is the kit's formula over the same rows, computed here independently, token by token.
    cfg = load_config(SMOKE, kit_args(tmp_path, kit_task))
    files = data.open_data("parquet", cfg.data.path, cfg.data.tokenizer, VOCAB, 0.5, "tiktoken")[1]
    table = data.kit_token_bytes(kit_task / "tokenizer").tolist()
    bos = data.ByteTable(kit_task / "tokenizer").bos_id
    rows = max(1, cfg.eval.batch_size * cfg.data.seq_len // 128)
    nats = n_bytes = 0.0
    with torch.no_grad():
        for x, y in data.packed_val_batches(files, 128, rows, VOCAB, bos, 4096):
            logp = torch.log_softmax(model(x).double(), -1)
            for b in range(x.size(0)):
                for t in range(x.size(1)):
                    target = int(y[b, t])
                    if table[target] > 0:
                        nats -= float(logp[b, t, target])
                        n_bytes += table[target]
    assert float(row["kit_val_bpb"]) == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def bad_task(task, tmp_path, problem):
    """A copy of the task with one thing wrong -> extra overrides."""
    folder, tokenizer = tmp_path / "bad", tmp_path / "badtok"
    folder.mkdir()
    tokenizer.mkdir()
    for name in ("tokenizer.pkl", "token_bytes.pt"):
        (tokenizer / name).write_bytes((task / "tokenizer" / name).read_bytes())
    for f in sorted((task / "data").glob("*.parquet")):
        (folder / f.name).write_bytes(f.read_bytes())
    if problem == "no text column":
        pq.write_table(pa.table({"content": ["a", "b"]}), folder / "shard_00001.parquet")
    elif problem == "no validation shard":
        for f in sorted(folder.glob("*.parquet"))[1:]:
            f.unlink()
    elif problem == "tokenizer size":
        return [f"data.path={folder}", f"data.tokenizer={tokenizer}", f"model.vocab_size={VOCAB + 1}"]
    elif problem == "token_bytes length":
        torch.save(torch.zeros(VOCAB - 3, dtype=torch.int32), tokenizer / "token_bytes.pt")
    elif problem == "pickle runs code":
        (tokenizer / "tokenizer.pkl").write_bytes(pickle.dumps(RunsCode()))
    elif problem == "pickle of a list":
        (tokenizer / "tokenizer.pkl").write_bytes(pickle.dumps([1, 2, 3]))
    elif problem == "pickle without a state":  # protocol 0's copyreg._reconstructor(Encoding, object, None), no BUILD
        (tokenizer / "tokenizer.pkl").write_bytes(b"ccopy_reg\n_reconstructor\n(ctiktoken.core\nEncoding\n"
                                                  b"c__builtin__\nobject\nNtR.")
    elif problem == "empty validation shard":
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "shard_00002.parquet")
    return [f"data.path={folder}", f"data.tokenizer={tokenizer}"]


@pytest.mark.parametrize("problem,message", [
    ("no text column", r"shard_00001.parquet.*text"),
    ("no validation shard", r"parquet"),
    ("tokenizer size", rf"{VOCAB} tokens.*{VOCAB + 1}"),
    ("token_bytes length", r"token_bytes.pt"),
    ("pickle runs code", r"tokenizer.pkl.*system"),
    ("pickle of a list", r"tokenizer.pkl"),
    ("pickle without a state", r"badtok/tokenizer.pkl: an Encoding pickled without its state"),
    ("empty validation shard", r"bad/shard_00002.parquet: the validation shard has 0 rows; expected"),
])
def test_bad_kit_input_is_named_before_training(tmp_path, kit_task, capsys, problem, message):
    args = [*kit_args(tmp_path, kit_task, "budget.max_steps=2"), *bad_task(kit_task, tmp_path, problem)]
    assert train.main(["--config", str(SMOKE), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err) and "Traceback" not in err, err
    assert not (tmp_path / "ledger.csv").exists() and not list((tmp_path / "bad").rglob("meta.json"))


@pytest.mark.parametrize("overrides, message", [
    (["data.path="], re.escape("data.path: expected a folder (not empty)")),
    ([], re.escape("data.path: data.source=parquet reads the kit's shard_*.parquet files from it, but it is left at "
                   "base.yaml's 'data/builtin' (the built-in corpus's cache); expected their folder")),  # no data.path
    (["eval.seq_len=1000000000"], r"eval\.seq_len=1000000000: a validation window is 1000000000 \+ 1 tokens, the "
                                  r"validation split \(\S+/fineweb_val_000000\.bin\) holds \d+; expected eval\.seq_len < "),
])
def test_a_bad_data_key_is_named_before_training(tmp_path, kit_task, capsys, overrides, message):
    args = [a for a in kit_args(tmp_path, kit_task, "budget.max_steps=2") if not a.startswith("data.path=")]
    path = [] if overrides == [] else [f"data.path={kit_task / 'data'}"]
    assert train.main(["--config", str(SMOKE), *args, *path, *overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(f"^error: {message}", err, re.M) and "Traceback" not in err, err
    assert not (tmp_path / "ledger.csv").exists()


def test_packed_rows_need_a_bos_token(tmp_path, kit_task, capsys):
    """A tiktoken folder without <|reserved_0|>: data.order=packed cannot start rows with BOS."""
    enc = data.load_tiktoken(kit_task / "tokenizer", VOCAB)
    plain = tiktoken.Encoding(name="plain", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                              special_tokens={})
    folder = tmp_path / "nobos"
    folder.mkdir()
    (folder / "tokenizer.pkl").write_bytes(pickle.dumps(plain))
    torch.save(torch.ones(plain.n_vocab, dtype=torch.int32), folder / "token_bytes.pt")
    args = [*kit_args(tmp_path, kit_task, "budget.max_steps=2"), f"data.tokenizer={folder}",
            f"model.vocab_size={plain.n_vocab}"]
    assert train.main(["--config", str(SMOKE), *args]) == 2
    assert "BOS" in capsys.readouterr().err


def test_a_launch_the_kit_does_not_score_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert train.main(["--config", str(SMOKE), *smoke(tmp_path), "device.type=neuron", "budget.charge=kit"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2 at NEURON_LOGICAL_NC_CONFIG=2" in err and "8 processes at NEURON_LOGICAL_NC_CONFIG=1" in err
    for lnc, world in kit.LAUNCH_SHAPES.items():
        kit.check_launch(world, str(lnc))  # the two whole-chip shapes pass


def calibrated(tmp_path, args) -> list:
    """args plus the calibrated clock with a hand-written calibration of their one stage (250 ms a step)."""
    path = tmp_path / "calibration.json"
    args = [*args, "budget.clock=calibrated", f"budget.calibration={path}"]
    cfg = load_config(SMOKE, args)
    key = clock.stage_key(config.flatten(dataclasses.asdict(cfg)), train.open_data(cfg)[3], config.resolve_stages(cfg)[0])
    stage = dict(name="kit/0", config=str(SMOKE), overrides=[], dtype="float32", step_ms=250.0, ratio=1.0, se=0.0,
                 round_ms=[250.0])
    clock.write(path, dict(version=clock.VERSION, id="c0ffee000002", machine=clock.machine(), date="-", method={},
                           baseline=key, stages={key: stage}))
    return args


def test_the_kit_clock_frees_the_startup_steps(tmp_path, kit_task):
    """budget.charge=kit under the calibrated clock: the first startup_steps steps cost nothing, each later one its
    stage's cost, compile included (AION's charge frees the first step and the profiled ones instead)."""
    args = calibrated(tmp_path, kit_args(tmp_path, kit_task, "budget.max_steps=9", "budget.charge=kit",
                                         "budget.startup_steps=5"))
    assert train.main(["--config", str(SMOKE), *args]) == 0
    row, = ledger.read(tmp_path / "ledger.csv")
    assert float(row["train_s"]) == pytest.approx((9 - 5) * 0.25)


@pytest.mark.parametrize("cap,charged", [(900, False), (0, True)])
def test_the_kit_clock_charges_a_startup_past_its_cap(tmp_path, kit_task, cap, charged):
    """On the wall clock: a run of exactly startup_steps steps is free while its startup stays under the cap; with
    a cap of 0 its whole startup (from the trainer's start) is charged."""
    args = kit_args(tmp_path, kit_task, "budget.max_steps=5", "budget.charge=kit", f"budget.startup_cap_s={cap}")
    assert train.main(["--config", str(SMOKE), *args]) == 0
    row, = ledger.read(tmp_path / "ledger.csv")
    assert (float(row["train_s"]) > 0) == charged


def test_a_packed_run_resumed_is_the_uninterrupted_run_to_the_bit(tmp_path, kit_task):
    """The packed loader's state (buffer and stream position) in the checkpoint: 3 steps, a resume to 6, against 6."""
    whole = calibrated(tmp_path, kit_args(tmp_path, kit_task, "budget.max_steps=6", "data.prefetch=2"))
    train.main(["--config", str(SMOKE), *whole, f"checkpoint.path={tmp_path / 'whole.pt'}"])
    train.main(["--config", str(SMOKE), *whole, "budget.max_steps=3", f"checkpoint.path={tmp_path / 'half.pt'}"])
    train.main(["--config", str(SMOKE), *whole, f"checkpoint.resume={tmp_path / 'half.pt'}",
                f"checkpoint.path={tmp_path / 'resumed.pt'}"])
    a, b = (train.load_checkpoint(tmp_path / name) for name in ("whole.pt", "resumed.pt"))
    assert a["step"] == b["step"] == 6 and a["loader"] == b["loader"] and a["loader"]["order"] == "packed"
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
