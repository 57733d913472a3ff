"""AION training script: config (config.py) -> backend -> data -> model -> optimizers -> annealing
stages -> timed loop -> eval -> ledger row and checkpoint. Read top to bottom; line cap 1200.

    python train.py --config configs/cpu.yaml [key.sub=value ...]
    torchrun --nproc_per_node N train.py --config ... (data parallel)

Rules kept here: no host sync inside the step (loss sums stay on the device and are read every
run.log_every steps); the LR is a function of progress p = elapsed / budget.seconds, never of a
step count; only this file touches devices, precision, signals and the file system of a run.
"""
import argparse
import dataclasses
import gzip
import hashlib
import itertools
import json
import math
import os
import random
import resource
import secrets
import signal
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

if str(Path(__file__).resolve().parent) not in sys.path:  # the kit's scorer imports this file by its path alone
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import clock
import data
import kernels
import kernels.profile
import kit
import ledger
from config import (BASE_CONFIG, ROOT, Config, ConfigError, DeviceConfig, accum_steps, build, depth_order, eval_rows,
                    eval_seq_len, flatten, load_chain, load_config, merge, recipe, resolve_stages, stage_for, stage_rows)
from model import GPT, TILED, active_params, flops_per_token, param_count, rotation_period, training_values
from optim import WeightAverage, lr_scale, make_optimizers, mtp_weights, muon_momentum


# ----------------------------------------------------------------------------------------------
# Device facts live here and nowhere else.


