"""The experiment workflow: recipes, arms and verdicts, learning curves, sweeps (kill and resume),
ablations and plots."""
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import config
import ledger
import sweep
import train

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def perturbed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1 if value != -1 else 0  # -1 (an "off" or "same as" marker) is its own 2x + 1
    if isinstance(value, str):
        return value + "x"
    return tuple(value) + (1,)


def test_recipe_ignores_exactly_the_fields_that_do_not_change_learning():
    flat = config.flatten(dataclasses.asdict(config.load_config(SMOKE)))
    assert config.RECIPE_IGNORED <= set(flat)  # no stale names
    base = config.recipe(flat, "data-a")
    for key, value in flat.items():
        changed = config.recipe({**flat, key: perturbed(value)}, "data-a") != base
        assert changed == (key not in config.RECIPE_IGNORED), key
    assert config.recipe(flat, "data-b") != base  # other data, other recipe


# Runs in ledger.csv whose recipe today's configs must still give: (run id, overrides on top of the row's own).
# Rows recorded before configs/cpu.yaml (now configs/cpu_sp1024.yaml) turned value embeddings and the bigram table on get them off again;
# every one of them had cpu.yaml's heads before issue 27 (4 of 24, 2 KV heads).
OLD_HEADS = ("model.n_head=4", "model.n_kv_head=2")
OLD_CPU = ("model.value_embed=false", "model.bigram_buckets=0")
RECORDED = [("cpu-20261201-152908-fa5f", ()), ("mod-20261201-153204-3f75", ()), ("cpu-20261201-132541-d1b7", ()),
            ("cpu-20261201-131516-1a69", OLD_CPU), ("anneal-20261201-060817-7f56", OLD_CPU),
            ("mod-20261201-155929-e170", ()), ("cpu-20261201-124355-f8c1", OLD_CPU),
            ("cpu-20261201-141925-f52f", OLD_CPU)]


def on_sp1024(path: Path, tmp_path: Path) -> Path:
    """A config recorded when configs/cpu.yaml was today's configs/cpu_sp1024.yaml, rebased onto that file (the
    configs based on it then are based on configs/cpu_windows256.yaml today)."""
    if path.name == "cpu.yaml":
        return ROOT / "configs" / "cpu_sp1024.yaml"
    copy = tmp_path / path.name
    copy.write_text(path.read_text().replace("base: cpu_windows256.yaml", f"base: {ROOT / 'configs' / 'cpu_sp1024.yaml'}"))
    return copy


@pytest.mark.parametrize("run_id, extra", RECORDED)
def test_recipes_recorded_in_the_ledger_are_unchanged(tmp_path, run_id, extra):
    (row,) = [r for r in ledger.read(ROOT / "ledger.csv") if r["run_id"] == run_id]
    cfg = config.load_config(on_sp1024(ROOT / row["config"], tmp_path), [*OLD_HEADS, *row["overrides"].split(), *extra])
    assert config.recipe(config.flatten(dataclasses.asdict(cfg)), row["data_sha"]) == row["recipe"]


def test_verdict_on_synthetic_arms():
    win = ledger.verdict([1.50, 1.51, 1.49, 1.505], [1.40, 1.41, 1.39, 1.395], higher_is_better=False)
    assert win["verdict"] == "keep" and win["p"] < 0.001
    assert win["diff"] == pytest.approx(-0.1025) and win["low"] < -0.1025 < win["high"] < 0
    loss = ledger.verdict([1.40, 1.41, 1.39, 1.395], [1.50, 1.51, 1.49, 1.505], higher_is_better=False)
    assert loss["verdict"] == "revert" and loss["p"] == pytest.approx(win["p"])
    noise = ledger.verdict([1.50, 1.52, 1.48], [1.51, 1.50, 1.52], higher_is_better=False)
    assert noise["verdict"] == "inconclusive" and noise["p"] > 0.3 and noise["low"] < 0 < noise["high"]
    assert noise["seeds"] > 3  # more seeds would be needed to tell a difference this small
    faster = ledger.verdict([100.0, 101.0, 99.0], [120.0, 121.0, 119.0], higher_is_better=True)
    assert faster["verdict"] == "keep"
    single = ledger.verdict([1.5], [1.4], higher_is_better=False)
    assert single["verdict"] == "inconclusive" and math.isnan(single["p"])
    # The textbook case: an effect of one standard deviation needs 17 runs per arm for 80 % power.
    assert ledger.seeds_needed(1.0, 1.0) == 17 and ledger.seeds_needed(0.0, 1.0) is None


