"""Depth recursion (a schedule stage's recur over recur_span) and Mixture-of-Recursions (mod.recur):
what a loop computes, the zero gate's function preservation, causal evaluation, skipped work,
the FLOP count of the virtual depth, switch points in seconds and tokens, a run across a loop
switch with resume and load_for_eval, and the errors for bad schedules."""
from types import SimpleNamespace

import pytest
import torch

import data
import ledger
import train
from config import ConfigError, load_config
from model import GPT, flops_per_token
from test_anneal import SMOKE, StepClock, saved_mid_schedule
from test_backends import smoke_args
from test_mod import T, count_calls, mod_cfg, tiny_cfg, tokens

LOOP = "schedule.stages=[{at: 0}, {at: 0.5, recur: 3, recur_span: [1, 2]}]"


def make(mod=None, passes=3, gate=False, seed=0, **changes):
    """A 4-layer model with every weight random (zero projections would hide what a pass adds)."""
    torch.manual_seed(seed)
    model = GPT(tiny_cfg(**changes), mod, passes=passes, recur_gate=gate)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def mor(granularity="token", capacity=0.5):
    return SimpleNamespace(**{**vars(mod_cfg(granularity, capacity)), "layers": (), "recur": True})


def test_a_loop_runs_the_span_again_with_the_same_weights():
    model = make(value_embed=True).eval()
    idx = tokens()
    with torch.no_grad():
        model.set_recursion((1, 2), 3)
        looped = model(idx)
        # The same function by hand: layers 0, 1, 2, then 1, 2 twice more, then 3.
        x = model.kernels.rmsnorm(model.wte(idx))
        ve = torch.nn.functional.embedding(idx, model.value_embed)
        for i in (0, 1, 2, 1, 2, 1, 2, 3):
            x = model.blocks[i](x, ve=ve if i in model.ve_layers else None)
        by_hand = torch.nn.functional.linear(model.kernels.rmsnorm(x), model.head_weight)
        by_hand = 30.0 * torch.tanh(by_hand / 30.0)
        model.set_recursion((), 1)
        plain = model(idx)
    torch.testing.assert_close(looped, by_hand, rtol=0, atol=1e-5)
    assert not torch.allclose(looped, plain, atol=1e-3)


@pytest.mark.parametrize("routing", [None, "token", "block"])
def test_the_zero_gate_makes_entering_a_loop_keep_the_function(routing):
    model = make(None if routing is None else mor(routing), gate=True)
    for gate in model.recur_gates:
        torch.nn.init.zeros_(gate)  # their initial value (make() randomised every parameter)
    idx = tokens()
    for mode in (model.train, model.eval):
        mode()
        with torch.no_grad():
            before = model.loss(idx, idx)
            model.set_recursion((1, 2), 3)
            after = model.loss(idx, idx)
            model.set_recursion((), 1)
        assert torch.equal(before, after)
    ungated = make(None if routing is None else mor(routing))
    with torch.no_grad():
        before = ungated.loss(idx, idx)
        ungated.set_recursion((1, 2), 3)
        assert not torch.equal(before, ungated.loss(idx, idx))  # without the gate it does not


def test_the_gates_learn():
    model = make(gate=True)
    for gate in model.recur_gates:
        torch.nn.init.zeros_(gate)
    model.set_recursion((1, 2), 3)
    idx = tokens()
    model.loss(idx, idx).backward()
    assert all(gate.grad is not None and gate.grad.abs() > 0 for gate in model.recur_gates)


