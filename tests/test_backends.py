"""Backends and processes: torch-xla on its CPU backend (the lazy-tensor engine Trainium uses),
torchrun data parallel over gloo, the bf16-weights policy, the auto dtype, precompilation, the MFU
peak table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ledger
import train
from config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
XLA_GRAPHS = 3  # the first train step (it also creates the optimizer state), the steady train step, eval


def smoke_args(tmp_path, *extra):
    return ["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}",
            f"ledger.path={tmp_path / 'ledger.csv'}", f"run.out_dir={tmp_path / 'runs'}", *extra]


def run(args, launcher=(sys.executable, str(ROOT / "train.py"))):
    """train.py in a fresh process (torch-xla state and process groups are per process)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def note(row, key):
    return next(part.split("=")[1].split()[0] for part in row["notes"].split("; ") if key + "=" in part)


@pytest.mark.xla
def test_xla_compiles_a_fixed_set_of_graphs_and_reads_only_at_log_steps(tmp_path, builtin_1024):
    # With warmup the first steps run at LR 0 (progress 0) and later ones do not; that adds no graph.
    run(smoke_args(tmp_path, "device.type=xla", "budget.max_steps=4", "run.log_every=2", "optim.warmup=0.5"))
    run(smoke_args(tmp_path, "device.type=xla", "budget.max_steps=8", "run.log_every=2"))
    run(smoke_args(tmp_path, "budget.max_steps=8", "run.log_every=2"))  # eager CPU, the reference
    short, long, eager = ledger.read(tmp_path / "ledger.csv")
    assert int(short["xla_compiles"]) == int(long["xla_compiles"]) == XLA_GRAPHS  # not growing with steps
    assert eager["xla_compiles"] == ""
    # Twice the steps cost exactly two more device->host reads: the two extra log lines.
    assert int(note(long, "xla_transfers")) - int(note(short, "xla_transfers")) == 2
    # The same numbers as eager execution, up to float summation order.
    assert float(long["val_bpb"]) == pytest.approx(float(eager["val_bpb"]), rel=1e-4)
    assert (long["val_tokens"], long["val_bytes"]) == (eager["val_tokens"], eager["val_bytes"])


@pytest.mark.xla
def test_xla_block_routing_compiles_no_new_graph_when_the_tokens_change(tmp_path, builtin_1024):
    """Every step reads different tokens; top-k, gather and scatter keep one static shape."""
    routed = ("device.type=xla", "mod.granularity=block", "mod.layers=[1]", "mod.block_size=16")
    run(smoke_args(tmp_path, *routed, "budget.max_steps=8"))
    row, = ledger.read(tmp_path / "ledger.csv")
    # One more than dense: reading the evaluation's agreement counters after the last eval batch. The count is
    # cumulative and the fewest graphs a routed run needs, so none of the 8 steps added one (a shorter run's steps are
    # the first of these: one run stands for every length).
    assert int(row["xla_compiles"]) == XLA_GRAPHS + 1
    assert 0 <= float(note(row, "routing_agreement")) <= 1


COUNTERS = ("import json, sys, train, torch_xla.debug.metrics as met; code = train.main(sys.argv[1:]); "
            "print('COUNTERS', json.dumps({k: met.counter_value(k) for k in met.counter_names()})); sys.exit(code)")


@pytest.mark.xla
def test_precompile_runs_every_graph_of_the_timed_run(tmp_path, builtin_1024):
    cache = f"device.compile_cache={tmp_path / 'xla_cache'}"
    launcher = (sys.executable, "-c", COUNTERS)
    out = run(smoke_args(tmp_path, "device.type=xla", cache, "run.precompile=true"), launcher)
    assert f"xla_compiles:{XLA_GRAPHS}" in out
    assert not (tmp_path / "ledger.csv").exists()  # a precompile run is not a run
    counters = json.loads(run(smoke_args(tmp_path, "device.type=xla", cache), launcher).split("COUNTERS ")[1])
    # Every graph of the timed run was found in the cache the precompile run filled. (On CPU the
    # found executable cannot be deserialized, so it is compiled again; Neuron caches NEFFs.)
    assert counters.get("PersistentCacheMiss", 0) == 0
    assert counters.get("PersistentCacheHit", 0) + counters.get("PersistentCacheDeserializeFailure", 0) == XLA_GRAPHS


def test_compile_matches_eager_and_traces_a_fixed_set_of_graphs(tmp_path, builtin_1024):
    """device.compile: the same run as eager up to float summation order, one train graph and one
    eval graph whatever the length, and the first step's compile kept out of the budget."""
    run(smoke_args(tmp_path, "device.compile=true", "budget.max_steps=8"))
    run(smoke_args(tmp_path, "budget.max_steps=8"))
    long, eager = ledger.read(tmp_path / "ledger.csv")
    # Cumulative over the run and the fewest it can have (one train graph, one eval graph): no step added one.
    assert note(long, "compiled_graphs") == "2"
    assert "compiled_graphs" not in eager["notes"]
    assert float(long["val_bpb"]) == pytest.approx(float(eager["val_bpb"]), rel=1e-4)
    assert (long["val_tokens"], long["val_bytes"]) == (eager["val_tokens"], eager["val_bytes"])
    assert float(long["compile_s"]) > float(eager["compile_s"])  # tracing and code generation, not budget


def test_compiled_layer_routing_traces_one_graph_per_phase_of_its_rotation(tmp_path, builtin_1024):
    """Capacity 1/2 repeats every 2 micro-batches, so a step of 2 covers both phases: 2 train graphs
    and the eval graph, and none more as the micro-batch index grows."""
    routed = ("device.compile=true", "mod.granularity=layer", "mod.layers=[1]", "mod.capacity=0.5")
    run(smoke_args(tmp_path, *routed, "budget.max_steps=9"))
    row, = ledger.read(tmp_path / "ledger.csv")
    assert note(row, "compiled_graphs") == "3"  # cumulative over the 9 steps, so over any shorter run too