def test_arms_are_named_by_recipe_variant_config_run_id_or_notes():
    rows = [dict(run_id=f"cpu-{i}", config="configs/cpu.yaml", recipe="r1" if i < 2 else "r2", sweep="s",
                 variant="v" if i < 2 else "w", notes="tag-a" if i % 2 else "", status="ok", val_bpb="1.5")
            for i in range(4)]
    rows.append(dict(rows[0], run_id="cpu-9", status="failed", val_bpb=""))
    assert ledger.arm(rows, "r2") == ("recipe", rows[2:4])
    assert ledger.arm(rows, "s/v") == ("sweep/variant", rows[:2])
    assert ledger.arm(rows, "cpu-3") == ("run id prefix", [rows[3]])
    with pytest.raises(ledger.LedgerError, match="no ok run"):
        ledger.arm(rows, "cpu-9")  # failed runs belong to no arm
    for key in ("tag-a", "cpu-", "other.yaml"):  # an arm is one recipe, never a mix
        rows_here = [dict(r, config="other.yaml") for r in rows] if key == "other.yaml" else rows  # a config with no file
        with pytest.raises(ledger.LedgerError, match=f"arm '{key}' .* matches ok runs of 2 recipes; an arm must be one "
                                                     f"recipe") as e:
            ledger.arm(rows_here, key)
        assert "\n  r1: " in str(e.value) and "\n  r2: " in str(e.value)
    for key in ("cpu", "configs/cpu.yaml"):  # a config file: its recipe now, which none of these runs has
        with pytest.raises(ledger.LedgerError, match=r"no ok run of the recipe .*configs/cpu.yaml has now"):
            ledger.arm(rows, key)


def test_a_config_arm_is_the_recipe_the_file_has_now(tmp_path, capsys):
    now = config.recipe(config.flatten(dataclasses.asdict(config.load_config(SMOKE))), "d1")
    rows = [dict(time=f"2026-01-0{i}", run_id=f"smoke-{i}", config="configs/smoke.yaml", data_sha="d1",
                 recipe="old" if i < 3 else now, budget_s="300", overrides="", status="ok", val_bpb=str(2 - i / 10),
                 tokens_per_s="100")
            for i in range(1, 6)]
    assert ledger.arm(rows, "smoke") == ("config", rows[2:])  # the older recipe is left out
    elsewhere = dict(rows[-1], run_id="cpu-6", config="configs/cpu.yaml", overrides="a=b")  # recorded under another config
    assert ledger.arm(rows + [elsewhere], "configs/smoke.yaml") == ("config", rows[2:] + [elsewhere])
    others = [dict(r, recipe="r3", overrides="model.n_layer=3 optim.muon_lr=0.1") for r in rows[:2]]
    with pytest.raises(ledger.LedgerError, match=rf"no ok run of the recipe .*smoke.yaml has now \({now}\); the closest "
                                                 rf"recipes:\n  old: 2 runs.*; differs in no config key \(another corpus.*\n  r3: 2 runs.*differs in "
                                                 rf"model.n_layer, optim.muon_lr"):
        ledger.arm(rows[:2] + others, "smoke")
    short = [dict(r, run_id=f"s-{r['run_id']}", recipe="short", budget_s="150", notes="short") for r in rows]
    with pytest.raises(ledger.LedgerError, match="arm 'smoke' ran with a budget of 300 s, arm 'short' with 150 s: "
                                                 "a verdict compares equal budgets, or runs that all made the same steps"):
        ledger.print_verdict([dict(r, steps="100") for r in rows] + [dict(r, steps="90") for r in short], "smoke", "short")
    # Two programs' own time targets on one step-counting clock: every run made the same steps, so they are judged.
    ledger.print_verdict([dict(r, steps="100") for r in rows + short], "smoke", "short")
    assert "equal steps: every run of both arms made 100 steps (budgets 300 s and 150 s)" in capsys.readouterr().out
    ledger.print_verdict(rows + short, "smoke", "old")
    assert f"arm 'smoke': config, recipe {now}, budget 300 s, 3 ok runs" in capsys.readouterr().out


