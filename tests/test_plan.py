"""train.py --plan: a run's plan from its config alone. Its parameters, active parameters and FLOPs are those
of the built model, its graph count the one the XLA tests measure, its memory the estimate check_memory uses;
a bad config or a world size that does not split the batch exits 2 naming the key. On trn2 (device.type neuron or xla)
without WORLD_SIZE it plans both launch shapes the kit allows. configs/trn2.yaml trains on XLA (CPU backend) at its full
model shape and compiles the graphs its plan says; under the chip clock its plan takes the chip's steps."""
import dataclasses
import math
from pathlib import Path

import pytest
import torch

import clock
import ledger
import train
from config import accum_steps, load_config, resolve_stages
from model import GPT, active_params, flops_per_token, param_count
from test_backends import XLA_GRAPHS, run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def parse(text: str) -> dict:
    """Plan lines -> {first key of the line ("plan", "stage:0", "memory_per_rank", ...): {key: value}}."""
    table = {}
    for line in text.strip().splitlines():
        pairs = dict(token.split(":", 1) for token in line.split() if ":" in token)
        head = line.split()[0]
        table[head if head.startswith("stage:") else head.split(":")[0]] = pairs
    return table


def plan(capsys, monkeypatch, config, *overrides, world="1", lnc="2") -> dict:
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    assert train.main(["--config", str(config), "--plan", *overrides]) == 0
    return parse(capsys.readouterr().out)


@pytest.mark.parametrize("name,graphs", [
    ("cpu_sp1024.yaml", XLA_GRAPHS),
    ("cpu_windows256.yaml", XLA_GRAPHS + 2),  # the kit's protocol: load_for_eval's model's scalar buffers, then its rows
    ("cpu.yaml", XLA_GRAPHS + 6),  # and the batch ramp's three later stages' steady steps, optim.ema's swap
    # The first step, each of three stages' steady steps, the first step of the stage that adds layers, eval, the kit's.
    ("aion.yaml", XLA_GRAPHS + 5),
    ("trn2.yaml", XLA_GRAPHS + 6),  # as cpu.yaml: the same recipe (the lineage's K82s4) at the chip's shape
])
def test_the_plan_has_the_built_models_numbers(capsys, monkeypatch, name, graphs):
    table = plan(capsys, monkeypatch, CONFIGS / name)
    cfg = load_config(CONFIGS / name)
    stages = resolve_stages(cfg)
    model = GPT(cfg.model, cfg.mod, passes=max(s.recur for s in stages), recur_gate=cfg.schedule.recur_gate,
                seq_len=cfg.data.seq_len)
    head = table["plan"]
    assert int(head["params"]) == param_count(model)
    assert int(head["tokens_per_step"]) == int(head["tokens_per_rank"]) == cfg.optim.batch_tokens
    assert int(head["accum_steps"]) == cfg.optim.batch_tokens // (cfg.optim.micro_batch * cfg.data.seq_len)
    assert int(head["xla_graphs"]) == graphs == train.xla_graphs(cfg, stages, accum_steps(cfg, 1))
    assert len([key for key in table if key.startswith("stage:")]) == len(stages)
    for i, stage in enumerate(stages):
        row = table[f"stage:{i}"]
        train.set_stage(model, cfg, stage)
        flops = flops_per_token(cfg.model, stage.seq_len, dataclasses.replace(cfg.mod, capacity=stage.capacity),
                                model.active, stage.mlp_hidden, stage.loop_layers, stage.recur)
        assert int(row["active_params"]) == active_params(model)
        assert int(row["flops_per_token"]) == round(flops)
        assert (int(row["depth"]), int(row["seq_len"])) == (stage.depth, stage.seq_len)
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device.type == "auto" else cfg.device.type
    dtype = train.compute_dtype(cfg.device, kind, kind in ("xla", "neuron"))
    need = train.memory_estimate(cfg, dtype == torch.bfloat16 and cfg.device.bf16 == "weights")[0]
    assert table["memory_per_rank"]["memory_per_rank"] == f"{need / 2**30:.2f}GiB"
    if kind == "cpu":
        assert "peak" in table and "hbm_per_rank" not in table["memory_per_rank"]


def test_trn2_is_planned_per_rank_against_its_hbm_and_datasheet_peak(capsys, monkeypatch):
    cfg = load_config(CONFIGS / "trn2.yaml")
    need = train.memory_estimate(cfg, False)[0]  # bfloat16 autocast on the native device
    for lnc, world, hbm, peak in (("2", "4", 24, 667e12 / 4), ("1", "8", 12, 667e12 / 8)):
        table = plan(capsys, monkeypatch, CONFIGS / "trn2.yaml", world=world, lnc=lnc)
        head, stage, memory = table["plan"], table["stage:0"], table["memory_per_rank"]
        rank_tokens = cfg.optim.batch_tokens // int(world)
        assert (head["target"], head["dtype"], head["world_size"]) == (f"trn2-lnc{lnc}", "bfloat16", world)
        assert int(head["tokens_per_rank"]) == int(stage["tokens_per_rank"]) == rank_tokens
        assert int(head["accum_steps"]) == rank_tokens // (cfg.optim.micro_batch * cfg.data.seq_len)
        assert table["peak_flops_per_rank"]["peak_flops_per_rank"] == f"{peak:.4g}"
        assert stage["step_s_at_40pct_mfu"] == f"{int(stage['flops_per_token']) * rank_tokens / (0.4 * peak):.4f}"
        assert (memory["hbm_per_rank"], memory["margin"]) == (f"{hbm}GiB", f"{(hbm * 2**30 - need) / 2**30:.2f}GiB")


