"""train.py: config validation, optimizer grouping, LR schedule, checkpoints, the scorer entry
point, signals, and an end-to-end smoke run into a temporary ledger."""
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ledger
import optim
import train
from train import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("model.n_layers=3", "unknown key model.n_layers; did you mean model.n_layer?"),
    ("modle.n_layer=3", "unknown key modle; did you mean model?"),
    ("model.n_layer=abc", "model.n_layer: expected int, got 'abc'"),
    ("model.n_layer=0", "model.n_layer: expected > 0, got 0"),
    ("optim.warmdown=1.5", "optim.warmdown: expected in [0, 1], got 1.5"),
    ("device.type=tpu", "device.type: expected one of auto | cpu | cuda | xla | neuron, got 'tpu'"),
    ("model.tie_embeddings=3", "model.tie_embeddings: expected bool, got 3"),
    ("optim.micro_batch=3", "optim.batch_tokens (512) must be a multiple of optim.micro_batch * data.seq_len (3 * 64)"),
    ("model.n_kv_head=3", "n_kv_head (3) must divide n_head"),
    ("model", "override 'model': expected key.sub=value"),
    ("eval.tokens=10", "eval.tokens (10) must be 0 (all) or at least data.seq_len (64)"),
    ("eval.seq_len=128 eval.tokens=100", "eval.tokens (100) must be 0 (all) or at least eval.seq_len (128)"),
    ("eval.seq_len=128 eval.every_seconds=10 eval.curve_tokens=100",
     "eval.curve_tokens (100) must be at least eval.seq_len (128) when eval.every_seconds is set"),
    ("data.tokenizer_kind=tiktoken eval.kit_tokens=100", "eval.kit_tokens (100) must be 0 (off) or at least one batch "
                                                         "of the kit's rows, 1 x eval.kit_seq_len (2048) = 2048"),
    ("data.path=", "data.path: expected a folder (not empty)"),
    ("data.source=shards data.tokenizer=sp.model", "data.path: data.source=shards reads fineweb_{train,val}_*.bin "
                                                   "shards from it, but it is left at base.yaml's 'data/builtin'"),
    ("model.n_layer.x=1", "model.n_layer: expected int, got {'x': 1}"),
    ("mod.granularity=tiles", "mod.granularity: expected one of none | block | token | layer | microbatch, got 'tiles'"),
    ("mod.capacity=0", "mod.capacity: expected in (0, 1], got 0.0"),
    ("mod.layers=[1,x]", "mod.layers: expected a list of integers, got (1, 'x')"),
    ("mod.granularity=block mod.layers=[]", "mod.layers: expected distinct layer indices in [0, 2) (model.n_layer), got []"),
    ("mod.granularity=layer mod.layers=[1,2]", "mod.layers: expected distinct layer indices in [0, 2)"),
    ("mod.granularity=block mod.layers=[1] mod.block_size=48",
     "data.seq_len (64) must be a multiple of mod.block_size (48)"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, override.split())
    assert message in str(e.value)


def test_config_inheritance_and_overrides(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {SMOKE}\nmodel: {{n_layer: 3}}\noptim: {{muon_lr: 3e-4}}\n")
    cfg = load_config(child, ["model.n_embd=128", "model.n_embd=96"])
    assert cfg.model.n_layer == 3  # child over smoke
    assert cfg.model.n_embd == 96  # later override wins
    assert cfg.optim.muon_lr == 3e-4  # YAML 1.1 reads 3e-4 as a string; coerced to float
    assert cfg.run.name == "smoke"  # from smoke.yaml
    assert cfg.optim.beta2 == load_config(ROOT / "configs" / "base.yaml").optim.beta2  # root default


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(loop)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)


def test_cli_reports_config_error_before_any_work(capsys):
    assert train.main(["--config", str(SMOKE), "model.n_layers=3"]) == 2
    assert "did you mean model.n_layer?" in capsys.readouterr().err