def smoke_args(tmp_path, *extra):
    return [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
            f"run.out_dir={tmp_path / 'runs'}", "budget.seconds=600", *extra]


def test_a_run_writes_its_learning_curve(tmp_path, builtin_1024):
    args = smoke_args(tmp_path, "eval.every_seconds=3600", "eval.curve_tokens=512", "budget.max_steps=6")
    assert train.main(["--config", str(SMOKE), *args]) == 0
    (row,) = ledger.read(tmp_path / "ledger.csv")
    records = ledger.read_metrics(tmp_path / "runs", row["run_id"])
    kinds = [r["kind"] for r in records]
    assert kinds == ["curve", "train", "train", "train", "final"]  # step 0, every log_every=2 steps, the end
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6]
    assert records[1]["tokens"] == 2 * 512 and all(math.isfinite(r["loss"]) for r in records[1:4])
    assert records[-1]["val_bpb"] == pytest.approx(float(row["val_bpb"]))
    assert 0 < records[0]["val_bpb"] and "curve_evals=1" in row["notes"]
    assert row["recipe"] == config.recipe(config.flatten(dataclasses.asdict(config.load_config(SMOKE, args))),
                                         row["data_sha"])


@pytest.mark.slow
def test_sweep_killed_after_its_first_run_resumes_with_the_missing_three(tmp_path, builtin_1024):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"name: tiny\nconfig: {SMOKE}\nseeds: [1, 2]\nbaseline: narrow\n"
                    f"overrides: [budget.max_steps=3, eval.tokens=1024, eval.every_seconds=3600, eval.curve_tokens=256]\n"
                    f"variants:\n  narrow: []\n  wide: [model.mlp_mult=3]\n")
    command = [sys.executable, str(ROOT / "sweep.py"), str(spec), *smoke_args(tmp_path)]
    first = subprocess.Popen(command, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    while len(ledger.read(tmp_path / "ledger.csv")) < 1:
        assert first.poll() is None, first.stdout.read()
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: to the sweep and its running train.py
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 128 + signal.SIGINT, out
    before = [r for r in ledger.read(tmp_path / "ledger.csv") if r["status"] == "ok"]
    assert len(before) == 1, out

    second = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "done_before:1 to_run_now:3" in second.stdout
    rows = [r for r in ledger.read(tmp_path / "ledger.csv") if r["status"] == "ok"]
    assert len(rows) == 4
    assert sorted((r["variant"], r["seed"]) for r in rows) == [("narrow", "1"), ("narrow", "2"), ("wide", "1"),
                                                                ("wide", "2")]
    assert len({r["recipe"] for r in rows}) == 2 and {r["sweep"] for r in rows} == {"tiny"}
    verdict = (tmp_path / "tiny" / "verdict.md").read_text()
    assert "| wide |" in verdict and "| narrow |" in verdict
    for plot in ("variants.png", "curves.png"):
        assert (tmp_path / "tiny" / plot).read_bytes()[:4] == b"\x89PNG"
    rows_before = len(ledger.read(tmp_path / "ledger.csv"))
    third = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "to_run_now:0" in third.stdout and len(ledger.read(tmp_path / "ledger.csv")) == rows_before


def test_ablation_switches_each_component_off(tmp_path, builtin_1024):
    every = tmp_path / "every.yaml"  # routing, annealing with copy growth, and compile (by cpu.yaml)
    every.write_text(f"base: {ROOT / 'configs' / 'anneal.yaml'}\nmod: {{granularity: block, layers: [1, 3], block_size: 64}}\n"
                     f"schedule: {{grow_init: copy}}\n")
    spec = sweep.ablation(str(every), [1])
    assert list(spec["variants"]) == ["full", "no-routing", "no-annealing", "no-depth", "no-mlp_hidden", "no-seq_len",
                                      "zero-growth", "no-compile"]
    assert spec["variants"]["zero-growth"] == ["schedule.grow_init=zero"]
    configs = sweep.Sweep(spec, [f"data.path={ROOT / 'data' / 'builtin'}"], nproc=1)
    assert len(set(configs.recipes.values())) == len(spec["variants"])
    resolved = {v: config.resolve_stages(cfg) for v, cfg in configs.configs.items()}
    full = resolved["full"]
    assert [s.depth for s in full] == [2, 3, 4] and len(resolved["no-annealing"]) == 1
    assert [s.depth for s in resolved["no-depth"]] == [4, 4, 4]
    assert [s.seq_len for s in resolved["no-depth"]] == [s.seq_len for s in full]
    assert [s.seq_len for s in resolved["no-seq_len"]] == [256, 256, 256]
    assert configs.configs["no-routing"].mod.granularity == "none"
    with pytest.raises(sweep.SweepError, match="no AION component"):
        sweep.ablation(str(SMOKE), [1])
    kernel = tmp_path / "kernel.yaml"
    kernel.write_text(f"base: {SMOKE}\nkernels: {{relu2: triton}}\n")  # a choice the ablation switches back
    assert sweep.ablation(str(kernel), [1])["variants"] == {"full": [], "kernel-relu2-torch": ["kernels.relu2=torch"]}
    compiled = tmp_path / "compiled.yaml"
    compiled.write_text(f"base: {SMOKE}\ndevice: {{compile: true}}\n")
    assert sweep.ablation(str(compiled), [1])["variants"] == {"full": [], "no-compile": ["device.compile=false"]}


def test_a_variant_may_start_from_another_config(tmp_path, builtin_1024):
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nconfig: {SMOKE}\nseeds: [1]\nvariants:\n  dense: []\n"
                    f"  mod: {{config: {ROOT / 'configs' / 'mod.yaml'}, overrides: [model.n_layer=2, 'mod.layers=[1]']}}\n")
    spec = sweep.load_sweep(path)
    assert spec["variants"] == {"dense": [], "mod": ["model.n_layer=2", "mod.layers=[1]"]}
    runs = sweep.Sweep(spec, [f"data.path={ROOT / 'data' / 'builtin'}"], nproc=1)
    command = runs.command("mod", 1)
    assert command[command.index("--config") + 1] == str(ROOT / "configs" / "mod.yaml")
    assert runs.configs["mod"].mod.granularity == "block" and runs.configs["dense"].mod.granularity == "none"
    path.write_text(f"name: s\nconfig: {SMOKE}\nseeds: [1]\nvariants:\n  mod: {{overrides: [a.b=1]}}\n")
    with pytest.raises(sweep.SweepError, match="variants.mod: expected a list of overrides or a mapping with config"):
        sweep.load_sweep(path)


