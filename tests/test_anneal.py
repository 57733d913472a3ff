"""Compute annealing: schedule validation, function-preserving growth at every kind of switch,
optimizer state after growth, a run across switches, precompiling every stage, resume mid-schedule."""
import json
import math
import time
from pathlib import Path

import pytest
import torch

import data
import ledger
import train
from config import ConfigError, load_config
from test_backends import COUNTERS, XLA_GRAPHS, run, smoke_args

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
WIDE = "model.mlp_mult=4"  # MLP width 256: two granules of 128, so it can grow
THREE_STAGES = ("schedule.stages=[{at: 0, depth: 1, mlp_hidden: 128, seq_len: 32, attn_scale: 0.5}, "
                "{at: 0.3, depth: 2}, {at: 0.6, mlp_hidden: 256, seq_len: 64, attn_scale: 1.0}]")


@pytest.mark.parametrize("stages, message", [
    ("[{at: 0.1}]", "schedule.stages[0].at: the first stage must be at 0"),
    ("[{at: 0}, {at: 0.5}, {at: 0.5}]", "schedule.stages[2].at: expected increasing values in (0, 1), after 0.5"),
    ("[{at: 0, depth: 3}]", "schedule.stages[0].depth: expected 1..2"),
    ("[{at: 0, depth: 2}, {at: 0.5, depth: 1}]", "schedule.stages[1].depth: expected 2..2 (growing"),
    ("[{at: 0, mlp_hidden: 100}]", "schedule.stages[0].mlp_hidden: expected a multiple of 128 or 256"),
    ("[{at: 0, seq_len: 48}]", "schedule.stages[0].seq_len, batch_tokens: the micro-batch's sequences, "
                               "optim.micro_batch * data.seq_len * batch_tokens / (optim.batch_tokens * seq_len) "
                               "= 4 * 64 * 512 / (512 * 48), must be a whole number"),
    ("[{at: 0, dept: 1}]", "unknown key schedule.stages[0].dept; did you mean depth?"),
    ("[{at: 0, capacity: 0.5}]", "schedule.stages[0].capacity: needs mod.granularity other than none"),
    ("[{depth: 1}]", "schedule.stages[0]: expected a mapping with `at`"),
    ("[{at: 0, depth: one}]", "schedule.stages[0].depth: expected int, got 'one'"),
    ("[{at: 0, batch_tokens: 320}]", "schedule.stages[0].seq_len, batch_tokens: the micro-batch's sequences, "
                                     "optim.micro_batch * data.seq_len * batch_tokens / (optim.batch_tokens * seq_len) "
                                     "= 4 * 64 * 320 / (512 * 64), must be a whole number"),
    ("[{at: 0, batch_tokens: 64}]", "schedule.stages[0].seq_len, batch_tokens"),  # half a sequence per micro-batch
])
def test_schedule_errors_name_the_stage_and_key(stages, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, [WIDE, f"schedule.stages={stages}"])
    assert message in str(e.value)


@pytest.mark.parametrize("extra, message", [
    (("model.n_layer=4", "schedule.stages=[{at: 0, depth: 1}, {at: 0.5, depth: 3}]"),
     "schedule.stages[1].depth: schedule.grow_init=copy copies active layers, so a stage at most doubles the depth (1 before it)"),
    (("schedule.grow_depth=interleave", "schedule.stages=[{at: 0, depth: 1}, {at: 0.5, depth: 2}]"),
     "schedule.stages[0].depth: schedule.grow_init=copy needs schedule.grow_depth=append"),
])
def test_copy_growth_errors(extra, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, ["schedule.grow_init=copy", *extra])
    assert message in str(e.value)


def losses(trainer, x, y):
    """(training-mode, evaluation-mode) loss of a fixed batch; no parameter changes."""
    with torch.no_grad():
        train_mode = trainer.model.loss(x, y).item()
        trainer.model.eval()
        eval_mode = trainer.model.loss(x, y).item()
        trainer.model.train()
    return train_mode, eval_mode