def test_trn2_is_planned_for_both_launch_shapes_the_kit_allows(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train.main(["--config", str(CONFIGS / "trn2.yaml"), "--plan"]) == 0
    out = capsys.readouterr().out
    heads = [dict(t.split(":", 1) for t in line.split()[1:] if ":" in t) for line in out.splitlines() if line.startswith("plan ")]
    assert [(h["target"], h["world_size"]) for h in heads] == [("trn2-lnc1", "8"), ("trn2-lnc2", "4")]
    for lnc, world in (("1", "8"), ("2", "4")):
        assert (f"launch: NEURON_LOGICAL_NC_CONFIG={lnc} torchrun --standalone --nproc_per_node={world} train.py "
                f"--config {CONFIGS / 'trn2.yaml'}") in out


def test_the_plan_reads_no_data_and_writes_nothing(capsys, monkeypatch, tmp_path):
    """The shards and the tokenizer it names do not exist; no run folder, ledger or corpus appears."""
    overrides = (f"data.path={tmp_path / 'shards'}", f"data.tokenizer={tmp_path / 'none.model'}",
                 f"ledger.path={tmp_path / 'ledger.csv'}", f"run.out_dir={tmp_path / 'runs'}")
    assert int(plan(capsys, monkeypatch, CONFIGS / "trn2.yaml", *overrides)["plan"]["params"]) > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides,world,message", [
    (["model.n_layers=3"], "1", "unknown key model.n_layers; did you mean model.n_layer?"),
    (["model.xsa_layers=11"], "1", "model.xsa_layers: expected 0..9"),
    ([], "3", "optim.batch_tokens (262144) must be a multiple of optim.micro_batch * data.seq_len * WORLD_SIZE "
              "(8 * 1024 * 3)"),
])
def test_a_bad_config_or_world_size_stops_the_plan_with_exit_2(capsys, monkeypatch, overrides, world, message):
    monkeypatch.setenv("WORLD_SIZE", world)
    assert train.main(["--config", str(CONFIGS / "trn2.yaml"), "--plan", *overrides]) == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == ""


def test_trn2_yaml_under_the_chip_clock_takes_the_chips_steps(capsys, monkeypatch):
    """sweeps/trn2_chip/calibration-trn2.json (K59's step seconds on the chip: 0.296835, 0.510163, 0.934132 at 1, 2, 4
    micro-batches of 65,536 tokens) against 1,795 s, the kit's 5 startup steps free: 15 full-batch steps (14.012 s) to the
    20th, then 316 quarter-batch steps to 107.81 s >= 6 % (step 336), 493 half-batch steps to 359.32 s >= 20 % (step
    829), 1,537 full ones to 1,795.06 s: 2,366 steps. Their phase switches on the chip: steps 336 and 829 (K60); their
    ends: 2,361 (K60, 1,793 s) and 2,390 (K82s4, its step about 1 % faster)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert train.main(["--config", str(CONFIGS / "trn2.yaml"), "--plan", "budget.clock=calibrated",
                       f"budget.calibration={ROOT / 'sweeps' / 'trn2_chip' / 'calibration-trn2.json'}"]) == 0
    out = capsys.readouterr().out
    predicted = parse(out)["clock"]
    assert (predicted["stage_first_steps"], predicted["steps"], predicted["train_s"]) == ("0@0,1@20,2@336,3@829", "2366",
                                                                                          "1795.1")
    line = out.splitlines()[-1]
    assert "made elsewhere, not measured here: FrontierForge's chip logs" in line and clock.ASSUMED in line


@pytest.mark.xla
@pytest.mark.slow  # a full-size model compiled (tests/README.md)
def test_trn2_yaml_trains_on_xla_at_full_shape_with_the_planned_graphs(capsys, monkeypatch, tmp_path, builtin_1024,
                                                                      xla_level_2):
    """Its 9 x 1024 model at rows of 1,024 for 2 optimizer steps of one row, on the built-in corpus with the kit's kind of
    tokenizer, on the PyTorch-XLA path (README: device.type=xla device.bf16=weights; AION's charge: a one-process run on
    a CPU is no launch the kit scores); one static stage (2 steps never leave the batch ramp's first)."""
    small = ["data.source=builtin", f"data.path={ROOT / 'data' / 'builtin'}", "data.tokenizer=", "device.type=xla",
             "device.bf16=weights", "budget.charge=aion", "optim.batch_tokens=2048", "optim.micro_batch=1",
             "schedule.stages=[]", "eval.tokens=2048", "eval.batch_size=1", "eval.kit_tokens=2048", "budget.max_steps=2",
             "run.profile_steps=0", "checkpoint.every_seconds=0", f"ledger.path={tmp_path / 'ledger.csv'}",
             f"run.out_dir={tmp_path / 'runs'}"]
    table = plan(capsys, monkeypatch, CONFIGS / "trn2.yaml", *small)
    run(["--config", str(CONFIGS / "trn2.yaml"), *small])
    row, = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "ok" and row["steps"] == "2" and math.isfinite(float(row["val_bpb"]))
    assert row["params"] == table["plan"]["params"] and row["active_params"] == table["stage:0"]["active_params"]
    assert int(row["xla_compiles"]) == int(table["plan"]["xla_graphs"]) == XLA_GRAPHS + 3  # the kit's protocol, the EMA
    assert math.isfinite(float(row["kit_val_bpb"]))