def test_tokenizer_vocab_must_match_the_model(tmp_path, builtin_1024, capsys):
    shards = Path(builtin_1024["tokenizer"]).parent
    args = smoke_overrides(tmp_path, "data.source=shards", f"data.path={shards}",
                           f"data.tokenizer={builtin_1024['tokenizer']}", "model.vocab_size=512")
    assert train.main(["--config", str(SMOKE), *args]) == 2
    assert f"tokenizer {builtin_1024['tokenizer']} has 1024 tokens but model.vocab_size is 512" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # stopped before any work


def test_every_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


# -- optimizers and schedule -------------------------------------------------------------------

@pytest.mark.parametrize("tie, granularity", [(True, "none"), (False, "none"), (True, "block"), (True, "layer")])
def test_param_groups_cover_every_parameter_once(tie, granularity):
    cfg = load_config(SMOKE, [f"model.tie_embeddings={str(tie).lower()}", f"mod.granularity={granularity}",
                              "mod.layers=[1]", "mod.block_size=16"])
    model = train.GPT(cfg.model, cfg.mod)
    matrices, adam = optim.param_groups(model, cfg.optim)
    grouped = [id(p) for p in matrices] + [id(p) for g in adam for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    assert all(p.ndim == 2 for p in matrices)
    block_matrices = {id(p) for b in model.blocks for p in b.parameters() if p.ndim == 2}
    assert {id(p) for p in matrices} == block_matrices
    adam_ids = {id(p) for g in adam for p in g["params"]}
    assert id(model.wte.weight) in adam_ids
    assert (model.lm_head is None) == tie
    if not tie:
        assert id(model.lm_head.weight) in adam_ids


def test_lr_schedule_is_a_function_of_progress():
    o = load_config(SMOKE, ["optim.warmup=0.1", "optim.warmdown=0.4", "optim.lr_floor=0.1"]).optim
    assert optim.lr_scale(0.0, o) == 0.0
    assert optim.lr_scale(0.05, o) == pytest.approx(0.5)
    assert optim.lr_scale(0.3, o) == 1.0
    assert optim.lr_scale(0.6, o) == 1.0
    assert optim.lr_scale(0.8, o) == pytest.approx(0.1 + 0.9 * 0.5)
    assert optim.lr_scale(1.0, o) == pytest.approx(0.1)
    assert optim.lr_scale(1.7, o) == pytest.approx(0.1)  # past the budget: the floor


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    for shape in [(64, 32), (32, 64)]:
        x = optim.newton_schulz(torch.randn(shape), steps=5)
        s = torch.linalg.svdvals(x)
        assert x.shape == shape
        assert s.min() > 0.5 and s.max() < 1.5  # the quintic trades exactness for speed: near 1


# -- runs ---------------------------------------------------------------------------------------

def smoke_overrides(tmp_path, *extra):
    return [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", *extra]


def test_smoke_run_writes_ledger_row(tmp_path, builtin_1024):
    assert train.main(["--config", str(SMOKE), *smoke_overrides(tmp_path)]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "ok" and row["steps"] == "8"
    assert math.isfinite(float(row["val_bpb"])) and 0 < float(row["val_bpb"]) < 20
    assert int(row["val_tokens"]) == 4096  # eval.tokens of smoke.yaml, whole windows of 64
    assert int(row["val_bytes"]) > int(row["val_tokens"])
    assert float(row["val_loss"]) / math.log(2) * int(row["val_tokens"]) / int(row["val_bytes"]) == pytest.approx(
        float(row["val_bpb"]), rel=1e-4)
    assert Path(tmp_path / "runs" / row["run_id"] / "checkpoint.pt").is_file()


@pytest.mark.parametrize("routing", [(), ("mod.granularity=block", "mod.layers=[1]", "mod.block_size=16")])
def test_resume_reproduces_next_step_loss_and_load_for_eval(tmp_path, builtin_1024, routing):
    cfg = load_config(SMOKE, smoke_overrides(tmp_path, "budget.max_steps=3", *routing))
    first = train.Trainer(cfg)
    first.train()
    path = first.checkpoint_path
    expected = first.step(0.5).item()  # the step after the checkpoint, from the live objects

    resumed = train.Trainer(load_config(SMOKE, smoke_overrides(tmp_path, f"checkpoint.resume={path}", *routing)))
    assert resumed.step_count == 3
    assert resumed.step(0.5).item() == expected

    model = train.load_for_eval(path, "cpu")
    assert not model.training
    idx = torch.randint(0, cfg.model.vocab_size, (2, 32))
    reference = train.Trainer(load_config(SMOKE, smoke_overrides(tmp_path, f"checkpoint.resume={path}",
                                                                  *routing))).model
    assert len(model.routers) == len(routing) // 3  # the routed model comes back routed
    with torch.no_grad():
        assert torch.equal(model(idx), reference.eval()(idx))


def test_resume_rejects_a_different_model(tmp_path, builtin_1024):
    cfg = load_config(SMOKE, smoke_overrides(tmp_path, "budget.max_steps=1"))
    trainer = train.Trainer(cfg)
    trainer.train()
    with pytest.raises(ConfigError, match=r"model.n_layer: 2 -> 3"):
        train.Trainer(load_config(SMOKE, smoke_overrides(tmp_path, f"checkpoint.resume={trainer.checkpoint_path}",
                                                         "model.n_layer=3")))


def test_resume_takes_a_checkpoint_from_before_newer_keys(tmp_path, builtin_1024):
    """A checkpoint written before a model key existed (the key absent from its config) resumes as the
    same model: the missing key is its base.yaml default (a list-valued one too), not a difference."""
    trainer = train.Trainer(load_config(SMOKE, smoke_overrides(tmp_path, "budget.max_steps=1")))
    trainer.train()
    ckpt = torch.load(trainer.checkpoint_path, weights_only=False)
    for key in ("key_offset", "attn_source_layers"):
        del ckpt["config"]["model"][key]
    torch.save(ckpt, trainer.checkpoint_path)
    resumed = train.Trainer(load_config(SMOKE, smoke_overrides(tmp_path, f"checkpoint.resume={trainer.checkpoint_path}")))
    assert resumed.step_count == 1
    with pytest.raises(ConfigError, match=r"model.key_offset: 0.0 -> 0.3"):
        train.Trainer(load_config(SMOKE, smoke_overrides(tmp_path, f"checkpoint.resume={trainer.checkpoint_path}",
                                                         "model.key_offset=0.3")))

def test_sigterm_checkpoints_and_records_interrupted(tmp_path, builtin_1024):
    args = smoke_overrides(tmp_path, "budget.max_steps=0", "budget.seconds=600", "run.log_every=1")
    proc = subprocess.Popen([sys.executable, "train.py", "--config", str(SMOKE), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step:3 "):
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "interrupted" and row["val_bpb"] == ""
    ckpt = train.load_checkpoint(tmp_path / "runs" / row["run_id"] / "checkpoint.pt")
    assert ckpt["step"] == int(row["steps"]) >= 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_smoke_run_on_cuda(tmp_path, builtin_1024):
    assert train.main(["--config", str(SMOKE), *smoke_overrides(tmp_path, "device.type=cuda")]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["device"].startswith("cuda") and math.isfinite(float(row["val_bpb"]))


def test_a_crash_is_recorded_as_failed(tmp_path, builtin_1024, monkeypatch):
    step = train.Trainer.step

    def crash_on_third(self, progress):
        if self.step_count == 2:
            raise RuntimeError("simulated crash")
        return step(self, progress)

    monkeypatch.setattr(train.Trainer, "step", crash_on_third)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train.main(["--config", str(SMOKE), *smoke_overrides(tmp_path)])
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "failed" and row["steps"] == "2" and "RuntimeError: simulated crash" in row["notes"]


def test_a_non_finite_loss_stops_the_run_as_diverged(tmp_path, builtin_1024, monkeypatch):
    monkeypatch.setattr(train.GPT, "loss", lambda self, x, y, reduction="mean", micro_step=0: (self(x) * float("nan")).mean())
    assert train.main(["--config", str(SMOKE), *smoke_overrides(tmp_path)]) == 1
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "diverged" and row["steps"] == "1" and row["val_bpb"] == ""  # read every step on the CPU
    assert "non-finite training loss by step 1" in row["notes"]