@pytest.mark.xla
def test_compile_is_ignored_on_xla(tmp_path, builtin_1024):
    out = run(smoke_args(tmp_path, "device.type=xla", "device.compile=true", "budget.max_steps=2"))
    assert "compile:ignored (xla: the step is one graph already)" in out
    row, = ledger.read(tmp_path / "ledger.csv")
    assert int(row["xla_compiles"]) == XLA_GRAPHS and "compiled_graphs" not in row["notes"]


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(tmp_path, builtin_1024):
    """Same global batch (512 tokens): 1 process x 2 micro-batches vs 2 ranks x 1, same tokens."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(ROOT / "train.py"))
    run(smoke_args(tmp_path, "run.log_every=8"))
    out = run(smoke_args(tmp_path, "run.log_every=8"), torchrun)
    one, two = ledger.read(tmp_path / "ledger.csv")  # rank 0 alone writes: one row per run
    assert (one["world_size"], two["world_size"]) == ("1", "2")
    # Sharded evaluation sums to the same targets and bytes; the losses agree to reduction order.
    assert (one["val_tokens"], one["val_bytes"]) == (two["val_tokens"], two["val_bytes"])
    assert float(two["val_bpb"]) == pytest.approx(float(one["val_bpb"]), rel=1e-4)
    loss = float(out.split("step:8 loss:")[1].split()[0])
    one_log = next((tmp_path / "runs").glob(f"{one['run_id']}/log.txt")).read_text()
    assert loss == pytest.approx(float(one_log.split("step:8 loss:")[1].split()[0]), rel=1e-4)
    assert out.count("step:8 loss:") == 1  # rank 0 alone logs


def test_bf16_weights_keep_fp32_masters(tmp_path, builtin_1024):
    cfg = load_config(SMOKE, smoke_args(tmp_path, "device.dtype=bfloat16", "device.bf16=weights")[2:])
    trainer = train.Trainer(cfg)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    optimized = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
    assert len(optimized) == len(trainer.masters) and all(p.dtype == torch.float32 for p in optimized)
    for _ in range(2):
        trainer.step(0.0)
        trainer.inputs = trainer.fetch()
    for p, master in trainer.masters.items():
        assert torch.equal(p, master.bfloat16())
    assert all(v.dtype == torch.float32 for k, v in trainer.state()["model"].items() if "inv_freq" not in k)
    trainer.loader.close()


@pytest.mark.parametrize("avx512_bf16,amx,dtype", [(False, False, torch.float32), (True, False, torch.bfloat16),
                                                    (False, True, torch.bfloat16)])
def test_auto_dtype_is_bfloat16_only_on_cpus_with_native_bf16_matmuls(monkeypatch, tmp_path, avx512_bf16, amx, dtype):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    backend = train.Backend(load_config(SMOKE, ["device.type=cpu", "device.dtype=auto"]).device)
    assert backend.dtype == dtype and backend.attn_float32 == (dtype == torch.bfloat16)
    if avx512_bf16:  # the ledger row says what auto chose
        assert train.main(smoke_args(tmp_path, "device.dtype=auto", "budget.max_steps=1")) == 0
        assert "dtype=bfloat16 (auto), attention float32" in ledger.read(tmp_path / "ledger.csv")[-1]["notes"]


@pytest.mark.parametrize("dtype,attn_dtype,float32_core", [("bfloat16", "compute", False), ("float32", "float32", False),
                                                           ("bfloat16", "float32", True)])
def test_attention_dtype_choice(dtype, attn_dtype, float32_core):
    backend = train.Backend(load_config(SMOKE, ["device.type=cpu", f"device.dtype={dtype}",
                                                f"device.attn_dtype={attn_dtype}"]).device)
    assert backend.attn_float32 == float32_core


def test_missing_backends_are_clear_errors(tmp_path, capsys):
    assert train.main(smoke_args(tmp_path, "device.type=neuron")) == 2
    assert "device.type=neuron needs the native TorchNeuron backend" in capsys.readouterr().err
    assert train.main(smoke_args(tmp_path, "device.compile_cache=/tmp/c")) == 2
    assert "device.compile_cache is for device.type=xla" in capsys.readouterr().err


@pytest.mark.parametrize("lnc,dtype,peak", [("1", torch.bfloat16, 667e12 / 8), ("2", torch.bfloat16, 667e12 / 4),
                                            ("2", torch.float32, 181e12 / 4)])
def test_trainium_mfu_peak_comes_from_the_table(monkeypatch, lnc, dtype, peak):
    backend = train.Backend(load_config(SMOKE).device)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    backend.on_trainium, backend.dtype = True, dtype
    assert backend.peak_flops() == (peak, f"trn2-lnc{lnc} datasheet")


def test_compile_puts_the_thread_count_in_inductors_cache_key(monkeypatch):
    """Inductor's CPU kernels keep the OpenMP thread count they were generated for, and its graph cache does not key
    on the count, so a graph cached by a one-thread run would run serial in a two-thread one. Backend.compile sets
    the count in inductor's config, which the cache key covers: another count, another key."""
    monkeypatch.setattr(torch._inductor.config.cpp, "threads", -1)
    backend = train.Backend(load_config(SMOKE).device)
    backend.compile(torch.sin)
    assert torch._inductor.config.cpp.threads == torch.get_num_threads()
    keys = []
    for threads in (1, 2):
        monkeypatch.setattr(torch._inductor.config.cpp, "threads", threads)
        keys.append(torch._inductor.config.save_config_portable())
    assert keys[0] != keys[1] and keys[0]["cpp.threads"] == 1