@pytest.mark.parametrize("grow_depth, mod", [("append", "none"), ("interleave", "none"), ("append", "block")])
def test_every_switch_preserves_the_function(tmp_path, builtin_1024, grow_depth, mod):
    stages = ("schedule.stages=[{at: 0, depth: 2, mlp_hidden: 128, seq_len: 32, attn_scale: 0.5, capacity: 0.5}, "
              "{at: 0.2, depth: 3}, {at: 0.4, mlp_hidden: 256}, {at: 0.6, depth: 4, seq_len: 64}, "
              "{at: 0.8, attn_scale: 1.0, mlp_scale: 0.5, capacity: 1.0}]")
    if mod == "none":
        stages = stages.replace(", capacity: 0.5", "").replace(", capacity: 1.0", "")
    cfg = load_config(SMOKE, smoke_args(tmp_path, WIDE, "model.n_layer=4", f"schedule.grow_depth={grow_depth}",
                                        f"mod.granularity={mod}", "mod.layers=[1, 3]", "mod.block_size=16",
                                        stages)[2:])
    trainer = train.Trainer(cfg)
    x, y = next(data.val_batches(trainer.val_files, 64, 4, 1024))
    for index, stage in enumerate(trainer.stages[1:], start=1):
        for _ in range(3):  # train the current stage, so nothing is at its initial value by luck
            trainer.model.set_residual_scales(*trainer.residual_scales(stage.at - 1e-9))
            trainer.step(0.0)
            trainer.inputs = trainer.fetch()
        before = losses(trainer, x, y)
        params_before, flops_before = train.active_params(trainer.model), trainer.stage_flops_per_token
        trainer.enter_stage(index)
        trainer.model.set_residual_scales(*trainer.residual_scales(stage.at))
        after = losses(trainer, x, y)
        assert after[1] == pytest.approx(before[1], rel=1e-5)  # evaluation: every switch
        if stage.capacity == trainer.stages[index - 1].capacity:  # training routing depends on capacity
            assert after[0] == pytest.approx(before[0], rel=1e-5)
        assert train.active_params(trainer.model) >= params_before
        assert trainer.stage_flops_per_token >= flops_before
        if stage.capacity > trainer.stages[index - 1].capacity:
            assert trainer.stage_flops_per_token > flops_before  # the FLOPs follow the stage's capacity
    assert trainer.model.active == (0, 1, 2, 3) and all(b.mlp.hidden == 256 for b in trainer.model.blocks)
    trainer.loader.close()


def test_optimizer_state_after_growth(tmp_path, builtin_1024):
    stages = "schedule.stages=[{at: 0, depth: 1, mlp_hidden: 128}, {at: 0.5, depth: 2, mlp_hidden: 256}]"
    trainer = train.Trainer(load_config(SMOKE, smoke_args(tmp_path, WIDE, stages)[2:]))
    muon = trainer.optimizers[0]
    trainer.step(0.0)
    new_layer = list(trainer.model.blocks[1].parameters())
    assert all(p not in muon.state for p in new_layer)  # never active: no state yet
    c_fc = trainer.model.blocks[0].mlp.c_fc.weight
    assert muon.state[c_fc]["momentum_buffer"][128:].abs().sum() == 0  # inactive units: zero momentum
    trainer.enter_stage(1)
    trainer.step(0.5)
    for p in muon.param_groups[0]["params"]:
        assert muon.state[p]["momentum_buffer"].shape == p.shape  # every matrix now has fresh state
    adam_state = trainer.optimizers[1].state[trainer.model.blocks[1].attn.q_gain]
    assert adam_state["exp_avg"].shape == trainer.model.blocks[1].attn.q_gain.shape
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    trainer.loader.close()


COPY_STAGES = ("model.n_layer=4", "schedule.grow_init=copy",
               "schedule.stages=[{at: 0, depth: 1}, {at: 0.3, depth: 2}, {at: 0.6, depth: 4}]")


def test_evaluation_before_the_routed_layer_is_active(tmp_path, builtin_1024):
    """A curve point taken while the stage's depth leaves every routed layer out counts no tiles: it
    has no routing agreement (it divided by zero before), and the one after growth has one."""
    cfg = load_config(SMOKE, smoke_args(tmp_path, "mod.granularity=block", "mod.layers=[1]", "mod.block_size=16",
                                        "schedule.stages=[{at: 0, depth: 1}, {at: 0.5, depth: 2}]")[2:])
    trainer = train.Trainer(cfg)
    trainer.evaluate(max_tokens=0, max_batches=1)
    assert trainer.routing_agreement is None
    trainer.enter_stage(1)
    trainer.evaluate(max_tokens=0, max_batches=1)
    assert 0 <= trainer.routing_agreement <= 1
    trainer.loader.close()