# Dense bf16 (and fp32) matmul FLOP/s per process, from the vendors' datasheets: the MFU
# denominator where the device is known. A trn2 chip has 8 NeuronCores (667 TFLOPS bf16, 181 fp32);
# one process drives one logical core: 1 physical core at LNC=1, 2 at LNC=2. Elsewhere: measured.
PEAK_FLOPS = {
    ("trn2-lnc1", torch.bfloat16): 667e12 / 8, ("trn2-lnc1", torch.float32): 181e12 / 8,
    ("trn2-lnc2", torch.bfloat16): 667e12 / 4, ("trn2-lnc2", torch.float32): 181e12 / 4,
    ("H100", torch.bfloat16): 989e12, ("H100", torch.float32): 67e12,  # SXM; fp32 without TF32
    ("H200", torch.bfloat16): 989e12, ("H200", torch.float32): 67e12,
}
HBM_BYTES = {"trn2-lnc1": 96 * 2**30 // 8, "trn2-lnc2": 96 * 2**30 // 4}  # a trn2 chip's 96 GiB over its logical cores


def logical_nc_config() -> str:  # the Neuron runtime's default: 2, 4 logical cores per chip
    return os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")


def peak_device(on_trainium: bool, accelerator: str, lnc: str) -> str:
    """The PEAK_FLOPS device: trn2 at NEURON_LOGICAL_NC_CONFIG `lnc` on Trainium, an H100 or H200 by name, or ""."""
    return f"trn2-lnc{lnc}" if on_trainium else next((n for n in ("H100", "H200") if n in accelerator), "")


def compute_dtype(cfg: DeviceConfig, kind: str, on_trainium: bool) -> torch.dtype:
    """device.dtype; auto: bfloat16 where matmuls run natively in it (accelerators; CPUs with AVX512-BF16
    or AMX), else float32: bfloat16 autocast ran 7.7x slower than float32 on an AVX2-only CPU (README)."""
    native_bf16 = kind in ("cuda", "neuron") or on_trainium or kind == "cpu" and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return (torch.bfloat16 if native_bf16 else torch.float32) if cfg.dtype == "auto" else getattr(torch, cfg.dtype)


class Backend:
    """Device facts in one place: which device, precision, the step boundary, waits, collectives,
    compile metrics and the MFU peak. Process facts (RANK, WORLD_SIZE) come from torchrun."""

    def __init__(self, cfg: DeviceConfig):
        self.rank, self.world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.type == "auto" else cfg.type
        self.xla, self.on_trainium = None, False
        if self.kind == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device.type=cuda but torch.cuda.is_available() is False")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        elif self.kind == "xla":
            try:
                import torch_xla
                import torch_xla.core.xla_model as xm
                import torch_xla.debug.metrics as met
                import torch_xla.runtime as xr
            except ImportError as e:
                raise ConfigError(f"device.type=xla needs torch-xla ({e}); see README, Trainium") from None
            if cfg.compile_cache:
                xr.initialize_cache(cfg.compile_cache, readonly=False)  # before any computation
            self.xla = dict(torch_xla=torch_xla, xm=xm, met=met)
            self.device = torch_xla.device()
            self.on_trainium = xr.device_type() == "NEURON"
        elif self.kind == "neuron":
            try:
                import torch_neuronx  # noqa: F401  registers the native "neuron" device and process group
            except ImportError as e:
                raise ConfigError(f"device.type=neuron needs the native TorchNeuron backend (torch-neuronx "
                                  f">= 2.13, Neuron SDK 2.33+): {e}") from None
            if not (torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "neuron"):
                raise ConfigError("device.type=neuron but no Neuron device is visible (neuron-ls)")
            self.device, self.on_trainium = torch.device("neuron", local_rank), True
        else:
            self.device = torch.device("cpu")
        # What a step's speed depends on besides the CPU (clock.machine): the accelerator, if any.
        self.accelerator = (peak_device(True, "", logical_nc_config()) if self.on_trainium else
                            torch.cuda.get_device_name(self.device) if self.kind == "cuda" else "")
        if cfg.compile_cache and self.kind != "xla":
            raise ConfigError(f"device.compile_cache is for device.type=xla, not {self.kind}")
        self.dtype = compute_dtype(cfg, self.kind, self.on_trainium)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.bf16_weights = self.dtype == torch.bfloat16 and cfg.bf16 == "weights"
        # The attention core in float32 under bfloat16: on a CPU bfloat16 SDPA (forward + backward) took 2.3x
        # as long as float32 and the step 1.41x (sweeps/attention_bench.py, docs/experiments.md "The step on
        # bfloat16 CPUs"); elsewhere unmeasured, so unchanged.
        self.attn_float32 = self.dtype == torch.bfloat16 and (
            cfg.attn_dtype == "float32" or cfg.attn_dtype == "auto" and self.kind == "cpu")
        # Loss sums in float64 where it is cheap; Neuron has no float64.
        self.sum_dtype = torch.float32 if self.kind in ("xla", "neuron") else torch.float64
        self.control = None
        if self.world_size > 1:
            if self.kind == "xla":
                import torch_xla.distributed.xla_backend  # registers the "xla" process group
                dist.init_process_group("xla", init_method="xla://")
                if dist.get_world_size() != self.world_size:  # seen with PJRT_DEVICE=CPU
                    raise ConfigError(f"device.type=xla: torchrun started {self.world_size} processes but the "
                                      f"xla process group has {dist.get_world_size()}; torch-xla's CPU backend "
                                      f"has no multi-process collectives, use device.type=cpu with torchrun on a CPU")
            else:
                dist.init_process_group({"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}[self.kind])
            # Host-side agreement (elapsed time, stop requests) goes over gloo, never through the device.
            self.control = dist.group.WORLD if self.kind == "cpu" else dist.new_group(backend="gloo")

    def compile(self, fn):
        """device.compile: torch.compile(fn) with static shapes and Python ints, like XLA (a stage is a new graph,
        not a dynamic one); inductor on cpu and cuda, the Neuron backend on neuron, not on XLA (one graph already)."""
        torch._dynamo.config.recompile_limit = 64  # each stage, capacity, train/eval is a graph; past 8 torch runs eagerly
        # Inductor's CPU kernels fix their OpenMP thread count when generated, and its graph cache does not key on the
        # count: a run reusing a graph that a one-thread run cached runs it serial (two threads on such a cache: 6.8k
        # tokens/s against 9.9k, docs/experiments.md "Equal time"). Set in its config, the count is in the cache key.
        # Imported here, not at the top: inductor imports triton, which reads TRITON_INTERPRET once (the tests set it).
        from torch._inductor import config as inductor_config
        inductor_config.cpp.threads = torch.get_num_threads()
        return torch.compile(fn, backend="neuron" if self.kind == "neuron" else "inductor", dynamic=False)

    def autocast(self):
        plain = self.dtype == torch.float32 or self.bf16_weights
        return nullcontext() if plain else torch.autocast(self.device.type, dtype=self.dtype)

    def mark_step(self):
        """The end of one optimizer step: on XLA the traced step becomes one graph and runs."""
        if self.xla:
            self.xla["torch_xla"].sync()

    def wait(self):
        """Block until the device has finished all queued work (timing, the end of a run)."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.xla:
            self.xla["xm"].wait_device_ops()
        elif self.kind == "neuron":
            torch.accelerator.synchronize()

    def on_values(self, fn, *tensors):
        """fn(*tensors) once their values exist: on XLA in a step closure, run at the next
        mark_step after the graph has executed, so reading them adds no graph and no sync."""
        if self.xla:
            self.xla["xm"].add_step_closure(fn, args=tensors)
        else:
            fn(*tensors)

    def all_reduce_(self, tensors, mean: bool):
        """Sum (or average) tensors over ranks in place, as one collective, in their promoted dtype
        (float64 and int64 sums stay exact)."""
        if self.world_size == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        if mean:
            flat /= self.world_size
        for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(chunk.view_as(t))

    def agree(self, elapsed_s: float, stop: bool):
        """Every rank adopts the slowest clock and any rank's stop request, so all ranks take
        the same LR and stop at the same step. Host-side (gloo): no device sync."""
        if self.world_size == 1:
            return elapsed_s, stop
        state = torch.tensor([elapsed_s, float(stop)], dtype=torch.float64)
        dist.all_reduce(state, op=dist.ReduceOp.MAX, group=self.control)
        return state[0].item(), bool(state[1].item())

    def compile_seconds(self) -> float:  # seconds this process has spent compiling graphs (XLA); 0 elsewhere
        return (self.compile_stats() or (0, 0.0))[1]

    def compile_stats(self):
        """XLA: (graphs compiled, compile seconds) so far in this process; None elsewhere."""
        if not self.xla:
            return None
        met = self.xla["met"]
        count, total_ns = (met.metric_data("CompileTime") or (0, 0))[:2]
        return count, total_ns / 1e9

    def transfers(self) -> int:
        """XLA: device-to-host transfers so far in this process."""
        return (self.xla["met"].metric_data("TransferFromDeviceTime") or (0,))[0]

    def peak_flops(self) -> tuple:
        """-> (FLOP/s, where it came from): PEAK_FLOPS for a known device, else measured here."""
        name = peak_device(self.on_trainium, self.accelerator, logical_nc_config())
        if (name, self.dtype) in PEAK_FLOPS:
            return PEAK_FLOPS[name, self.dtype], f"{name} datasheet"
        return self.measure_matmul_peak(), "measured"

    def measure_matmul_peak(self) -> float:
        """Best observed FLOP/s of a square matmul: on the GPU, or eagerly on the host CPU (which
        is also what XLA's CPU backend runs on). Honest on any CPU; below the datasheet on GPUs."""
        device = self.device if self.kind == "cuda" else torch.device("cpu")
        n = 4096 if device.type == "cuda" else 1024
        a, b = (torch.randn(n, n, device=device, dtype=self.dtype) for _ in range(2))
        best = math.inf
        for _ in range(6):
            self.wait()
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            self.wait()
            best = min(best, (time.perf_counter() - start) / 4)
        return 2 * n ** 3 / best

    def peak_memory_mb(self) -> float:
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # host RSS; Linux reports KiB

    def start_profile(self, run_dir: Path):
        """Record the ops of the next steps: torch.profiler on cpu, cuda and neuron; on XLA the
        torch-xla profiler, whose trace holds the compiled graphs' ops as they execute."""
        if self.xla:
            import torch_xla.debug.profiler as xp
            xp.start_trace(str(run_dir / "xla_trace"))  # also a TensorBoard / XProf log dir
            return xp
        activity, extra = torch.profiler.ProfilerActivity, {}
        activities = [activity.CPU] + ([activity.CUDA] if self.kind == "cuda" else [])
        if self.kind == "neuron":  # as in the Neuron docs, "Capture PyTorch profiles with Neuron Explorer"; not
            # run here (no Neuron SDK). RUNTIME: every execution; DEVICE mode would reserve ~5 GB of HBM.
            from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, ProfileMode
            config = NeuronConfig(modes=[ProfileMode.RUNTIME], profile_output_dir=str(run_dir / "neuron_profile"))
            activities.append(activity.PrivateUse1)
            extra = dict(experimental_config=config, on_trace_ready=NeuronProfiler(config).export_trace)
        prof = torch.profiler.profile(activities=activities, record_shapes=True, **extra)
        prof.start()
        return prof

    def stop_profile(self, prof, run_dir: Path) -> tuple:
        """-> (ops as kernels.profile reads them, time per graph or None); writes run_dir/trace.json."""
        if self.xla:
            prof.stop_trace()
            trace = next((run_dir / "xla_trace").rglob("*.trace.json.gz"), None)
            events = json.load(gzip.open(trace))["traceEvents"] if trace else []
            (run_dir / "trace.json").write_text(json.dumps({"traceEvents": events}))
            return kernels.profile.xla_ops(events)
        prof.stop()
        prof.export_chrome_trace(str(run_dir / "trace.json"))
        return kernels.profile.torch_ops(prof.key_averages(group_by_input_shape=True), self.kind in ("cuda", "neuron")), None


# ----------------------------------------------------------------------------------------------
# Checkpoints and the scorer's entry point.


class CheckpointError(ValueError):
    pass


CHECKPOINT_KEYS = ("model", "optimizers", "loader", "step", "train_s", "compile_s", "run_id", "config", "timeline", "flops", "rng")


def save_checkpoint(path: Path, state: dict):
    """Atomic and durable: the data reaches the disk before the rename, and the rename before we
    return. A crash or a full disk mid-write leaves the previous checkpoint intact; a failed save
    removes its temporary file (a kill -9 cannot: the next save overwrites it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_checkpoint(path) -> dict:
    """weights_only: tensors and plain containers of primitives, so a crafted file cannot run code."""
    if not Path(path).is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a crafted pickle, a truncated or foreign file
        # torch's weights_only message starts with how to load the file unsafely; the cause comes last
        reason = ([line.strip() for line in str(e).splitlines() if line.strip() and "documentation" not in line]
                  or ["-"])[-1]
        raise CheckpointError(f"checkpoint {path}: cannot be loaded as a train.py checkpoint "
                              f"({type(e).__name__}: {reason})") from None
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt] if isinstance(ckpt, dict) else CHECKPOINT_KEYS
    if missing:
        raise CheckpointError(f"checkpoint {path}: missing {', '.join(missing)}; not a train.py checkpoint")
    return ckpt


def load_for_eval(checkpoint_path, device) -> torch.nn.Module:
    """The scorer contract: an eval-mode, single-device model whose forward(idx: LongTensor[B, T])
    returns logits [B, T, V] that depend only on the input tokens (causally). Its weights are the
    run's moving average (or optim.ema_blend of it) when it had optim.ema > 0 (as it evaluated), else the trained ones."""
    ckpt = load_checkpoint(checkpoint_path)
    cfg = build(Config, merge(load_chain(BASE_CONFIG), ckpt["config"]))  # keys newer than the file at their defaults
    stages = resolve_stages(cfg)
    model = GPT(cfg.model, cfg.mod, passes=max(s.recur for s in stages), recur_gate=cfg.schedule.recur_gate,
                bos=ckpt["model"].get("bos"), seq_len=cfg.data.seq_len)  # the BOS id, where doc_mask or smear_gate need it
    model.load_state_dict(ckpt["model"])
    set_stage(model, cfg, stages[ckpt["timeline"][-1][0]])  # the shape it trained last
    return model.to(device).eval()


def set_stage(model: GPT, cfg: Config, stage):
    """The model's active layers, MLP width, attention options, capacity, loop and extra targets in a stage."""
    model.set_active(depth_order(cfg.model.n_layer, cfg.schedule.grow_depth)[:stage.depth], stage.mlp_hidden,
                     stage.doc_mask, stage.xsa_layers)
    model.set_capacity(stage.capacity)
    model.set_recursion(stage.recur_span, stage.recur)
    model.mtp_computed = min(stage.mtp, model.mtp)


def stage_flops(cfg: Config, model: GPT, stage) -> float:
    """Training FLOPs per token of a stage, the model set to it (set_stage)."""
    return flops_per_token(cfg.model, stage.seq_len, dataclasses.replace(cfg.mod, capacity=stage.capacity),
                           model.active, stage.mlp_hidden, stage.loop_layers, stage.recur)


# ----------------------------------------------------------------------------------------------
# The run.


def open_data(cfg: Config):  # -> (train files, val files, tokenizer path, corpus fingerprint)
    d = cfg.data
    return data.open_data(d.source, d.path, d.tokenizer, cfg.model.vocab_size, d.val_fraction, d.tokenizer_kind, d.val_shard)


def kit_scored(cfg: Config) -> bool:
    """Whether the run is scored by the kit's protocol too: a tokenizer of the kit's kind and eval.kit_tokens > 0."""
    return cfg.data.tokenizer_kind == "tiktoken" and cfg.eval.kit_tokens > 0


def kit_val_bpb(cfg: Config, model, val_files, bos_id: int, token_bytes: torch.Tensor, backend, max_batches=0) -> tuple:
    """The kit's protocol as its scorer runs it: kit.evaluate_bpb over packed validation rows of eval.kit_seq_len,
    eval.kit_tokens of them (the first max_batches batches if > 0). -> (val_bpb, nats, bytes, tokens)."""
    e = cfg.eval
    batches = data.packed_val_batches(val_files, e.kit_seq_len, eval_rows(cfg, e.kit_seq_len), cfg.model.vocab_size,
                                      bos_id, e.kit_tokens)
    return kit.evaluate_bpb(model, itertools.islice(batches, max_batches or None), token_bytes, backend)


def check_writable(directory: Path, key: str):
    """Stop before training if `directory` (made when training starts) could not be made or written."""
    existing = next(path for path in (directory, *directory.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is a file, expected a directory (to hold {directory})")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {existing} is not writable (to hold {directory})")


def check_outputs(cfg: Config):
    """Stop before an outside trainer (tools/) runs if its run folder or ledger row could not be written."""
    check_writable(Path(cfg.run.out_dir), "run.out_dir")
    check_writable(Path(cfg.ledger.path).absolute().parent, "ledger.path")
    ledger.check_header(cfg.ledger.path)


def memory_estimate(cfg: Config, bf16_weights: bool) -> tuple:
    """-> (bytes, parameters, activation bytes) a rank needs, roughly (model.training_values): each parameter 16
    bytes (fp32 weight, gradient, two optimizer moments; 20 with bf16 weights and fp32 masters; 4 more with
    optim.ema, 8 with an ema_blend below 1), each activation value of one micro-batch 4."""
    params, values = training_values(cfg.model, cfg.optim.micro_batch * cfg.data.seq_len)
    copies = bool(cfg.optim.ema) * (1 + (cfg.optim.ema_blend != 1))  # the average, and the weights held while blended
    return params * ((20 if bf16_weights else 16) + 4 * copies) + 4 * values, params, 4 * values


def check_memory(cfg: Config, backend: Backend):
    """Refuse a run that cannot fit (memory_estimate) before allocating it: against MemAvailable of the host
    (CPU, XLA on CPU: shared by the processes on it) or the free memory of the GPU; not on Neuron (no query)."""
    if backend.kind == "cuda":
        available, where = torch.cuda.mem_get_info(backend.device)[0], f"free on {backend.device}"
    elif backend.on_trainium or backend.kind == "neuron" or not Path("/proc/meminfo").is_file():
        return
    else:
        meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        where = "MemAvailable of the host, per process"
    need, params, activations = memory_estimate(cfg, backend.bf16_weights)
    if need > available:
        m = cfg.model
        raise ConfigError(f"model.n_layer={m.n_layer} model.n_embd={m.n_embd} model.mlp_mult={m.mlp_mult} "
                          f"model.vocab_size={m.vocab_size} optim.micro_batch={cfg.optim.micro_batch} data.seq_len="
                          f"{cfg.data.seq_len}: the run needs about {need / 2**30:.2f} GiB ({params:.3g} parameters, "
                          f"{activations / 2**30:.2f} GiB activations) but {available / 2**30:.2f} GiB is available "
                          f"({where}); expected a smaller model or micro-batch")


def xla_graphs(cfg: Config, stages, accum: int) -> int:
    """Graphs an XLA run compiles, however long (precompile runs them all): per stage its steady step (one per phase
    of a layer-routing rotation its micro-batches meet) and, where it first uses parameters (the run's first stage,
    new layers, a loop's new gates or routers), its first step; eval; the routers' agreement read; optim.ema's swap;
    the kit's protocol, where the tokenizer is of the kit's kind: load_for_eval's model's scalar buffers, its rows."""
    graphs, depth, passes = 1 + (cfg.mod.granularity in TILED) + bool(cfg.optim.ema) + 2 * kit_scored(cfg), 0, 1
    for stage in stages:
        period = rotation_period(cfg.mod, stage.capacity)
        graphs += period // math.gcd(period, accum) + (stage.depth > depth or stage.recur > passes and (
            cfg.schedule.recur_gate or cfg.mod.recur))
        depth, passes = max(depth, stage.depth), max(passes, stage.recur)
    return graphs


def stage_line(stage, model: GPT, flops: float) -> str:
    """A stage's settings, virtual depth, active parameters and FLOPs per token, the model set to it."""
    return (" ".join(f"{k}:{v}" for k, v in dataclasses.asdict(stage).items()) + f" virtual_depth:"
            f"{stage.virtual_depth} active_params:{active_params(model)} flops_per_token:{flops:.0f}")


def plan_text(cfg: Config, config_path: str) -> str:
    """--plan: a run of cfg from its config alone (no data read, no device touched, nothing compiled). xla and neuron
    are planned on trn2 for each launch shape the kit allows (kit.LAUNCH_SHAPES), or for the one WORLD_SIZE and
    NEURON_LOGICAL_NC_CONFIG (default 2) name; cpu and cuda (this GPU) on WORLD_SIZE ranks (default 1). Under a calibration
    made elsewhere (budget.clock=calibrated: a chip clock), the steps the run takes and where its stages begin."""
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device.type == "auto" else cfg.device.type
    trn2, stages = kind in ("xla", "neuron"), resolve_stages(cfg)
    shapes = [(world, str(lnc)) for lnc, world in kit.LAUNCH_SHAPES.items()] if trn2 and "WORLD_SIZE" not in os.environ \
        else [(int(os.environ.get("WORLD_SIZE", "1")), logical_nc_config())]
    gpu = torch.cuda.get_device_name() if kind == "cuda" and torch.cuda.is_available() else ""
    dtype = compute_dtype(cfg.device, kind, trn2)
    with torch.device("meta"):  # shapes only: nothing allocated
        model = GPT(cfg.model, cfg.mod, passes=max(s.recur for s in stages), recur_gate=cfg.schedule.recur_gate,
                    seq_len=cfg.data.seq_len)
    lines = []
    for world, lnc in shapes:
        accum, device = accum_steps(cfg, world), peak_device(trn2, gpu, lnc)
        peak, hbm = PEAK_FLOPS.get((device, dtype)), HBM_BYTES.get(device)
        lines.append(f"plan config:{config_path} device:{kind} target:{device or kind} dtype:{str(dtype)[6:]} world_size:"
                     f"{world} params:{param_count(model)} tokens_per_step:{cfg.optim.batch_tokens} tokens_per_rank:"
                     f"{cfg.optim.batch_tokens // world} accum_steps:{accum} xla_graphs:{xla_graphs(cfg, stages, accum)}")
        if trn2:
            lines.append("launch: " + (kit.launch_command(int(lnc), config_path) if kit.LAUNCH_SHAPES.get(int(lnc)) == world
                                       else "not a shape the kit scores (one trn2 chip whole: kit.LAUNCH_SHAPES)"))
        for i, stage in enumerate(stages):
            set_stage(model, cfg, stage)
            flops, rank_tokens = stage_flops(cfg, model, stage), stage.batch_tokens // world
            lines.append(f"stage:{i} {stage_line(stage, model, flops)} tokens_per_rank:{rank_tokens}" + (
                f" step_s_at_40pct_mfu:{flops * rank_tokens / (0.4 * peak):.4f}" if peak else ""))
        need, _, activations = memory_estimate(cfg, dtype == torch.bfloat16 and cfg.device.bf16 == "weights")
        lines.append(f"memory_per_rank:{need / 2**30:.2f}GiB (estimate; activations {activations / 2**30:.2f}GiB)" + (
            f" hbm_per_rank:{hbm / 2**30:g}GiB margin:{(hbm - need) / 2**30:.2f}GiB" if hbm else ""))
        lines.append(f"peak_flops_per_rank:{peak:.4g} ({device} datasheet)" if peak else "peak:unknown (measured at run time)")
    if cfg.budget.clock == "calibrated" and clock.made_elsewhere(doc := clock.read(cfg.budget.calibration)):
        calibration, costs = clock.costs(cfg.budget, [], "", [stage.batch_tokens for stage in stages])  # by tokens alone
        timeline, charged = clock.predict(cfg.budget, stages, costs, cfg.run.profile_steps, cfg.device.compile and
                                          kind != "xla")
        lines.append(f"clock:calibrated calibration:{calibration} steps:{sum(t[2] for t in timeline)} train_s:"
                     f"{charged:.1f} stage_first_steps:{','.join(f'{i}@{first}' for i, first, _ in timeline)} (step costs "
                     f"made elsewhere, not measured here: {doc['source']} ({doc['machine']}); {clock.ASSUMED})")
    return "\n".join(lines)


FINITE_CHECK_STEPS = 16  # off the CPU a non-finite loss stops the run within min(run.log_every, this) steps
STUCK_AFTER = 0.25  # a logged loss still >= ln(vocab_size) past this share of the budget (and warmup)
STUCK_MIN_STEPS = 10  # and after this many steps (a run's first steps may start at a late p): diverged


class Trainer:
    """Holds everything of one run; `train()` is the loop, `step()` one optimizer step."""

    def __init__(self, cfg: Config, config_path="", overrides=()):
        self.started = time.perf_counter()  # budget.charge=kit: the startup runs from here to step startup_steps' end
        self.cfg, self.config_path, self.overrides = cfg, str(config_path), list(overrides)
        if cfg.budget.charge == "kit" and cfg.device.type in ("xla", "neuron"):  # a trn2 run, as the kit launches it
            kit.check_launch(int(os.environ.get("WORLD_SIZE", "1")), logical_nc_config())
        self.resumed = load_checkpoint(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
        if self.resumed:
            saved = dataclasses.asdict(build(Config, merge(load_chain(BASE_CONFIG), self.resumed["config"])))  # newer keys: defaults
            old = flatten({k: saved[k] for k in ("model", "mod")})
            new = flatten({k: dataclasses.asdict(cfg)[k] for k in ("model", "mod")})
            diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                             if old.get(k) != new.get(k) and k != "mod.capacity")  # capacity may change
            if diff:
                raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume}: model differs from the checkpoint's ({diff})")
        self.backend = Backend(cfg.device)
        try:
            self.kernels = kernels.resolve(dataclasses.asdict(cfg.kernels), self.backend.kind, self.backend.on_trainium)
        except kernels.KernelError as e:
            raise ConfigError(str(e)) from None
        self.device, self.is_main, world = self.backend.device, self.backend.rank == 0, self.backend.world_size
        check_memory(cfg, self.backend)
        self.accum_steps = accum_steps(cfg, world)
        self.run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
        self.run_dir = Path(cfg.run.out_dir) / self.run_id
        self.checkpoint_path = Path(cfg.checkpoint.path or self.run_dir / "checkpoint.pt")
        # Whatever would otherwise fail after the budget is checked now.
        check_writable(self.run_dir, "run.out_dir")
        check_writable(self.checkpoint_path.parent, "checkpoint.path")
        if self.checkpoint_path.is_dir():
            raise ConfigError(f"checkpoint.path: {self.checkpoint_path} is a directory, expected a file path")
        check_writable(Path(cfg.ledger.path).absolute().parent, "ledger.path")
        ledger.check_header(cfg.ledger.path)
        # Under neuron_parallel_compile outputs are zeros: such a run only traces, like precompile.
        self.precompile = cfg.run.precompile or bool(os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY"))

        for seed in (torch.manual_seed, np.random.seed, random.seed):  # the same on every rank: identical initial weights
            seed(cfg.run.seed)
        self.train_files, self.val_files, tokenizer, self.data_sha = open_data(cfg)
        if cfg.data.replay:  # another program's rows of this corpus, in their order
            if not Path(cfg.data.replay).is_file():
                raise ConfigError(f"data.replay={cfg.data.replay}: no such file; expected a shard of training rows "
                                  f"(tools/lineage_run.py --record-rows writes one)")
            self.train_files = [Path(cfg.data.replay)]
        self.bytes = data.ByteTable(tokenizer)
        self.kit_bytes = data.kit_token_bytes(tokenizer) if kit_scored(cfg) else None  # the kit's table, for its protocol
        if self.bytes.vocab_size != cfg.model.vocab_size:
            raise data.DataError(f"tokenizer {tokenizer} has {self.bytes.vocab_size} tokens but "
                                 f"model.vocab_size is {cfg.model.vocab_size}")
        self.bytes = self.bytes.to(self.device)
        seq_len, key = eval_seq_len(cfg), "eval.seq_len" if cfg.eval.seq_len else "data.seq_len"
        val_tokens = sum(len(data.load_shard(f, cfg.model.vocab_size)) for f in self.val_files)  # headers, token ids
        if val_tokens <= seq_len:  # not one window (eval.tokens and eval.curve_tokens hold one: config.validate)
            raise ConfigError(f"{key}={seq_len}: a validation window is {seq_len} + 1 tokens, the validation split "
                              f"({', '.join(map(str, self.val_files))}) holds {val_tokens}; expected "
                              f"{f'{key} < {val_tokens} or ' if val_tokens > 1 else ''}more validation text")
        self.stages = resolve_stages(cfg)
        flat = flatten(dataclasses.asdict(cfg))
        self.recipe, self.machine = recipe(flat, self.data_sha), clock.machine(self.backend.accelerator)
        self.calibration, self.step_costs, self.clock_source = "", None, ""  # the calibrated clock: seconds per step of each stage
        if cfg.budget.clock == "calibrated":
            self.calibration, self.step_costs = clock.costs(cfg.budget, [clock.stage_key(flat, self.data_sha, stage)
                                                                         for stage in self.stages], self.machine,
                                                            [stage.batch_tokens for stage in self.stages])
            doc = clock.read(cfg.budget.calibration)  # made elsewhere: its costs are another program's or machine's
            self.clock_source = f"{doc['source']} ({doc['machine']})" if clock.made_elsewhere(doc) else ""
        self.loader, self.loader_state, self.data_wait_s = None, None, 0.0
        bos = self.bytes.bos_id if cfg.model.smear_gate or any(s.doc_mask for s in self.stages) else None
        if self.bytes.bos_id < 0 and (bos is not None or cfg.optim.mask_bos_targets):
            raise ConfigError(f"model.doc_mask, model.smear_gate, optim.mask_bos_targets: need a BOS token (it starts each "
                              f"document); {tokenizer} has none")
        self.model = GPT(cfg.model, cfg.mod, self.kernels, self.backend.attn_float32, max(s.recur for s in self.stages),
                         cfg.schedule.recur_gate, bos, cfg.data.seq_len, len(cfg.optim.mtp_weights),
                         self.bytes.bos_id if cfg.optim.mask_bos_targets else None).to(self.device)
        self.masters = {}  # bf16 weights: parameter -> its fp32 master copy, which the optimizers update
        if self.backend.bf16_weights:
            self.model.to(torch.bfloat16)
            self.masters = {p: p.detach().float() for p in self.model.parameters()}
        self.optimizers = make_optimizers(self.model, cfg.optim, self.masters)
        self.ema = WeightAverage([self.masters.get(p, p) for p in self.model.parameters()], cfg.optim)  # optim.ema
        self.compiled = cfg.device.compile and not self.backend.xla
        self.loss = self.backend.compile(self.model.loss) if self.compiled else self.model.loss
        self.step_count, self.train_s, self.compile_s = 0, 0.0, 0.0
        self.timeline = []  # [stage, train_s at its start, steps in it]
        self.flops = 0.0  # training FLOPs so far, by each stage's FLOPs per token
        self.step_ms, self.steady_tokens, self.steady_s = [], 0, 0.0  # steady steps: measured ms; tokens, clock seconds
        if self.resumed:
            self.restore(self.resumed)
        self.enter_stage(self.stage_at(self.train_s / cfg.budget.seconds))
        self.stop_signal, self.diverged = None, ""  # diverged: the reason
        self.curve_s, self.curve_points = 0.0, 0

    # -- annealing stages ----------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.timeline[-1][0]

    @property
    def tokens(self) -> int:
        """Training tokens so far, by each stage's tokens per step (0 before the first stage)."""
        return sum(steps * self.stages[index].batch_tokens for index, _, steps in self.timeline)

    @property
    def tokens_per_s(self) -> float:
        """Steady-state tokens per second of the run's clock (warm-up, compiling, profiled steps left out)."""
        return self.steady_tokens / self.steady_s if self.steady_s else 0.0

    def stage_at(self, progress: float) -> int:
        return stage_for(self.stages, self.stage if self.timeline else 0, self.tokens, progress)

    def enter_stage(self, index: int):
        """Set the model's active layers, MLP width and capacity, the loader's sequence length and tokens per step
        (stage_rows), and the LR's batch factor to stage `index`: a new static graph. Weights, optimizer state and
        the LR schedule carry on, except that with schedule.grow_init=copy the layers a stage adds start as copies
        of the top ones active before it (stacking, Du et al. 2024), optimizer state included."""
        stage, cfg = self.stages[index], self.cfg
        order = depth_order(cfg.model.n_layer, cfg.schedule.grow_depth)
        if self.timeline and cfg.schedule.grow_init == "copy":  # not on a run's first entry: nothing has trained
            before = self.stages[self.stage].depth
            for source, new in zip(order[2 * before - stage.depth:before], order[before:stage.depth]):
                self.copy_block(source, new)
        set_stage(self.model, cfg, stage)
        self.batch_lr = stage.lr  # by default sqrt(batch_tokens / optim.batch_tokens) (config.Stage)
        rows = int(stage_rows(cfg, stage))
        if self.loader is None or (self.loader.batch_size, self.loader.seq_len) != (rows, stage.seq_len):
            if self.loader is not None:
                self.loader.close()
                self.data_wait_s += self.loader.wait_s
            self.loader = data.TrainLoader(self.train_files, rows, stage.seq_len, cfg.model.vocab_size,
                                           rank=self.backend.rank, world_size=self.backend.world_size,
                                           prefetch=cfg.data.prefetch, order=cfg.data.order, seed=cfg.run.seed,
                                           bos_id=self.bytes.bos_id, row_pool=cfg.data.row_pool, row_pool_from=cfg.data.row_pool_from)
            if self.loader_state is not None:
                self.loader.load_state_dict(self.loader_state)  # before the batches fetched for the old shape
            self.inputs = self.fetch()
        self.period = rotation_period(cfg.mod, stage.capacity)
        self.stage_flops_per_token = stage_flops(cfg, self.model, stage)
        if not self.timeline or self.stage != index:
            self.timeline.append([index, self.train_s, 0])

    @torch.no_grad()
    def copy_block(self, source: int, new: int):
        """Block `new` becomes a copy of block `source`: every parameter both have (the value-embedding
        weight only some layers have stays), with its fp32 master and its optimizer state."""
        params = dict(self.model.blocks[new].named_parameters())
        for name, p in self.model.blocks[source].named_parameters():
            if name not in params:
                continue
            src, dst = self.masters.get(p, p), self.masters.get(params[name], params[name])
            params[name].copy_(p)
            dst.copy_(src)
            for opt in self.optimizers:
                if src in opt.state:
                    opt.state[dst] = {k: v.clone() for k, v in opt.state[src].items()}
            if self.ema:  # the copy's average starts as the source's, not as its own initial weights
                self.ema[dst].copy_(self.ema[src])

    def residual_scales(self, progress: float):
        """(attn, mlp) branch scales: each stage's values at its `at`, linear in between, so they
        never jump (a jump would change the function the model computes)."""
        i = self.stage_at(progress)
        now, after = self.stages[i], self.stages[min(i + 1, len(self.stages) - 1)]
        x, start, end = (self.tokens, now.at_tokens, after.at_tokens) if after.at_tokens else (progress, now.at, after.at)
        t = (x - start) / (end - start) if end > start else 0.0
        return tuple(a + (b - a) * min(t, 1.0) for a, b in ((now.attn_scale, after.attn_scale),
                                                               (now.mlp_scale, after.mlp_scale)))

    # -- state ---------------------------------------------------------------------------------
    def fetch(self):
        """The next step's micro-batches, moved to the device now: on XLA and CUDA the copy overlaps the step the
        device is still running. Remembers the loader position before them, what a checkpoint must record."""
        self.loader_state = self.loader.state_dict()
        return [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                for x, y in (self.loader.next_batch() for _ in range(self.accum_steps))]

    def model_state(self) -> dict:
        state = self.model.state_dict()
        names = {p: name for name, p in self.model.named_parameters()}
        state.update({names[p]: master for p, master in self.masters.items()})  # fp32, not the bf16 copies
        return state

    def state(self) -> dict:
        # `model` is what load_for_eval scores: with optim.ema the moving average, the weights then in `trained`.
        trained, blend = self.model_state(), self.cfg.optim.ema_blend
        average = {name: self.ema[self.masters.get(p, p)] for name, p in self.model.named_parameters()} if self.ema else {}
        state = dict(model={**trained, **average}, trained=trained if self.ema else {},
                     optimizers=[o.state_dict() for o in self.optimizers],
                     loader=self.loader_state, step=self.step_count, train_s=self.train_s, compile_s=self.compile_s,
                     run_id=self.run_id, config=dataclasses.asdict(self.cfg), timeline=self.timeline, flops=self.flops,
                     steady=dict(step_ms=self.step_ms, tokens=self.steady_tokens, s=self.steady_s),
                     # numpy's state as plain values: a checkpoint must load with weights_only=True
                     rng=dict(torch=torch.get_rng_state(), python=random.getstate(),
                              numpy=[v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
                              cuda=torch.cuda.get_rng_state_all() if self.backend.kind == "cuda" else None))
        state = tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state)
        if average and blend != 1:  # `model` the blend, made on the host (no graph on XLA); the average in `average`
            state["average"] = {name: state["model"][name] for name in average}
            state["model"].update({name: torch.lerp(state["trained"][name], a, blend) for name, a in state["average"].items()})
        return state

    def restore(self, ckpt: dict):
        weights = ckpt.get("trained") or ckpt["model"]  # `model` is the average (or a blend) where there was one (state)
        average = ckpt.get("average") or ckpt["model"]
        self.model.load_state_dict(weights)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p in self.masters:
                    self.masters[p].copy_(weights[name])
                if self.ema:  # the saved average, or the weights where none was saved (optim.ema was 0)
                    self.ema[self.masters.get(p, p)].copy_(average[name])
        for opt, state in zip(self.optimizers, ckpt["optimizers"]):
            # The state (moments, buffers) carries on; hyperparameters are this run's config's.
            settings = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            opt.load_state_dict(state)
            for group, setting in zip(opt.param_groups, settings):
                group.update(setting)
        self.loader_state = ckpt["loader"]
        self.step_count, self.train_s, self.compile_s = ckpt["step"], ckpt["train_s"], ckpt["compile_s"]
        self.timeline, self.flops = ckpt["timeline"], ckpt["flops"]
        # The steady steps before the interruption, so the row's tokens/s, step ms and MFU are the whole run's. A
        # checkpoint written before this key (2026-12-07) has none: its row counts the steps after the resume only.
        if steady := ckpt.get("steady"):
            self.step_ms, self.steady_tokens, self.steady_s = list(steady["step_ms"]), steady["tokens"], steady["s"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        name, keys, *rest = ckpt["rng"]["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        random.setstate(ckpt["rng"]["python"])
        if ckpt["rng"]["cuda"] is not None and self.backend.kind == "cuda":
            torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])

    def save(self):
        start, state = time.perf_counter(), self.state()
        # Checked on the host copy: on XLA a check on the device would compile graphs of its own.
        if not all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point()):
            self.log(f"checkpoint:{self.checkpoint_path} skipped: non-finite parameters (the last one is kept)")
            return
        save_checkpoint(self.checkpoint_path, state)
        self.log(f"checkpoint:{self.checkpoint_path} save_s:{time.perf_counter() - start:.2f}")

    def log(self, line: str):
        if self.is_main:
            print(line, flush=True)
            self.log_file.write(line + "\n")
            self.log_file.flush()

    # -- one optimizer step: no host sync in here --------------------------------------------
    def step(self, progress: float) -> torch.Tensor:
        """Forward/backward over accum_steps micro-batches, gradients averaged over ranks, one
        update. Returns the mean training loss (of all ranks) as a device tensor, not read here."""
        # Never exactly 0: torch-xla traces a zero LR into a graph of its own (measured), so warmup's
        # first steps and warmdown's last would each compile one more.
        scale = max(lr_scale(progress, self.cfg.optim, self.step_count) * self.batch_lr, 1e-9)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * scale
        for group in self.optimizers[0].param_groups:  # Muon
            group["momentum"] = muon_momentum(progress, self.cfg.optim, self.tokens / self.cfg.optim.batch_tokens)
        self.model.set_mtp_weights(mtp_weights(progress, self.cfg.optim))
        loss_sum = torch.zeros((), device=self.device)
        for micro, (x, y) in enumerate(self.inputs):
            with self.backend.autocast():
                # Layer routing picks layers by the micro-batch's index in the whole run, which
                # matters only modulo the rotation period (so device.compile traces P graphs, not one per step).
                loss = self.loss(x, y, micro_step=(self.step_count * self.accum_steps + micro) % self.period)
            ((loss + self.model.aux_loss) / self.accum_steps).backward()
            loss_sum += loss.detach()
        loss = loss_sum / self.accum_steps
        params = [p for p in self.model.parameters() if p.grad is not None]
        self.backend.all_reduce_([p.grad for p in params] + [loss], mean=True)
        for p in params:
            if p in self.masters:
                self.masters[p].grad = p.grad.float()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([self.masters.get(p, p) for p in params], self.cfg.optim.grad_clip)
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():
            for p, master in self.masters.items():
                p.copy_(master)
                master.grad = None  # a parameter skipped next step (routing, annealing) must get no update
        self.ema.update_(self.step_count)
        self.model.zero_grad(set_to_none=True)
        self.step_count += 1
        return loss

    def timed_steps(self, index: int, steps: int) -> list:
        """Calibration (clock.measure): `steps` steps of stage `index` timed as the loop times them
        (the step, the finite check, the step boundary, the next batch), waiting for each -> seconds."""
        if index != self.stage:
            self.enter_stage(index)
        seconds = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.backend.on_values(self.check_finite, self.step(self.stages[index].at))
            self.backend.mark_step()
            self.inputs = self.fetch()
            self.backend.wait()
            seconds.append(time.perf_counter() - t0)
        return seconds

    @torch.no_grad()
    def evaluate(self, max_tokens: int, max_batches=0):
        """-> (val_loss nats/token, val_bpb, target tokens, target bytes) over the first max_tokens of the validation
        split (0 = all of it), non-overlapping windows of eval.seq_len (0: data.seq_len), sharded over ranks. Every
        batch has the same shape (a short last one is padded and weighed 0), so XLA compiles one eval graph."""
        self.model.eval()
        self.swap_ema()
        self.model.reset_routing_stats()
        seq_len = eval_seq_len(self.cfg)
        batch = eval_rows(self.cfg, seq_len)
        # Made on the host, so every batch's graph sees them as data: one eval graph, not two.
        # (torch-xla turns a 0-dim host tensor into a graph constant; a 1-element one stays data.)
        nll = torch.zeros(1, dtype=self.backend.sum_dtype).to(self.device)
        counts = torch.zeros(2, dtype=torch.int64).to(self.device)  # target bytes, target tokens
        batches = data.val_batches(self.val_files, seq_len, batch, self.cfg.model.vocab_size, max_tokens=max_tokens,
                                   rank=self.backend.rank, world_size=self.backend.world_size)
        for i, (x, y) in enumerate(batches):
            rows = x.size(0)
            x, y = (torch.cat([t, t[:1].expand(batch - rows, -1)]).to(self.device) for t in (x, y))
            weight = (torch.arange(batch) < rows).to(self.device)
            with self.backend.autocast():
                token_nll = self.loss(x, y, reduction="none").view(batch, seq_len)
            nll += (token_nll.sum(1) * weight).sum().to(nll.dtype)
            counts += torch.stack([(self.bytes.target_bytes(x, y).sum(1) * weight).sum(), weight.sum() * seq_len])
            self.backend.mark_step()
            if i + 1 == max_batches or self.stop_signal is not None:  # a signal: finish() discards the result
                break
        self.backend.all_reduce_([nll], mean=False)
        self.backend.all_reduce_([counts], mean=False)
        self.routing_agreement = None
        if self.model.routers:  # reading the counters is one more small graph on XLA
            agreement = torch.cat(self.model.routing_agreement())
            self.backend.all_reduce_([agreement], mean=False)
            agree, tiles = agreement.tolist()
            self.routing_agreement = agree / tiles if tiles else None  # no routed layer active in this stage
        self.swap_ema()
        self.model.train()
        (nll,), (n_bytes, n_tokens) = nll.tolist(), counts.tolist()
        return nll / n_tokens, nll / (math.log(2) * n_bytes), n_tokens, n_bytes

    def evaluate_kit(self, max_batches=0) -> float:
        """The kit's protocol (kit.evaluate_bpb) on the checkpoint just written, as its scorer runs it: the model
        load_for_eval returns, packed validation rows of eval.kit_seq_len, eval.kit_tokens of them, the kit's
        token_bytes; on this rank alone (the kit scores on one device). -> val_bpb."""
        start = time.perf_counter()
        model = load_for_eval(self.checkpoint_path, self.device)
        bpb, _, n_bytes, tokens = kit_val_bpb(self.cfg, model, self.val_files, self.bytes.bos_id, self.kit_bytes,
                                              self.backend, max_batches)
        self.log(f"kit val_bpb:{bpb:.6f} seq_len:{self.cfg.eval.kit_seq_len} tokens:{tokens} bytes:{n_bytes} "
                 f"eval_s:{time.perf_counter() - start:.2f}")
        return bpb

    @torch.no_grad()
    def swap_ema(self):
        """optim.ema: exchange the weights the optimizers update with what is evaluated (WeightAverage.swap_), refresh
        bf16 weights from their masters; evaluation runs between two calls. On XLA a graph of its own (eval's stays one)."""
        if not self.ema:
            return
        self.ema.swap_()
        for p, master in self.masters.items():
            p.copy_(master)
        self.backend.mark_step()

    # -- the loop ------------------------------------------------------------------------------
    def on_signal(self, signum, frame):
        self.stop_signal = signum  # acted on between steps, so the checkpoint is consistent

    def report(self, loss_total: torch.Tensor, final=False):
        """The log line: mean loss of the steps since the last one, from the device's running sum
        (never reset: a reset would make the next step a different XLA graph). The only read of
        the step's outputs. final: the run's last line (see judge)."""
        total = loss_total.item()
        loss = (total - self.logged[0]) / (self.step_count - self.logged[1])
        self.logged = (total, self.step_count)
        budget = self.cfg.budget.seconds
        scale = lr_scale(self.train_s / budget, self.cfg.optim, self.step_count)  # the next step's, as p is
        self.log(f"step:{self.step_count} loss:{loss:.4f} tokens_per_s:{self.tokens_per_s:.0f} train_s:{self.train_s:.1f} "
                 f"p:{self.train_s / budget:.3f} lr_scale:{scale:.3f} epoch:{self.loader.epoch}")
        self.metric("train", loss=loss, lr_scale=scale, tokens_per_s=self.tokens_per_s)
        self.last_loss = loss
        self.judge(loss, final)

    def judge(self, loss: float, final=False):
        """diverged (the reason) for a non-finite logged loss, or one still at or above a uniform
        guess past warmup and STUCK_MIN_STEPS steps, and past STUCK_AFTER of the budget unless the
        run has ended (final: its budget or budget.max_steps ended it; a signal's stop is not an end)."""
        uniform, progress = math.log(self.cfg.model.vocab_size), self.train_s / self.cfg.budget.seconds
        if not math.isfinite(loss):
            self.diverged = f"non-finite training loss by step {self.step_count}"
        elif (loss >= uniform and progress >= max(self.cfg.optim.warmup, 0.0 if final else STUCK_AFTER)
              and self.step_count >= STUCK_MIN_STEPS):
            self.diverged = (f"training loss {loss:.4f} >= ln(model.vocab_size) = {uniform:.4f} (a uniform guess) "
                             f"at p={progress:.3f}")

    def check_finite(self, loss_total: torch.Tensor):
        """Between log lines: the running loss sum is non-finite from the first non-finite step on."""
        if not math.isfinite(loss_total.item()):
            self.diverged = f"non-finite training loss by step {self.step_count}"

    def metric(self, kind: str, **values):
        """One record of the learning curve in metrics.jsonl: kind train (a log line), curve (the
        eval.curve_tokens slice during training) or final (the whole evaluation)."""
        if self.is_main:
            record = dict(kind=kind, step=self.step_count, train_s=round(self.train_s, 3), tokens=self.tokens, stage=self.stage, **values)
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()

    def curve_point(self):
        """Evaluate the same first eval.curve_tokens of the validation split; the time is recorded
        and, like all evaluation, kept out of the budget."""
        start = time.perf_counter()
        val_loss, val_bpb, _, _ = self.evaluate(self.cfg.eval.curve_tokens)
        seconds = time.perf_counter() - start
        if self.stop_signal is not None:  # cut short by a signal: not a point of the curve; the loop stops next
            return
        self.curve_s += seconds
        self.curve_points += 1
        self.last_curve = (self.train_s / self.cfg.budget.seconds, val_bpb)
        self.log(f"curve step:{self.step_count} train_s:{self.train_s:.1f} val_loss:{val_loss:.4f} "
                 f"val_bpb:{val_bpb:.4f} eval_s:{seconds:.2f}")
        self.metric("curve", val_loss=val_loss, val_bpb=val_bpb, eval_s=seconds)

    def train(self) -> dict:
        cfg, backend = self.cfg, self.backend
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.log_file = open(self.run_dir / "log.txt", "a")
            self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        git_commit, git_dirty = ledger.git_state(ROOT)
        self.log(f"run_id:{self.run_id} git:{git_commit}{'+dirty' if git_dirty else ''} config:{self.config_path} "
                 f"overrides:{' '.join(self.overrides) or '-'}")
        for key, value in flatten(dataclasses.asdict(cfg)).items():
            self.log(f"config {key}:{value}")
        params, peak = param_count(self.model), backend.peak_flops()
        compiled = "ignored (xla: the step is one graph already)" if cfg.device.compile and backend.xla else self.compiled
        self.log(f"device:{self.device} dtype:{backend.dtype_name} attn_float32:{backend.attn_float32} "
                 f"bf16_weights:{backend.bf16_weights} world_size:{backend.world_size} params:{params} "
                 f"peak_flops:{peak[0]:.4g} ({peak[1]}) accum_steps:{self.accum_steps} "
                 f"data:{self.data_sha} resumed_from:{self.resumed['run_id'] if self.resumed else '-'} "
                 f"kernels:{self.kernels} compile:{compiled}")
        self.log(f"machine:{self.machine} clock:{cfg.budget.clock}" + (f" calibration:{self.calibration} step_ms:" + ",".join(
            f"{c * 1000:.2f}" for c in self.step_costs) if self.step_costs else ""))

        # SIGUSR1: pruned by a search (search.py): the run stops, with no checkpoint and no evaluation.
        handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        status, error, start_step = "ok", "", self.step_count
        # Precompile runs each stage's graphs: its first step (which may create optimizer state, a graph of its own),
        # then the steady step, under layer routing a graph per phase of its rotation (period P micro-batches).
        plan = [i for i, stage in enumerate(self.stages) for _ in range(1 + rotation_period(cfg.mod, stage.capacity))]
        max_steps = start_step + len(plan) if self.precompile else cfg.budget.max_steps
        scaled = any((stage.attn_scale, stage.mlp_scale) != (1.0, 1.0) for stage in self.stages)
        last_checkpoint = self.train_s
        curve_every = 0 if self.precompile else cfg.eval.every_seconds
        next_curve = self.train_s  # a point at the start (step 0), then every curve_every seconds of training
        loss_total = torch.zeros((), dtype=backend.sum_dtype, device=self.device)
        self.logged = (0.0, start_step)  # (loss_total, step) at the last log line
        budget, kit_charge = cfg.budget.seconds, cfg.budget.charge == "kit"
        # Reading the loss is free on the CPU; elsewhere it is a host sync, so only every few steps.
        check_every = 1 if backend.kind == "cpu" else min(cfg.run.log_every, FINITE_CHECK_STEPS)
        # Profiled: the steps after the warm-up step and the first steady step (on XLA the one that
        # compiles the steady graph), with their time kept out of the budget and the step times.
        profile_first = start_step + 2
        profile_end = profile_first + (0 if self.precompile else cfg.run.profile_steps)
        prof, profile_s, self.profile_top = None, 0.0, ""
        self.log_stage()
        try:
            while True:
                self.train_s, stop = backend.agree(self.train_s, self.stop_signal is not None)
                if stop:
                    status = "pruned" if self.stop_signal == signal.SIGUSR1 else "interrupted"
                    break
                # A precompile run ends with its plan, however long its steps take (a slow or busy machine).
                if (self.train_s >= budget and not self.precompile) or (max_steps and self.step_count >= max_steps):
                    break
                if curve_every and self.train_s >= next_curve:
                    self.curve_point()
                    next_curve = (self.train_s // curve_every + 1) * curve_every
                progress = self.train_s / budget
                index = plan[self.step_count - start_step] if self.precompile else self.stage_at(progress)
                if index != self.stage:
                    self.enter_stage(index)
                    self.log_stage()
                if scaled:
                    self.model.set_residual_scales(*self.residual_scales(progress))
                profiled = profile_first <= self.step_count < profile_end
                if profiled and self.step_count == profile_first:
                    backend.wait()  # the profile holds the profiled steps' work and nothing before
                    if self.is_main:
                        try:
                            prof = backend.start_profile(self.run_dir)
                        except Exception as e:  # a profile that cannot be taken does not stop the run
                            prof = e
                t0, compiled_s = time.perf_counter(), backend.compile_seconds()
                loss_total += self.step(progress)
                self.timeline[-1][2] += 1
                self.flops += self.stage_flops_per_token * self.stages[self.stage].batch_tokens
                if self.step_count % cfg.run.log_every == 0 and not self.precompile:
                    backend.on_values(self.report, loss_total)
                elif self.step_count % check_every == 0 and not self.precompile:
                    backend.on_values(self.check_finite, loss_total)
                backend.mark_step()
                self.inputs = self.fetch()
                # Compile time is kept apart: all of the first step (compilation, CUDA kernel and allocator warm-up), on
                # XLA whatever a later step spent compiling a new graph, with device.compile each stage's first step.
                warmup = self.step_count == start_step + 1 or (self.compiled and self.timeline[-1][2] == 1)
                if warmup or profiled:
                    backend.wait()
                elapsed = time.perf_counter() - t0
                compiling = elapsed if warmup else backend.compile_seconds() - compiled_s
                self.compile_s += compiling
                profile_s += elapsed if profiled else 0.0
                startup = self.step_count <= cfg.budget.startup_steps  # budget.charge=kit: free up to startup_cap_s
                if self.step_costs:  # calibrated: the stage's cost, free the steps free in a run never resumed
                    free = clock.free_step(cfg.budget, self.step_count, profile_end - profile_first,
                                           self.compiled and self.timeline[-1][2] == 1)
                    self.train_s += 0.0 if free else self.step_costs[self.stage]
                elif kit_charge:  # every step after the startup, compile and profile included, as the kit charges
                    self.train_s += 0.0 if startup else elapsed
                    if self.step_count == cfg.budget.startup_steps:
                        self.train_s += max(0.0, time.perf_counter() - self.started - cfg.budget.startup_cap_s)
                elif not profiled:
                    self.train_s += elapsed if cfg.budget.count_compile else elapsed - compiling
                if not (compiling or profiled):
                    self.step_ms.append(elapsed * 1000)
                    self.steady_s += self.step_costs[self.stage] if self.step_costs else elapsed
                    self.steady_tokens += self.stages[self.stage].batch_tokens
                if prof is not None and self.step_count == profile_end:
                    self.write_profile(prof, profile_first, profile_s)
                if self.diverged:
                    break
                if (self.is_main and cfg.checkpoint.every_seconds and not self.precompile
                        and self.train_s - last_checkpoint >= cfg.checkpoint.every_seconds):
                    self.save()
                    last_checkpoint = self.train_s
            if not self.precompile and not self.diverged:
                ended = status == "ok"  # a stopped run (interrupted, pruned) has not ended: the stuck rule waits
                if self.step_count > self.logged[1]:
                    self.report(loss_total, final=ended)
                elif self.step_count > start_step and ended:
                    self.judge(self.last_loss, final=True)  # at the progress reached since that log line
            if self.diverged:
                status, error = "diverged", self.diverged
        except Exception as e:
            status, error = "failed", f"{type(e).__name__}: {e}"
            raise
        finally:
            if prof is not None and self.step_count < profile_end:  # the run ended inside the profiled steps
                self.write_profile(prof, profile_first, profile_s)
            try:  # the handlers stay until the row is written: a signal now still leaves an interrupted row
                summary = self.finish(status, error, params, peak, git_commit, git_dirty)
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)
        return summary

    def write_profile(self, prof, first: int, seconds: float):
        """runs/<id>/profile.txt (and trace.json) of the steps profiled since step `first`; the top
        three ops go into the ledger. A profile that cannot be taken says so in the file."""
        steps, path, kind = self.step_count - first, self.run_dir / "profile.txt", self.backend.kind
        header = [f"run {self.run_id}: {kind} on {self.device}, dtype {self.backend.dtype_name}, "
                  f"rank 0 of {self.backend.world_size}", f"{steps} steps profiled from step {first + 1} (after the warm-up "
                  f"and the first steady step): {seconds / max(steps, 1) * 1000:.1f} ms per step, kept out of train_s"]
        try:
            if isinstance(prof, Exception):  # from start_profile
                raise prof
            ops, graphs = self.backend.stop_profile(prof, self.run_dir)
            text, top = kernels.profile.table(header, ops, steps, seconds / max(steps, 1), kind, graphs)
        except Exception as e:
            text, top = "".join(f"# {line}\n" for line in header + [f"no profile: {type(e).__name__}: {e}"]), []
        path.write_text(text)
        self.profile_top = ", ".join(f"{name} {share}" for name, share in top)
        self.log(f"profile:{path} top:" + (",".join(f"{name.replace(' ', '_')}={share}" for name, share in top) or "-"))

    def log_stage(self):
        self.log(f"stage:{self.stage} step:{self.step_count} train_s:{self.train_s:.1f} "
                 + stage_line(self.stages[self.stage], self.model, self.stage_flops_per_token))

    def finish(self, status, error, params, peak, git_commit, git_dirty) -> dict:
        """Checkpoint (ok or interrupted runs), evaluate (ok runs), ledger row: always, also when the save or the
        evaluation fails or a signal comes. A precompile run instead runs one eval batch and reports what it compiled."""
        cfg, backend = self.cfg, self.backend
        backend.wait()
        compiles = backend.compile_stats()
        if self.precompile:
            if status == "ok":
                self.evaluate(cfg.eval.tokens, max_batches=1)  # result ignored: under graph extraction it is zeros
                if self.kit_bytes is not None and self.is_main:
                    self.save()
                    self.evaluate_kit(max_batches=1)
                compiles = backend.compile_stats()
            self.loader.close()
            self.log(f"precompile status:{status} steps:{self.step_count} eval_batches:1 xla_compiles:"
                     f"{compiles[0] if compiles else '-'} compile_s:{compiles[1] if compiles else self.compile_s:.2f}")
            if self.is_main:
                self.log_file.close()
                self.metrics_file.close()
            return dict(status=status)
        val_loss = val_bpb = val_tokens = val_bytes = kit_val_bpb = failure = None
        eval_s = 0.0
        try:
            if self.is_main and status in ("ok", "interrupted") and self.step_count > 0:
                self.save()  # before the evaluation, so a kill during it loses no training
            if status == "ok" and self.stop_signal is None:
                start = time.perf_counter()
                val_loss, val_bpb, val_tokens, val_bytes = self.evaluate(cfg.eval.tokens)
                if self.kit_bytes is not None and self.is_main and self.stop_signal is None:
                    kit_val_bpb = self.evaluate_kit()
                eval_s = time.perf_counter() - start
                compiles = backend.compile_stats()
            if status == "ok" and backend.agree(0.0, self.stop_signal is not None)[1]:  # during save or eval
                status, val_loss, val_bpb, val_tokens, val_bytes, kit_val_bpb = "interrupted", *[None] * 5
            if val_bpb is not None:
                self.metric("final", eval_s=eval_s, val_loss=val_loss, val_bpb=val_bpb, kit_val_bpb=kit_val_bpb)
        except Exception as e:  # a full disk, a failing evaluation: the row still records the run
            status, error, failure = "failed", f"{type(e).__name__}: {e}", e
        tokens = self.tokens
        fpt = self.flops / tokens if tokens else self.stage_flops_per_token  # token-weighted over stages
        notes = [cfg.ledger.notes] if cfg.ledger.notes else []
        if self.resumed:
            notes.append(f"resumed from {self.resumed['run_id']} at step {self.resumed['step']}")
        if status == "ok" and self.routing_agreement is not None:
            notes.append(f"routing_agreement={self.routing_agreement:.4f} (eval tiles where the causal predictor "
                         f"matched the training top-k)")
        notes.append(f"peak_flops={peak[0]:.4g} {peak[1]}")
        measured = self.tokens_per_s  # what the steps really took, for MFU: its peak was measured under the same load
        if self.step_costs and self.step_ms:  # the calibrated clock's tokens/s are not the machine's
            measured = self.steady_tokens / sum(self.step_ms) * 1000
            notes.append(f"measured_tokens_per_s={measured:.0f}")
        if self.step_costs and self.clock_source:
            notes.append(f"step costs made elsewhere, not measured here: {self.clock_source}; {clock.ASSUMED}")
        if cfg.budget.reference_step_ms:
            notes.append(f"budget {cfg.budget.seconds:g} s at the baseline's reference step of "
                         f"{cfg.budget.reference_step_ms:g} ms")
        if cfg.device.dtype == "auto":  # auto's choice depends on the CPU, not the recipe
            notes.append(f"dtype={backend.dtype_name} (auto){', attention float32' if backend.attn_float32 else ''}")
        if status == "pruned":
            notes.append(f"pruned at p={self.train_s / cfg.budget.seconds:.3f}, its last curve point val_bpb="
                         f"{self.last_curve[1]:.4f} at p={self.last_curve[0]:.3f}" if self.curve_points else "pruned")
        if self.curve_points:
            notes.append(f"curve_evals={self.curve_points} curve_eval_s={self.curve_s:.1f}")
        if compiles:
            notes.append(f"xla_transfers={backend.transfers()} warmup_s={self.compile_s:.2f}")
        if self.compiled:  # graphs torch.compile traced in this process: train and eval, per stage
            notes.append(f"compiled_graphs={torch._dynamo.utils.counters['stats']['unique_graphs']}")
        if error:
            notes.append(error)
        row = dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), run_id=self.run_id, git_commit=git_commit,
            git_dirty=git_dirty, config=self.config_path, config_sha=hashlib.sha256(json.dumps(
                dataclasses.asdict(cfg), sort_keys=True).encode()).hexdigest()[:12],
            overrides=" ".join(self.overrides), device=str(self.device), world_size=backend.world_size,
            seed=cfg.run.seed, data_sha=self.data_sha, params=params, active_params=active_params(self.model),
            budget_s=cfg.budget.seconds, train_s=self.train_s, compile_s=compiles[1] if compiles else self.compile_s,
            data_wait_s=self.data_wait_s + self.loader.wait_s, eval_s=eval_s, steps=self.step_count, tokens=tokens,
            tokens_per_s=self.tokens_per_s, step_ms_p50=statistics.median(self.step_ms) if self.step_ms else None, flops_per_token=fpt,
            mfu=fpt * measured / (peak[0] * backend.world_size), val_loss=val_loss, val_bpb=val_bpb,
            val_tokens=val_tokens, val_bytes=val_bytes, kit_val_bpb=kit_val_bpb, xla_compiles=compiles[0] if compiles else None,
            peak_mem_mb=backend.peak_memory_mb(), status=status, notes="; ".join(notes), profile=self.profile_top,
            recipe=self.recipe, sweep=cfg.ledger.sweep, variant=cfg.ledger.variant, machine=self.machine,
            clock=cfg.budget.clock, calibration=self.calibration, step_cost_ms=" ".join(f"{c * 1000:.2f}" for c in self.step_costs or ()),
            stages=" ".join(f"{i}@{start:.1f}s:{steps}:d{self.stages[i].virtual_depth}" for i, start, steps in self.timeline))
        self.loader.close()
        if self.is_main:
            ledger.append(cfg.ledger.path, row)
            self.log("summary " + " ".join(f"{k}:{v:.6g}" if isinstance(v, float) else f"{k}:{v}"
                                           for k, v in row.items() if v not in (None, "") and k not in ("notes", "profile")))
            self.log_file.close()
            self.metrics_file.close()
        if failure:
            raise failure
        return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(BASE_CONFIG), help="YAML config (default configs/base.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides; later ones win")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit, reading no data, compiling nothing: "
                        "parameters, FLOPs and tokens per step, rank (WORLD_SIZE) and stage, XLA graphs, memory per rank; "
                        "device.type xla or neuron: on trn2 for both launch shapes the kit allows, HBM, peak, 40%% MFU step; "
                        "under a calibration made elsewhere (a chip clock) the steps and stage switches it gives")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.plan:
            print(plan_text(cfg, args.config))
            return 0
        trainer = Trainer(cfg, args.config, args.overrides)
    except (ConfigError, data.DataError, CheckpointError, ledger.LedgerError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        status = trainer.train()["status"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 128 + (trainer.stop_signal or signal.SIGTERM) if status == "interrupted" else (0 if status in ("ok", "pruned") else 1)


if __name__ == "__main__":
    sys.exit(main())