@pytest.mark.parametrize("routing", [None, "token", "block"])
def test_evaluation_with_a_loop_is_causal(routing):
    model = make(None if routing is None else mor(routing)).eval()
    model.set_recursion((0, 2), 3)
    idx = tokens()
    for t in (3, 7, 8, 23):
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(0, 64, (2, T - t - 1), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            a, b = model(idx), model(changed)
        assert torch.equal(a[:, : t + 1], b[:, : t + 1]), t
        assert not torch.equal(a[:, t + 1:], b[:, t + 1:])


@pytest.mark.parametrize("granularity, capacity, tile", [("token", 0.25, 1), ("block", 0.5, 8)])
def test_routed_passes_compute_only_their_tiles(granularity, capacity, tile):
    model = make(mor(granularity, capacity)).train()
    model.set_recursion((1, 2), 3)
    calls = count_calls([model.blocks[i].attn for i in range(4)])
    idx = tokens()
    model.loss(idx, idx).backward()
    k = int(capacity * T / tile) * tile  # tokens per sequence through each extra pass
    assert calls[0] == [(2, T, 32)] and calls[3] == [(2, T, 32)]
    assert calls[1] == calls[2] == [(2, T, 32), (2, k, 32), (2, k, 32)]  # first pass whole, the two extra routed
    assert model.routers["pass1"].router.weight.grad.abs().sum() > 0  # through w = sigmoid(score)
    assert model.routers["pass2"].router.weight.grad.abs().sum() > 0


def test_flops_count_the_virtual_depth():
    cfg = tiny_cfg()
    looped = flops_per_token(cfg, T, layers=range(4), loop_layers=2, passes=3)
    assert looped == flops_per_token(cfg, T, layers=range(8))  # 4 layers + 2 x 2 again
    # Routed passes count like Mixture-of-Depths layers, with one router per pass instead of per layer.
    routed = flops_per_token(cfg, T, mor("block", 0.5), range(4), loop_layers=2, passes=2)
    as_mod = flops_per_token(cfg, T, SimpleNamespace(**{**vars(mod_cfg("block", 0.5)), "layers": (4, 5)}), range(6))
    assert routed == pytest.approx(as_mod - 3 * 2 * (2 * 32 / 8))


def stage_config(tmp_path, *overrides):
    return load_config(SMOKE, smoke_args(tmp_path, *overrides)[2:])


def test_switch_points_in_seconds_and_tokens(tmp_path):
    seconds = stage_config(tmp_path, "budget.seconds=600", "schedule.stages=[{at: 0}, {at: 45s, recur: 2, recur_span: [0, 1]}]")
    stages = train.resolve_stages(seconds)
    assert stages[1].at == 45 / 600 and stages[1].at_tokens == 0 and stages[1].recur == 2
    tokens_ = stage_config(tmp_path, "schedule.stages=[{at: 0}, {at: 2e3 tokens, recur: 2, recur_span: [0, 1]}, "
                                     "{at: 4096 tokens, recur: 1}]")
    assert [(s.at_tokens, s.recur) for s in train.resolve_stages(tokens_)] == [(0, 1), (2000, 2), (4096, 1)]


def test_a_token_schedule_switches_on_the_tokens_trained(tmp_path, builtin_1024):
    cfg = stage_config(tmp_path, "schedule.stages=[{at: 0}, {at: 1000 tokens, recur: 2, recur_span: [0, 1]}]")
    trainer = train.Trainer(cfg)
    per_step = cfg.optim.batch_tokens
    steps = -(-1000 // per_step)  # the first step at or past 1000 tokens
    for _ in range(steps):
        assert trainer.stage_at(0.99) == 0  # time does not matter
        trainer.step(0.0)
        trainer.timeline[-1][2] += 1
    assert trainer.stage_at(0.0) == 1
    trainer.loader.close()


@pytest.mark.parametrize("stages, message", [
    ("[{at: 0, recur: 0}]", "schedule.stages[0].recur: expected passes through the loop span >= 1"),
    ("[{at: 0}, {at: 0.5, recur: 2}]", "schedule.stages[1].recur_span: expected [first, last] positions"),
    ("[{at: 0}, {at: 0.5, recur: 2, recur_span: [1, 2]}]", "recur_span: expected [first, last] positions of the "
                                                           "active layers, 0 <= first <= last < depth (2)"),
    ("[{at: 0, depth: 1}, {at: 0.5, recur: 2, recur_span: [0, 1]}]", "< depth (1)"),
    ("[{at: 0}, {at: 0.5, recur: 2, recur_span: [1, 0]}]", "recur_span: expected [first, last]"),
    ("[{at: 0}, {at: 0.6}, {at: 0.5}]", "schedule.stages[2].at: expected increasing values in (0, 1), after 0.6"),
    ("[{at: 0}, {at: 90s}]", "schedule.stages[1].at: expected increasing values in (0, 1)"),  # past the 60 s budget
    ("[{at: 0}, {at: 30s}, {at: 20s}]", "schedule.stages[2].at: expected increasing values in (0, 1), after 0.5"),
    ("[{at: 0}, {at: 2000 tokens}, {at: 1000 tokens}]", "schedule.stages[2].at: expected increasing token counts"),
    ("[{at: 0}, {at: 0.5}, {at: 2000 tokens}]", "before any stage switched by time (a schedule switches by tokens, "
                                               "then by time)"),
    ("[{at: 0}, {at: 1.5 tokens}]", "schedule.stages[1].at: expected a whole number of tokens >= 1"),
    ("[{at: 0}, {at: 10 minutes}]", "schedule.stages[1].at: expected a fraction of the budget, seconds ('45s') or "
                                    "tokens ('2e6 tokens'), got '10 minutes'"),
    ("[{at: 0, capacity: 1.5}]", "schedule.stages[0].capacity: expected in (0, 1]"),
])
def test_bad_loops_and_switch_points_are_named(tmp_path, stages, message):
    with pytest.raises(ConfigError) as e:
        stage_config(tmp_path, "budget.seconds=60", "mod.granularity=token", "mod.layers=[0]", "mod.block_size=1",
                     f"schedule.stages={stages}")
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (("mod.recur=true",), "mod.recur: routes a loop's passes by tile or token, so it needs mod.granularity block "
                          "or token, got none"),
    (("mod.recur=true", "mod.granularity=token", "mod.block_size=1"), "mod.recur: routes the extra passes of a "
                                                                       "loop, but no schedule stage sets recur > 1"),
    (("mod.granularity=token", "mod.block_size=1"), "mod.layers: expected distinct layer indices"),
    (("mod.granularity=token", "mod.layers=[1]", LOOP.replace("[1, 2]", "[0, 1]")),
     "recur_span: the looped layers [0, 1] may not be Mixture-of-Depths layers"),
    (("model.unet=true", LOOP.replace("[1, 2]", "[0, 1]")), "recur: a loop is not defined with model.unet's skips"),
])
def test_bad_routing_of_a_loop_is_named(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        stage_config(tmp_path, *overrides)
    assert message in str(e.value)


def test_a_run_across_a_loop_switch_resumes_and_loads(tmp_path, builtin_1024, monkeypatch):
    loop = ("model.n_layer=3", LOOP, "schedule.recur_gate=true", "mod.recur=true", "mod.granularity=token",
            "mod.block_size=1", "mod.capacity=0.5", "budget.seconds=3", "budget.max_steps=0")
    args = smoke_args(tmp_path, *loop)[2:]
    first = train.Trainer(load_config(SMOKE, args))
    assert first.model.passes == 1 and first.stage_flops_per_token < flops_per_token(
        first.cfg.model, first.cfg.data.seq_len, first.cfg.mod, range(3), loop_layers=2, passes=3)
    first.loader.close()
    first, checkpoint, resumed = saved_mid_schedule(tmp_path, args, 0.6)
    assert (first.model.loop_span, first.model.passes) == ((1, 2), 3)
    assert (resumed.stage, resumed.model.loop_span, resumed.model.passes) == (1, (1, 2), 3)
    assert resumed.stage_flops_per_token == first.stage_flops_per_token
    resumed.loader.close()
    loaded = train.load_for_eval(checkpoint, "cpu")
    assert (loaded.loop_span, loaded.passes) == ((1, 2), 3)
    x, _ = next(data.val_batches(first.val_files, 32, 2, 1024))
    first.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), first.model(x))
    monkeypatch.setattr(train, "time", StepClock())
    assert train.main([*smoke_args(tmp_path)[:2], *args]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    assert [part.split(":")[-1] for part in row["stages"].split()] == ["d3", "d7"]  # 3 layers, then 1 + 3 x 2
    assert row["status"] == "ok"