def block_state(trainer, i):
    """Block i's parameters and their optimizer state, as plain tensors keyed by name."""
    out = {}
    for name, p in trainer.model.blocks[i].named_parameters():
        out[name] = p.detach().clone()
        for n, opt in enumerate(trainer.optimizers):
            for key, value in opt.state.get(p, {}).items():
                out[f"{name}/{n}/{key}"] = value.clone()
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_copy_growth_stacks_trained_layers_with_their_optimizer_state(tmp_path, builtin_1024):
    trainer = train.Trainer(load_config(SMOKE, smoke_args(tmp_path, *COPY_STAGES)[2:]))
    for index, sources in ((1, {1: 0}), (2, {2: 0, 3: 1})):  # 1 -> 2 layers: block 0 copied; 2 -> 4: blocks 0, 1
        for _ in range(2):
            trainer.step(0.0)
            trainer.inputs = trainer.fetch()
        before = {i: block_state(trainer, i) for i in range(4)}
        trainer.enter_stage(index)
        assert trainer.model.active == tuple(range(trainer.stages[index].depth))
        for new, source in sources.items():
            copied = block_state(trainer, new)
            assert_same(copied, before[source])  # weights, Muon momentum, AdamW moments and step
            assert any(k.endswith("momentum_buffer") for k in copied) and any(k.endswith("exp_avg") for k in copied)
        for i in set(range(4)) - set(sources):
            assert_same(block_state(trainer, i), before[i])  # the others untouched
    trainer.step(0.7)
    a, b = block_state(trainer, 0), block_state(trainer, 2)
    assert not torch.equal(a["attn.c_q.weight"], b["attn.c_q.weight"])  # copies train apart (their inputs differ)
    trainer.loader.close()


def test_copy_growth_resumes_mid_schedule(tmp_path, builtin_1024):
    args = smoke_args(tmp_path, *COPY_STAGES, "budget.seconds=10")[2:]
    trainer = train.Trainer(load_config(SMOKE, args))
    trainer.step(0.0)
    trainer.timeline[-1][2] += 1
    before_switch = tmp_path / "before.pt"
    train.save_checkpoint(before_switch, trainer.state())
    trainer.train_s = 3.5  # p = 0.35: the second stage, entered (and copied) as the loop would
    trainer.enter_stage(trainer.stage_at(0.35))
    trainer.step(0.35)
    trainer.timeline[-1][2] += 1
    after_switch = tmp_path / "after.pt"
    train.save_checkpoint(after_switch, trainer.state())
    trained = {i: block_state(trainer, i) for i in range(2)}
    trainer.loader.close()

    resumed = train.Trainer(load_config(SMOKE, [*args, f"checkpoint.resume={after_switch}"]))
    assert resumed.stage == 1 and resumed.model.active == (0, 1)
    for i in range(2):  # block 1 keeps what it learned since the copy: resuming copies nothing again
        assert_same(block_state(resumed, i), trained[i])
    assert not torch.equal(trained[0]["attn.c_q.weight"], trained[1]["attn.c_q.weight"])
    resumed.loader.close()

    resumed = train.Trainer(load_config(SMOKE, [*args, f"checkpoint.resume={before_switch}"]))
    assert resumed.stage == 0
    block0 = block_state(resumed, 0)
    resumed.enter_stage(1)  # the switch still to come copies, as in the uninterrupted run
    assert_same(block_state(resumed, 1), block0)
    resumed.loader.close()


def test_batch_size_stage_scales_rows_lr_and_token_counts(tmp_path, builtin_1024, monkeypatch):
    stages = "schedule.stages=[{at: 0, batch_tokens: 256}, {at: 0.5, batch_tokens: 512}]"
    trainer = train.Trainer(load_config(SMOKE, smoke_args(tmp_path, stages)[2:]))
    assert trainer.accum_steps == 2 and trainer.loader.batch_size == 2  # half the rows, same accumulation
    trainer.step(0.0)
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            assert group["lr"] == pytest.approx(group["peak_lr"] * 0.5 ** 0.5)
    trainer.enter_stage(1)
    assert trainer.loader.batch_size == 4
    trainer.step(0.5)
    assert all(g["lr"] == pytest.approx(g["peak_lr"]) for opt in trainer.optimizers for g in opt.param_groups)
    trainer.loader.close()
    monkeypatch.setattr(train, "time", StepClock())
    assert train.main(smoke_args(tmp_path, stages, "budget.seconds=2", "budget.max_steps=0")) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    steps = [int(part.split(":")[1]) for part in row["stages"].split()]
    assert int(row["tokens"]) == 256 * steps[0] + 512 * steps[1] and steps[0] > 0 and steps[1] > 0


