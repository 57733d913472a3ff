"""The training-loss and weight-averaging levers of FrontierForge's K82s4 (recipes/K82s4/train.py, github
marker2601/trainium-simulator): multi-token prediction scored from the same next-token logits (optim.mtp_weights,
optim.mtp_until), BOS targets left out of the training loss (optim.mask_bos_targets), and the EMA's update interval,
blend and prewarm (optim.ema_every, optim.ema_blend, optim.ema_prewarm). Off, the loss, the training and the average
are as before, bitwise; on, each is its formula computed by hand; the forward, evaluation and load_for_eval's model
never see the loss levers; a resumed run with all on is the uninterrupted one to the bit; XLA and torch.compile
trace no more graphs."""
import dataclasses
from pathlib import Path

import pytest
import torch

import clock
import config
import ledger
import train
from config import ConfigError, load_config
from kernels.reference import head_nll
from model import GPT, active_params, param_count
from optim import ema_weight, mtp_weights
from test_backends import XLA_GRAPHS, note, run, smoke_args
from test_kit_contract import check_contract
from test_newer_records import tokens
from test_recipe_items import ema_by_name, step, trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
BOS = 1  # the built-in tokenizer's
KEYS = ("optim.ema_every", "optim.ema_blend", "optim.ema_prewarm", "optim.mtp_weights", "optim.mtp_until",
        "optim.mask_bos_targets")
LINEAGE_MTP = ("optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.45,0.2]")
LOSS_ON = (*LINEAGE_MTP, "optim.mask_bos_targets=true")
ALL_ON = (*LOSS_ON, "optim.ema=0.9", "optim.ema_every=2", "optim.ema_blend=0.6", "optim.ema_prewarm=true")