@pytest.mark.parametrize("key, value, message", [
    ("variants", ["a", "b"], "variants: expected a mapping of name: [overrides], got ['a', 'b']"),
    ("seeds", [True], "seeds: expected a list of non-negative integers, got [True]"),
    ("baseline", ["a"], "baseline ['a'] is not a variant; expected one of a"),
])
def test_a_malformed_sweep_file_is_named_not_a_traceback(tmp_path, capsys, key, value, message):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "config": str(SMOKE), "seeds": [1], "variants": {"a": []}, key: value}))
    assert sweep.main([str(path), f"ledger.path={tmp_path / 'ledger.csv'}", f"run.out_dir={tmp_path / 'runs'}"]) == 2
    assert f"error: {path}: {message}" in capsys.readouterr().err


def test_plot_command_writes_pngs(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    rows = []
    for i, variant in enumerate(["a", "a", "b", "b"]):
        run_id = f"run-{i}"
        (runs / run_id).mkdir(parents=True)
        records = [dict(kind="train", step=s, train_s=s * 1.0, tokens=s * 100, stage=0, loss=5 - s * 0.1 - i * 0.01)
                   for s in range(1, 6)]
        records += [dict(kind="curve", step=s, train_s=s * 1.0, tokens=s * 100, stage=0, val_bpb=3 - s * 0.1)
                    for s in (0, 3)]
        (runs / run_id / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        rows.append(dict(time="t", run_id=run_id, config="c.yaml", status="ok", val_bpb=str(2.0 - i * 0.1),
                         tokens_per_s="100", sweep="s", variant=variant, recipe=variant))
    for row in rows:
        ledger.append(tmp_path / "ledger.csv", row)
    for i, args in enumerate((["curves", "s/a", "s/b"], ["variants", "s"], ["curves", "s/a", "--val-only"])):
        out = tmp_path / f"plot{i}.png"
        assert ledger.main(["plot", *args, "--out", str(out), "--runs-dir", str(runs),
                            "--path", str(tmp_path / "ledger.csv")]) == 0
        assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    (runs / "run-4").mkdir()  # training losses only (eval.every_seconds=0): no empty row of val_bpb panels
    (runs / "run-4" / "metrics.jsonl").write_text("".join(json.dumps(dict(kind="train", step=s, train_s=s * 1.0,
                                                                          tokens=s * 100, stage=0, loss=5.0)) + "\n"
                                                          for s in range(1, 6)))
    ledger.append(tmp_path / "ledger.csv", dict(rows[0], run_id="run-4", variant="c", recipe="c"))
    assert ledger.main(["plot", "curves", "s/c", "--out", str(tmp_path / "plot3.png"), "--runs-dir", str(runs),
                        "--path", str(tmp_path / "ledger.csv")]) == 0
    height = [int.from_bytes((tmp_path / f"plot{i}.png").read_bytes()[20:24], "big") for i in (0, 2, 3)]  # PNG header
    assert height == [800, 400, 400]  # train loss and val_bpb; val_bpb's row alone; train loss's alone
    drawn = {}  # LABEL=ARM: the arm's runs under the label (a config's name in a figure, not a sweep's)
    monkeypatch.setattr(ledger, "plot_curves", lambda arms, out, runs_dir, val_only: drawn.update(arms))
    assert ledger.main(["plot", "curves", "configs/cpu.yaml=s/a", "s/b", "--out", str(tmp_path / "c.png"),
                        "--path", str(tmp_path / "ledger.csv")]) == 0
    assert {label: [r["run_id"] for r in rows] for label, rows in drawn.items()} == {
        "configs/cpu.yaml": ["run-0", "run-1"], "s/b": ["run-2", "run-3"]}
    drawn.clear()  # ARM+ARM: the runs of each, under one label (one recipe's runs that no one key names)
    assert ledger.main(["plot", "curves", "one=s/a+run-3", "--out", str(tmp_path / "c.png"),
                        "--path", str(tmp_path / "ledger.csv")]) == 0
    assert {label: [r["run_id"] for r in rows] for label, rows in drawn.items()} == {"one": ["run-0", "run-1", "run-3"]}


def test_crossing_finds_where_curves_leave_their_final_order(tmp_path):
    """sweeps/crossing.py: arms by recipe, their seeds' curves averaged per bin of 60 s (a resumed run's later point
    kept), pairs out of their final order, the best three a keep-half pruner would cut; an arm without curves named."""
    curves = {("a", 1): [(0, 3.0), (60, 2.1), (120, 1.5)], ("a", 2): [(0, 3.0), (45, 2.5), (61, 1.9), (120, 1.5)],
              ("b", 1): [(0, 3.0), (60, 1.9), (120, 1.6)], ("c", 1): [(0, 3.0), (60, 2.5), (120, 1.7)], ("d", 1): None}
    final = {("a", 1): 0.9, ("a", 2): 1.1, ("b", 1): 1.1, ("c", 1): 1.2, ("d", 1): 1.3}
    for i, ((variant, seed), points) in enumerate(curves.items()):
        if points is not None:
            (tmp_path / "runs" / f"run-{i}").mkdir(parents=True)
            (tmp_path / "runs" / f"run-{i}" / "metrics.jsonl").write_text("".join(
                json.dumps(dict(kind="curve", train_s=t, val_bpb=v)) + "\n" for t, v in points))
        ledger.append(tmp_path / "ledger.csv", dict(run_id=f"run-{i}", status="ok", sweep="s", variant=variant,
                                                    recipe=variant, seed=str(seed), val_bpb=str(final[variant, seed])))
    out = subprocess.run([sys.executable, str(ROOT / "sweeps" / "crossing.py"), "s", "--ledger", str(tmp_path / "ledger.csv"),
                          "--runs", str(tmp_path / "runs")], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "left out, no curve points under " + str(tmp_path / "runs") + ": d"
    assert out.splitlines()[1] == "3 arms, final best three: a 1.0000, b 1.1000, c 1.2000"
    assert out.splitlines()[4:] == ["| 0 | 3 | 0 of 3 |  | none |", "| 60 | 3 | 1 of 3 | a > b | c |",
                                    "| 120 | 3 | 0 of 3 |  | c |"]
    out = subprocess.run([sys.executable, str(ROOT / "sweeps" / "crossing.py"), "s", "--seed", "2", "--ledger",
                          str(tmp_path / "ledger.csv"), "--runs", str(tmp_path / "runs")], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines()[0] == "1 arms, final best three: a 1.1000"  # seed 2's runs alone
    ledger.append(tmp_path / "ledger.csv", dict(run_id="run-5", status="ok", sweep="s2", variant="a", recipe="a2",
                                                seed="1", val_bpb="1.05"))  # another sweep's `a`: named by its sweep
    (tmp_path / "runs" / "run-5").mkdir()
    (tmp_path / "runs" / "run-5" / "metrics.jsonl").write_text(json.dumps(dict(kind="curve", train_s=60, val_bpb=2.0)))
    cmd = [sys.executable, str(ROOT / "sweeps" / "crossing.py"), "--ledger", str(tmp_path / "ledger.csv"),
           "--runs", str(tmp_path / "runs")]
    out = subprocess.run([*cmd, "s", "s2"], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[1] == "4 arms, final best three: s/a 1.0000, s2/a 1.0500, b 1.1000"
    assert out.splitlines()[5] == "| 60 | 4 | 2 of 6 | s/a > b; s2/a > b | none |"
    failed = subprocess.run([*cmd, "s", "nosuch"], capture_output=True, text=True)
    assert failed.returncode == 1 and "error: no ok rows of sweep nosuch in" in failed.stderr


def test_a_sweep_resumes_only_from_a_readable_checkpoint_of_the_variants_recipe(tmp_path, builtin_1024):
    spec = dict(name="t", config=str(SMOKE), seeds=[1], overrides=[], baseline="a", variants={"a": []},
                variant_configs={}, out=tmp_path / "t", ablation=False, clock="wall")
    runs = sweep.Sweep(spec, smoke_args(tmp_path), nproc=1)
    ckpt = runs.checkpoint("a", 1)
    ckpt.parent.mkdir(parents=True)

    def resumes():
        return f"checkpoint.resume={ckpt}" in runs.command("a", 1)

    ckpt.write_bytes(b"torn by a kill")
    assert not resumes()
    for extra, expected in (("model.mlp_mult=3", False), ("run.seed=1", True)):  # another recipe; the same one
        trainer = train.Trainer(config.load_config(SMOKE, smoke_args(tmp_path, extra)))
        train.save_checkpoint(ckpt, trainer.state())
        trainer.loader.close()
        assert resumes() == expected


def test_ablation_of_a_loop_and_the_records_items(tmp_path):
    looped = tmp_path / "looped.yaml"  # Mixture-of-Recursions only (no MoD layers), a gated loop, the records' items
    looped.write_text(f"base: {SMOKE}\nmodel: {{n_layer: 3, parallel_layers: 1, mlp: leaky_relu2}}\noptim: {{ema: 0.99}}\n"
                      "mod: {granularity: token, recur: true}\nschedule: {recur_gate: true, stages: "
                      "[{at: 0, seq_len: 32}, {at: 0.5, seq_len: 64, recur: 2, recur_span: [1, 2]}]}\n")
    spec = sweep.ablation(str(looped), [1])
    assert list(spec["variants"]) == ["full", "no-routing", "no-annealing", "no-recur", "no-seq_len", "no-recur-gate",
                                      "no-parallel", "no-ema", "relu2"]
    assert spec["variants"]["no-recur"][1:] == ["mod.recur=false", "mod.granularity=none"]
    for name, overrides in spec["variants"].items():  # every arm is a valid config
        cfg = config.load_config(looped, overrides)
        if name in ("no-routing", "no-annealing", "no-recur"):
            assert all(stage.recur == 1 for stage in config.resolve_stages(cfg)) or name == "no-routing"
            assert not cfg.mod.recur