class StepClock:
    """train.py's clock advanced by `every` seconds (0.1) at every reading: stage switches (functions of elapsed
    time) then come after a fixed number of steps, however fast or busy the machine is."""

    def __init__(self, every=0.1):
        self.now, self.every = 0.0, every

    def perf_counter(self):
        self.now += self.every
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_run_passes_every_stage(tmp_path, builtin_1024, monkeypatch):
    monkeypatch.setattr(train, "time", StepClock())
    args = smoke_args(tmp_path, WIDE, THREE_STAGES, "budget.seconds=3", "budget.max_steps=0", "run.log_every=5")
    assert train.main(args) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    timeline = [part.split("@") for part in row["stages"].split()]
    assert [int(i) for i, _ in timeline] == [0, 1, 2] and all(int(t.split(":")[1]) > 0 for _, t in timeline)
    assert row["status"] == "ok" and math.isfinite(float(row["val_bpb"]))


def saved_mid_schedule(tmp_path, args, progress):
    """A trainer of a 3 s budget (args) entered at `progress`, one step taken and saved -> (that trainer,
    its checkpoint, a trainer resumed from it)."""
    first = train.Trainer(load_config(SMOKE, args))
    first.train_s = progress * 3
    first.enter_stage(first.stage_at(progress))
    first.step(progress)
    first.timeline[-1][2] += 1
    checkpoint = tmp_path / "mid.pt"
    train.save_checkpoint(checkpoint, first.state())
    first.loader.close()
    return first, checkpoint, train.Trainer(load_config(SMOKE, [*args, f"checkpoint.resume={checkpoint}"]))


def test_resume_mid_schedule_restores_the_stage(tmp_path, builtin_1024, monkeypatch):
    args = smoke_args(tmp_path, WIDE, THREE_STAGES, "budget.seconds=3", "budget.max_steps=0")[2:]
    first, checkpoint, resumed = saved_mid_schedule(tmp_path, args, 0.4)  # in the middle stage
    assert resumed.stage == 1 and resumed.model.active == (0, 1)
    assert all(b.mlp.hidden == 128 for b in resumed.model.blocks) and resumed.loader.seq_len == 32
    assert resumed.timeline == first.timeline and resumed.loader_state == first.state()["loader"]
    resumed.loader.close()
    monkeypatch.setattr(train, "time", StepClock())
    assert train.main([*smoke_args(tmp_path)[:2], *args, f"checkpoint.resume={checkpoint}"]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert [part.split("@")[0] for part in row["stages"].split()] == ["0", "1", "2"]


def test_a_precompile_run_runs_its_whole_plan_however_slow_its_steps(tmp_path, builtin_1024, monkeypatch, capsys):
    """Each clock reading 10 s later against a budget of 1 s: still each stage's first and steady step, 6 in all."""
    monkeypatch.setattr(train, "time", StepClock(10.0))
    args = smoke_args(tmp_path, WIDE, THREE_STAGES, "budget.seconds=1", "budget.max_steps=0", "run.precompile=true")
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("stage:")] == ["stage:0", "stage:1", "stage:2"]
    assert "precompile status:ok steps:6 " in out


LOOP_STAGES = ("mod.granularity=token", "mod.recur=true", "schedule.recur_gate=true",  # a routed, gated loop in two steps
               "schedule.stages=[{at: 0}, {at: 0.3, recur: 2, recur_span: [0, 1]}, {at: 0.6, recur: 3}]")


@pytest.mark.xla
@pytest.mark.parametrize("stages", [(THREE_STAGES,), LOOP_STAGES], ids=["growth", "loop"])
def test_precompile_runs_every_stage(tmp_path, builtin_1024, stages):
    cache = f"device.compile_cache={tmp_path / 'xla_cache'}"
    args = ("device.type=xla", cache, WIDE, *stages, "budget.seconds=4", "budget.max_steps=0")
    launcher = (__import__("sys").executable, "-c", COUNTERS)
    out = run(smoke_args(tmp_path, *args, "run.precompile=true"), launcher)
    compiled = int(out.split("xla_compiles:")[1].split()[0])
    cfg = load_config(SMOKE, args)
    assert compiled == train.xla_graphs(cfg, train.resolve_stages(cfg), train.accum_steps(cfg, 1)) > XLA_GRAPHS
    counters = json.loads(run(smoke_args(tmp_path, *args), launcher).split("COUNTERS ")[1])
    assert counters.get("PersistentCacheMiss", 0) == 0  # the timed run met no graph precompile had not run