def build(seed=0, **kw):
    """A smoke-shaped model with every weight random (the zero-initialised head would hide the loss)."""
    c = load_config(SMOKE)
    torch.manual_seed(seed)
    model = GPT(c.model, c.mod, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def by_hand(model, idx, targets, weights, bos=-1):
    """K82s4's loss with loops: each position's log-softmax of the forward's logits scored against the next token
    (weight 1) and the k-th token after that (weights[k-1]) where the row has one, every target equal to `bos` left
    out; the sum over the count of next-token targets kept."""
    logp = model(idx).double().log_softmax(-1)
    total, count = 0.0, 0
    for b in range(targets.size(0)):
        for t in range(targets.size(1)):
            for k, w in enumerate([1.0, *weights]):
                if t + k < targets.size(1) and targets[b, t + k] != bos:
                    total -= w * logp[b, t, targets[b, t + k]].item()
            count += int(targets[b, t] != bos)
    return total / max(count, 1)


# -- off: as before --------------------------------------------------------------------------------

def test_each_key_at_its_base_value_is_off_and_keeps_the_recipe():
    o = load_config(SMOKE).optim
    assert (o.ema_every, o.ema_blend, o.ema_prewarm, o.mtp_weights, o.mtp_until, o.mask_bos_targets) == (
        1, 1.0, False, (), (), False)
    assert all(k in config.RECIPE_NEUTRAL and k not in config.RECIPE_IGNORED for k in KEYS)
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    assert config.recipe(flat, "data") == config.recipe({k: v for k, v in flat.items() if k not in KEYS}, "data")
    on = config.flatten(dataclasses.asdict(load_config(SMOKE, ALL_ON)))
    for key in KEYS:
        assert config.recipe(on, "data") != config.recipe({**on, key: flat[key]}, "data"), key
    # The MTP path, BOS masking and the update interval change what a step computes; the others only what it learns.
    assert {k for k in KEYS if k in clock.COST_IGNORED} == {"optim.ema_blend", "optim.ema_prewarm", "optim.mtp_until"}


def test_off_the_model_and_its_loss_are_as_before():
    plain, off = build(), build(mtp=0, masked_target=None)
    assert not hasattr(off, "mtp_weight") and not hasattr(off, "bos")
    off.set_mtp_weights([])  # nothing to set
    idx, targets = tokens(), tokens(seed=2)
    want = head_nll(plain.hidden(idx).flatten(0, 1), plain.head_weight, targets.flatten(), plain.cfg.logit_softcap).mean()
    assert torch.equal(off.loss(idx, targets), want)
    # On, nothing is added to the parameters, their initial values, the state dict or the counts.
    on = build(mtp=2, masked_target=BOS)
    assert list(on.state_dict()) == list(plain.state_dict())  # BOS masking adds no bos buffer either
    assert all(torch.equal(a, b) for a, b in zip(on.parameters(), plain.parameters()))
    assert (param_count(on), active_params(on)) == (param_count(plain), active_params(plain))


def test_training_with_the_keys_off_is_the_next_token_mean_and_the_ema_as_before(tmp_path, builtin_1024):
    t = trainer(tmp_path, "optim.ema=0.9")
    assert not hasattr(t.model, "mtp_weight") and not hasattr(t.model, "bos") and t.ema.held == {}
    model = [m.detach().clone() for m in t.model.parameters()]
    p = t.model.blocks[0].attn.c_q.weight
    average = p.detach().clone()
    for _ in range(3):
        inputs = [(x.clone(), y.clone()) for x, y in t.inputs]
        with torch.no_grad():
            want = torch.zeros(())
            for x, y in inputs:
                want += head_nll(t.model.hidden(x).flatten(0, 1), t.model.head_weight, y.flatten(),
                                 t.model.cfg.logit_softcap).mean()
        assert torch.equal(t.step(0.1), want / len(inputs))
        t.inputs = t.fetch()
        average = torch.lerp(average, p.detach(), 1 - 0.9)  # the per-step EMA, bitwise
        assert torch.equal(t.ema[p], average)
    assert not all(torch.equal(a, b) for a, b in zip(model, t.model.parameters()))
    state = t.state()
    assert "average" not in state and torch.equal(state["model"]["blocks.0.attn.c_q.weight"], average)
    t.loader.close()


# -- multi-token prediction and BOS targets ----------------------------------------------------------

def test_mtp_weights_fade_the_farthest_first_through_the_lineage_levels():
    o = load_config(SMOKE, LINEAGE_MTP).optim
    assert mtp_weights(0.0, o) == [0.5, 0.25]
    for j in range(4):  # K82s4's 4 levels of each fade, each at its midpoint weight
        assert mtp_weights((j + 0.5) / 4 * 0.2, o) == pytest.approx([0.5, 0.25 * (1 - (j + 0.5) / 4)])
        assert mtp_weights(0.2 + (j + 0.5) / 4 * 0.25, o) == pytest.approx([0.5 * (1 - (j + 0.5) / 4), 0.0])
    assert mtp_weights(0.025, o)[1] == pytest.approx(0.21875) and mtp_weights(0.23125, o)[0] == pytest.approx(0.4375)
    assert mtp_weights(0.45, o) == mtp_weights(0.9, o) == [0.0, 0.0]
    assert mtp_weights(0.3, load_config(SMOKE).optim) == []


@pytest.mark.parametrize("p", [0.0, 0.1, 0.3, 0.6])
@pytest.mark.parametrize("mask", [False, True])
def test_mtp_loss_is_its_formula_by_hand(p, mask):
    weights = mtp_weights(p, load_config(SMOKE, LINEAGE_MTP).optim)
    model = build(mtp=2, masked_target=BOS if mask else None)
    model.set_mtp_weights(weights)
    assert model.mtp_weight.tolist() == pytest.approx(weights)
    idx, targets = tokens(), tokens(seed=2, starts=(0, 5, 31, 62, 63))  # BOS targets, two at the row end
    with torch.no_grad():
        loss = model.loss(idx, targets)
        assert loss.item() == pytest.approx(by_hand(model, idx, targets, weights, BOS if mask else -1), rel=1e-5)


def test_bos_targets_are_left_out_of_the_training_loss():
    model, idx, targets = build(masked_target=BOS), tokens(), tokens(seed=2, starts=(0, 5, 63))
    with torch.no_grad():
        assert model.loss(idx, targets).item() == pytest.approx(by_hand(model, idx, targets, [], BOS), rel=1e-5)
        nll = model.loss(idx, targets, reduction="none")
        keep = targets.flatten() != BOS
        torch.testing.assert_close(model.loss(idx, targets), nll[keep].mean(), rtol=1e-6, atol=0)  # the head's NLL, kept
        assert torch.equal(model.loss(idx, torch.full_like(targets, BOS)), torch.zeros(()))  # none left: 0, not NaN


@pytest.mark.parametrize("mtp", [0, 2])
def test_a_position_whose_targets_are_all_left_out_gets_no_gradient(mtp):
    """The head's input at each position, scored against the next token (and with MTP the next ones): zero
    gradient exactly where every one of them is BOS or past the row's end (positions 62, 63 with BOS at 62, 63)."""
    model, targets = build(mtp=mtp, masked_target=BOS), tokens(seed=2, starts=(0, 5, 62, 63))
    model.set_mtp_weights([0.5, 0.25][:mtp])
    x = torch.randn(2, 64, model.cfg.n_embd, requires_grad=True)
    model.objective(x, targets).backward()
    unscored = torch.zeros(2, 64, dtype=torch.bool)
    unscored[:, [62, 63] if mtp else [0, 5, 62, 63]] = True
    assert (x.grad[unscored] == 0).all() and (x.grad[~unscored] != 0).any(-1).all()


def test_the_loss_levers_leave_forward_and_evaluation_unchanged():
    on, plain = build(mtp=2, masked_target=BOS), build()
    on.set_mtp_weights([0.5, 0.25])
    idx, targets = tokens(), tokens(seed=2, starts=(0, 9))
    with torch.no_grad():
        for mode in (True, False):
            on.train(mode)
            plain.train(mode)
            assert torch.equal(on(idx), plain(idx))
            for reduction in ("none", "sum"):  # evaluation's
                assert torch.equal(on.loss(idx, targets, reduction), plain.loss(idx, targets, reduction))
            assert not torch.equal(on.loss(idx, targets), plain.loss(idx, targets))  # the training objective only


def test_evaluation_and_load_for_eval_score_the_next_token_only(tmp_path, builtin_1024):
    t = trainer(tmp_path, *LOSS_ON)
    assert t.model.mtp == 2 and t.model.masked_target == BOS and not hasattr(t.model, "bos")
    for progress in (0.0, 0.1, 0.3):
        step(t, progress)
        assert t.model.mtp_weight.tolist() == pytest.approx(mtp_weights(progress, t.cfg.optim))
    val = t.evaluate(4096)
    path = tmp_path / "mtp.pt"
    train.save_checkpoint(path, t.state())
    t.loader.close()
    plain = trainer(tmp_path)  # every key off, the same weights
    plain.model.load_state_dict(t.model.state_dict())
    assert plain.evaluate(4096) == val
    scored = train.load_for_eval(path, "cpu")
    assert scored.mtp == 0 and scored.masked_target is None and not hasattr(scored, "mtp_weight")
    idx = tokens(length=96)
    with torch.no_grad():
        assert torch.equal(scored(idx), plain.model.eval()(idx))
    check_contract(scored, 1024)
    plain.loader.close()


# -- a stage's mtp: the extra targets whose weights have faded, left out --------------------------------

@pytest.mark.parametrize("mask", [False, True])
def test_leaving_out_faded_targets_keeps_the_objective_and_its_gradients(mask):
    """The objective computed for fewer extra targets (a stage's mtp) once the others weigh 0 is the one computed for
    all, value and gradients, to float32 rounding (fewer terms summed; at 0 the configured head's NLL instead of the
    reference logits'); at 0 the vocabulary-wide logits are never materialised."""
    model = build(mtp=2, masked_target=BOS if mask else None)
    idx, targets = tokens(), tokens(seed=2, starts=(0, 5, 31, 62, 63))

    def objective(computed):
        model.mtp_computed = computed
        model.zero_grad()
        loss = model.loss(idx, targets)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    for weights, computed in (([0.4, 0.0], 1), ([0.0, 0.0], 1), ([0.0, 0.0], 0)):
        model.set_mtp_weights(weights)
        (want, want_grads), (got, got_grads) = objective(2), objective(computed)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    model.set_mtp_weights([0.4, 0.0])
    assert objective(1)[0] != objective(0)[0]  # a weight not yet 0 counts: leaving it out would change the loss
    model.logits = lambda x: pytest.fail("logits materialised with no extra target computed")
    objective(0)


def stages_of(*entries, mtp=LINEAGE_MTP):
    return config.resolve_stages(load_config(SMOKE, [*mtp, f"schedule.stages=[{{at: 0}}, {', '.join(entries)}]"]))


def test_a_stage_leaves_out_only_extra_targets_that_have_faded():
    assert config.resolve_stages(load_config(SMOKE, LINEAGE_MTP))[0].mtp == 2  # every target, by default
    assert config.resolve_stages(load_config(SMOKE))[0].mtp == 0
    assert [s.mtp for s in stages_of("{at: 0.1}", "{at: 0.2, mtp: 1}", "{at: 0.45, mtp: 0}")] == [2, 2, 1, 0]
    for entry, message in (("{at: 0.3, mtp: 0}", r"optim.mtp_until \[0.45, 0.2\]"),
                           ("{at: 0.1, mtp: 1}", r"optim.mtp_until \[0.2\]"),
                           ("{at: '163840 tokens', mtp: 1}", "a stage switched by time"),
                           ("{at: 0.5, mtp: 3}", r"expected 0..2")):
        with pytest.raises(ConfigError, match=rf"schedule.stages\[1\]\.mtp: .*{message}"):
            stages_of(entry)
    with pytest.raises(ConfigError, match=r"\.mtp: expected 0..0"):
        stages_of("{at: 0.5, mtp: 1}", mtp=())


def test_a_stage_without_the_extra_targets_is_a_shape_of_its_own_in_a_calibration():
    c = load_config(SMOKE, [*LINEAGE_MTP, "schedule.stages=[{at: 0}, {at: 0.3}, {at: 0.45, mtp: 0}]"])
    flat, stages = config.flatten(dataclasses.asdict(c)), config.resolve_stages(c)
    keys = [clock.stage_key(flat, "data", s) for s in stages]
    assert keys[0] == keys[1] != keys[2]
    # Every target computed, a stage keeps the key it had before stages carried mtp: configs/cpu_t47.yaml's (MTP on)
    # are those its committed calibration of issue 50 holds.
    cpu = load_config(ROOT / "configs" / "cpu_t47.yaml", ["eval.every_seconds=0"])
    flat, data_sha = config.flatten(dataclasses.asdict(cpu)), "a576fab86bae-v2-tiktoken"  # its rows' data_sha
    committed = clock.read(ROOT / "sweeps" / "task_confirm_t47" / "calibration-5d4fbf4b.json")["stages"]
    assert all(clock.stage_key(flat, data_sha, s) in committed for s in config.resolve_stages(cpu))


def test_set_stage_sets_the_targets_computed_and_the_scored_model_has_none(tmp_path, builtin_1024):
    t = trainer(tmp_path, *LOSS_ON, "schedule.stages=[{at: 0}, {at: 0.45, mtp: 0}]")
    assert t.model.mtp == 2 and t.model.mtp_computed == 2
    train.set_stage(t.model, t.cfg, t.stages[1])
    assert t.model.mtp_computed == 0
    train.set_stage(t.model, t.cfg, t.stages[0])
    assert t.model.mtp_computed == 2
    path = tmp_path / "mtp.pt"
    train.save_checkpoint(path, t.state())
    t.loader.close()
    assert train.load_for_eval(path, "cpu").mtp_computed == 0


# -- the EMA: interval, prewarm, blend --------------------------------------------------------------

def test_ema_weight_is_the_lineage_schedule():
    o = load_config(SMOKE, ["optim.ema=0.99", "optim.ema_every=32", "optim.ema_prewarm=true"]).optim
    w = [ema_weight(s, o) for s in range(96)]
    assert [s for s in range(96) if w[s]] == [3, 31, 63, 95]  # after the 4th step, then every 32nd
    assert w[3] == w[31] == 1 - 0.99 ** 32 == pytest.approx(0.275020, abs=1e-6)
    both = load_config(SMOKE, ["optim.ema=0.99", "optim.ema_every=2", "optim.ema_prewarm=true"]).optim
    assert ema_weight(3, both) == 1 - 0.99 ** 4  # a regular update and the prewarm's: two
    before = load_config(SMOKE, ["optim.ema=0.99"]).optim
    assert all(ema_weight(s, before) == 1 - 0.99 for s in range(40))  # every step, the weight as before


@pytest.mark.parametrize("precision", [(), ("device.dtype=bfloat16", "device.bf16=weights")])
@pytest.mark.parametrize("every, prewarm", [(2, False), (3, True)])
def test_ema_every_and_prewarm_follow_their_recurrence(tmp_path, builtin_1024, precision, every, prewarm):
    d = 0.75
    t = trainer(tmp_path, f"optim.ema={d}", f"optim.ema_every={every}", f"optim.ema_prewarm={prewarm}", *precision)
    p = t.model.blocks[0].attn.c_q.weight
    updated = t.masters.get(p, p)
    want = updated.detach().clone()  # the initial weights
    for s in range(6):
        before = t.ema[updated].clone()
        step(t)
        n = ((s + 1) % every == 0) + (prewarm and s + 1 == 4)
        want = d ** (every * n) * want + (1 - d ** (every * n)) * updated.detach()
        torch.testing.assert_close(t.ema[updated], want, rtol=0, atol=1e-6)
        assert torch.equal(t.ema[updated], before) == (n == 0)  # untouched exactly on steps without an update
    t.loader.close()


def test_evaluation_and_load_for_eval_use_the_blend(tmp_path, builtin_1024):
    b = 0.6
    t = trainer(tmp_path, "optim.ema=0.5", f"optim.ema_blend={b}")
    for _ in range(3):
        step(t)
    live = {name: p.detach().clone() for name, p in t.model.named_parameters()}
    average = ema_by_name(t)
    val = t.evaluate(4096)
    assert all(torch.equal(p, live[name]) for name, p in t.model.named_parameters())  # swapped back
    assert all(torch.equal(a, average[name]) for name, a in ema_by_name(t).items())
    assert t.evaluate(4096) == val
    state = t.state()
    for name, w in live.items():
        assert torch.equal(state["trained"][name], w) and torch.equal(state["average"][name], average[name])
        torch.testing.assert_close(state["model"][name], w + b * (average[name] - w), rtol=0, atol=1e-6)
    assert any(not torch.equal(state["model"][n], average[n]) and not torch.equal(state["model"][n], w)
               for n, w in live.items())
    path = tmp_path / "blend.pt"
    train.save_checkpoint(path, state)
    t.loader.close()
    scored = train.load_for_eval(path, "cpu")
    assert all(torch.equal(p, state["model"][name]) for name, p in scored.named_parameters())
    plain = trainer(tmp_path)
    plain.model.load_state_dict(scored.state_dict())
    assert plain.evaluate(4096) == val  # evaluation scored the blend that load_for_eval scores
    plain.loader.close()


# -- all on: resume, graphs, errors -----------------------------------------------------------------

def test_a_resumed_run_with_all_on_is_the_uninterrupted_one(tmp_path, builtin_1024):
    """The prewarm (after step 4) and updates on even steps fall after the split at 3. MTP's weights follow the
    wall clock, so here they hold still: t+2's at 0.5 up to p = 0.5, t+3's at 0."""
    common = ("optim.mtp_weights=[0.5,0]", "optim.mtp_until=[0.9,0.5]", "optim.mask_bos_targets=true", "optim.ema=0.8",
              "optim.ema_every=2", "optim.ema_blend=0.6", "optim.ema_prewarm=true", "run.profile_steps=0")
    whole, first, resumed = tmp_path / "whole.pt", tmp_path / "first.pt", tmp_path / "resumed.pt"
    trainer(tmp_path, *common, "budget.max_steps=6", f"checkpoint.path={whole}").train()
    trainer(tmp_path, *common, "budget.max_steps=3", f"checkpoint.path={first}").train()
    trainer(tmp_path, *common, "budget.max_steps=6", f"checkpoint.resume={first}", f"checkpoint.path={resumed}").train()
    a, b = (train.load_checkpoint(path) for path in (whole, resumed))
    assert a["step"] == b["step"] == 6 and a["average"].keys() <= a["model"].keys() == a["trained"].keys()
    for key in ("model", "trained", "average"):  # the blend load_for_eval scores, the weights, the average
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    assert all(not torch.equal(a["model"][n], a["average"][n]) for n in a["average"] if n.endswith("c_q.weight"))
    rows = ledger.read(tmp_path / "ledger.csv")
    assert rows[0]["val_bpb"] == rows[2]["val_bpb"] != ""


@pytest.mark.xla
def test_all_on_xla_compiles_the_graphs_of_the_ema_alone(tmp_path, builtin_1024):
    """MTP weights that fade to 0 after the first steps (optim.mtp_until tiny), the average's update on every
    other step and the prewarm's, the blend's swap in and out: data, not new graphs."""
    levers = ("optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.00002,0.00001]", *ALL_ON[2:], "run.log_every=2")
    run(smoke_args(tmp_path, "device.type=xla", *levers, "budget.max_steps=8"))
    long, = ledger.read(tmp_path / "ledger.csv")
    # The swap's, as optim.ema's; cumulative over the 8 steps (the weights' fade among them), so over any shorter run.
    assert int(long["xla_compiles"]) == XLA_GRAPHS + 1
    assert float(long["train_s"]) / float(long["budget_s"]) > 0.00002  # its last steps ran with the weights at 0


def test_all_on_compiled_traces_one_train_and_one_eval_graph(tmp_path, builtin_1024):
    levers = ("optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.00002,0.00001]", *ALL_ON[2:])
    run(smoke_args(tmp_path, "device.compile=true", *levers, "budget.max_steps=6"))
    row, = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "ok" and note(row, "compiled_graphs") == "2"


@pytest.mark.parametrize("overrides, message", [
    (["optim.mtp_weights=[0.5]"], "optim.mtp_until: expected one progress per optim.mtp_weights entry (1), decreasing "
                                  "(the farthest target fades first), got []"),
    (["optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.2,0.45]"], "got [0.2, 0.45]"),
    (["optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.3,0.3]"], "decreasing (the farthest target fades first)"),
    (["optim.mtp_weights=[1]", "optim.mtp_until=[0]"], "optim.mtp_until: expected a list of numbers in (0, 1], got (0,)"),
    (["optim.mtp_until=[1.5]"], "optim.mtp_until: expected a list of numbers in (0, 1], got (1.5,)"),
    (["optim.mtp_weights=[-1]"], "optim.mtp_weights: expected a list of numbers >= 0, got (-1,)"),
    (["optim.mtp_weights=[true]"], "optim.mtp_weights: expected a list of numbers >= 0, got (True,)"),
    (["optim.mtp_weights=0.5"], "optim.mtp_weights: expected tuple, got 0.5"),
    (["optim.ema_every=0"], "optim.ema_every: expected > 0, got 0"),
    (["optim.ema_blend=1.5"], "optim.ema_blend: expected in [0, 1], got 1.5"),
    (["optim.ema_prewarm=2"], "optim.ema_prewarm: expected bool, got 2"),
    (["optim.mask_bos_targets=maybe"], "optim.mask_bos_targets: expected bool, got 'maybe'"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, overrides)
    assert message in str(e.value)


def test_masking_bos_targets_without_a_bos_token_is_a_clear_error(tmp_path, builtin_1024, monkeypatch, capsys):
    table = train.data.ByteTable.__init__

    def without_bos(self, path):
        table(self, path)
        self.bos_id = -1
    monkeypatch.setattr(train.data.ByteTable, "__init__", without_bos)
    args = ["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'l.csv'}",
            f"run.out_dir={tmp_path}", "optim.mask_bos_targets=true"]
    assert train.main(args) == 2
    assert "optim.mask_bos_targets: need a BOS token (it starts each document);" in capsys.readouterr().err
