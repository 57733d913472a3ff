"""AION's configuration: nested frozen dataclasses, one per section of configs/base.yaml (where
every default lives, once); loading (a config merged over its `base:` chain, then key.sub=value
overrides, unknown keys answered with the closest known one); validation, naming the key, the
value and what was expected; the annealing stages resolved against the model; and the recipe
hash, which names what a run learns (runs of one recipe are repeats: an arm of an experiment).

    cfg = load_config("configs/cpu.yaml", ["optim.muon_lr=0.02"])

train.py, sweep.py and the tools import this module; it imports nothing of AION's but the
names it checks values against (data.ORDERS, kernels.OPS and kernels.IMPLS, model.slow_pairs).
"""
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import get_type_hints

import yaml

import data
import kernels
from model import slow_pairs

ROOT = Path(__file__).resolve().parent
BASE_CONFIG = ROOT / "configs" / "base.yaml"


@dataclass(frozen=True)
class RunConfig:
    name: str
    seed: int
    out_dir: str
    log_every: int
    precompile: bool
    profile_steps: int


@dataclass(frozen=True)
class DataConfig:
    source: str
    path: str
    tokenizer: str
    tokenizer_kind: str
    val_shard: str
    val_fraction: float
    seq_len: int
    prefetch: int
    order: str
    row_pool: int
    row_pool_from: int
    replay: str


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    mlp_mult: int
    mlp: str
    tie_embeddings: bool
    logit_softcap: float
    rope_base: float
    qk_gain_init: float
    embed_init_std: float
    value_embed: bool
    value_embed_ends: bool
    x0_shortcut: bool
    x0_init: float
    head_init_std: float
    mlp_in_init: float
    bigram_buckets: int
    unet: bool
    parallel_layers: int
    doc_mask: bool
    smear_gate: bool
    gate_window: int
    attn_gate: str
    attn_gate_scale: float
    rope_fraction: float
    ln_scale: bool
    skip_gates: bool
    xsa_layers: int
    parallel_lanes: int
    leaky_slope: float
    qk_gain_learned: bool
    key_offset: float
    attn_source_after: int
    attn_source_layers: tuple


@dataclass(frozen=True)
class ModConfig:
    granularity: str
    layers: tuple
    block_size: int
    capacity: float
    aux_weight: float
    recur: bool


@dataclass(frozen=True)
class OptimConfig:
    batch_tokens: int
    micro_batch: int
    muon_lr: float
    muon_momentum: float
    muon_momentum_start: float
    muon_momentum_warmup: float
    muon_momentum_warmup_steps: int
    muon_ns_steps: int
    muon_ns: str
    muon_row_norm: bool
    muon_wd: float
    muon_wd_cautious: bool
    normuon_beta2: float
    muon_bf16: bool
    mlp_proj_lr: float
    embed_lr: float
    head_lr: float
    scalar_lr: float
    beta1: float
    beta2: float
    embed_betas: tuple
    head_betas: tuple
    scalar_betas: tuple
    weight_decay: float
    head_wd: float
    warmup: float
    warmup_steps: int
    warmdown: float
    warmdown_steps: int
    lr_floor: float
    grad_clip: float
    ema: float
    ema_every: int
    ema_blend: float
    ema_prewarm: bool
    mtp_weights: tuple
    mtp_until: tuple
    mtp_levels: int
    mask_bos_targets: bool


@dataclass(frozen=True)
class ScheduleConfig:
    stages: tuple
    grow_depth: str
    grow_init: str
    recur_gate: bool


@dataclass(frozen=True)
class Stage:
    """One entry of schedule.stages, resolved: what a stage leaves out carries over from the one
    before it, and the first stage's from the full model. A stage is entered at progress `at` (a
    fraction of the budget; one given in seconds is converted), or after at_tokens training tokens
    when that is not 0. recur: passes through the loop span recur_span (its first and last position
    among the active layers; the weights are shared), 1 = each active layer once. doc_mask and
    xsa_layers: model.doc_mask and model.xsa_layers in this stage. lr: the factor of every group's LR
    in this stage; where a stage leaves it out (it does not carry over) sqrt(batch_tokens /
    optim.batch_tokens), the square-root rule for adaptive optimizers (Malladi et al. 2022, arXiv
    2205.10287). FrontierForge K82s4's batch ramp sets its own: a quarter batch at 0.35, a half at 0.6.
    mtp: the extra targets of optim.mtp_weights the training objective computes in this stage, the first mtp
    (default all); one left out must have faded (optim.mtp_until) by the stage, so the objective is the same
    function, its logits materialised for fewer targets or, at 0, not at all (the configured fused head)."""
    at: float
    depth: int
    mlp_hidden: int
    seq_len: int
    attn_scale: float
    mlp_scale: float
    capacity: float
    batch_tokens: int
    at_tokens: int = 0
    recur: int = 1
    recur_span: tuple = ()
    doc_mask: bool = False
    xsa_layers: int = 0
    lr: float = 1.0
    mtp: int = 0

    @property
    def loop_layers(self) -> int:
        return self.recur_span[1] - self.recur_span[0] + 1 if self.recur > 1 else 0

    @property
    def virtual_depth(self) -> int:
        """Layers a token passes through: the active ones, and the loop's again on each extra pass."""
        return self.depth + (self.recur - 1) * self.loop_layers


MLP_GRANULE = 128  # stage MLP widths are multiples of this (the Trainium partition count), or the full width


@dataclass(frozen=True)
class BudgetConfig:
    seconds: float
    count_compile: bool
    max_steps: int
    charge: str
    startup_steps: int
    startup_cap_s: float
    clock: str
    calibration: str
    reference_step_ms: float


@dataclass(frozen=True)
class EvalConfig:
    tokens: int
    seq_len: int
    batch_size: int
    every_seconds: float
    curve_tokens: int
    kit_seq_len: int
    kit_tokens: int


@dataclass(frozen=True)
class DeviceConfig:
    type: str
    dtype: str
    attn_dtype: str
    bf16: str
    compile: bool
    compile_cache: str


@dataclass(frozen=True)
class KernelsConfig:
    head: str
    rmsnorm: str
    qk_norm_rope: str
    relu2: str


@dataclass(frozen=True)
class LedgerConfig:
    path: str
    notes: str
    sweep: str
    variant: str


@dataclass(frozen=True)
class CheckpointConfig:
    path: str
    every_seconds: float
    resume: str


@dataclass(frozen=True)
class Config:
    run: RunConfig
    data: DataConfig
    model: ModelConfig
    mod: ModConfig
    schedule: ScheduleConfig
    optim: OptimConfig
    budget: BudgetConfig
    eval: EvalConfig
    device: DeviceConfig
    kernels: KernelsConfig
    ledger: LedgerConfig
    checkpoint: CheckpointConfig


class ConfigError(ValueError):
    pass


positive = (lambda v: v > 0, "> 0")
non_negative = (lambda v: v >= 0, ">= 0")
fraction = (lambda v: 0 <= v <= 1, "in [0, 1]")


def number(v) -> bool:  # an element of a list-valued key: YAML's int or float, finite, not a bool
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def one_of(*choices):
    return (lambda v: v in choices, "one of " + " | ".join(choices))


CHECKS = {
    "run.name": (lambda v: v not in ("", ".", "..") and Path(v).name == v, "a plain name (no '/', not empty or '..')"),
    "run.seed": (lambda v: 0 <= v < 2 ** 32, "in [0, 2**32) (numpy's seed range)"),
    "run.log_every": positive, "run.profile_steps": non_negative, "data.source": one_of("builtin", "shards", "parquet"),
    "data.tokenizer_kind": one_of(*data.TOKENIZER_KINDS),
    "data.val_fraction": (lambda v: 0 < v < 1, "in (0, 1)"), "data.seq_len": positive,
    "data.path": (bool, "a folder (not empty): the built-in corpus's cache, the shards' or the parquet files' folder"),
    "data.prefetch": non_negative, "data.order": one_of(*data.ORDERS), "data.row_pool": non_negative,
    "data.row_pool_from": non_negative,
    "model.vocab_size": (lambda v: 2 <= v <= 65536, "in [2, 65536] (uint16 shards)"),
    "model.n_layer": positive, "model.n_embd": positive, "model.n_head": positive, "model.n_kv_head": positive,
    "model.mlp_mult": positive, "model.mlp": one_of("relu2", "leaky_relu2", "swiglu"), "model.logit_softcap": non_negative,
    "model.rope_base": positive, "model.attn_gate": one_of("none", "dense", "sparse"),
    "model.attn_gate_scale": positive, "model.rope_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "model.parallel_lanes": (lambda v: v in (1, 2), "1 or 2"),
    "model.leaky_slope": (lambda v: 0 <= v < 1, "in [0, 1)"), "model.key_offset": non_negative,
    "model.attn_source_layers": (lambda v: all(isinstance(i, int) and not isinstance(i, bool) for i in v),
                                 "a list of integers"), "optim.muon_ns": one_of("quintic", "polar_express"),
    "optim.muon_wd": non_negative, "mod.granularity": one_of("none", "block", "token", "layer", "microbatch"),
    "mod.block_size": positive, "mod.capacity": (lambda v: 0 < v <= 1, "in (0, 1]"), "mod.aux_weight": non_negative,
    "mod.layers": (lambda v: all(isinstance(i, int) and not isinstance(i, bool) for i in v), "a list of integers"),
    "schedule.grow_depth": one_of("append", "interleave"), "schedule.grow_init": one_of("zero", "copy"), "model.embed_init_std": positive,
    "model.bigram_buckets": (lambda v: v == 0 or v >= 2, "0 (off) or >= 2"), "optim.muon_momentum_start": fraction,
    "optim.muon_momentum_warmup": fraction, "optim.muon_momentum_warmup_steps": non_negative,
    "optim.warmup_steps": non_negative, "optim.batch_tokens": positive,
    "optim.micro_batch": positive, "optim.muon_lr": non_negative, "optim.muon_momentum": fraction,
    "optim.ema": (lambda v: 0 <= v < 1, "in [0, 1)"), "optim.ema_every": positive, "optim.ema_blend": fraction,
    "optim.mtp_weights": (lambda v: all(number(w) and w >= 0 for w in v), "a list of numbers >= 0"),
    "optim.mtp_until": (lambda v: all(number(u) and 0 < u <= 1 for u in v), "a list of numbers in (0, 1]"),
    **{f"optim.{group}_betas": (lambda v: len(v) in (0, 2) and all(number(b) and 0 <= b < 1 for b in v),
                                "[] (= [optim.beta1, optim.beta2]) or two numbers in [0, 1)")
       for group in ("embed", "head", "scalar")},
    "optim.mtp_levels": non_negative, "model.head_init_std": non_negative, "model.mlp_in_init": positive,
    "optim.muon_ns_steps": positive, "optim.embed_lr": non_negative, "optim.head_lr": non_negative,
    "optim.scalar_lr": non_negative, "optim.beta1": fraction, "optim.beta2": fraction,
    "optim.weight_decay": non_negative, "optim.warmup": fraction, "optim.warmdown": fraction,
    "optim.normuon_beta2": (lambda v: 0 <= v < 1, "in [0, 1) (0 = off)"), "optim.mlp_proj_lr": positive,
    "optim.head_wd": (lambda v: v == -1 or v >= 0, "-1 (= optim.weight_decay) or >= 0"),
    "optim.warmdown_steps": non_negative,
    "optim.lr_floor": fraction, "optim.grad_clip": non_negative, "budget.seconds": positive,
    "budget.max_steps": non_negative, "budget.charge": one_of("aion", "kit"),
    "budget.startup_steps": positive, "budget.startup_cap_s": non_negative, "budget.clock": one_of("wall", "calibrated"),
    "budget.reference_step_ms": non_negative, "eval.tokens": non_negative, "eval.seq_len": non_negative,
    "eval.batch_size": positive,
    "eval.every_seconds": non_negative, "eval.curve_tokens": non_negative,
    "eval.kit_seq_len": positive, "eval.kit_tokens": non_negative,
    "device.type": one_of("auto", "cpu", "cuda", "xla", "neuron"),
    "device.dtype": one_of("auto", "float32", "bfloat16"),
    "device.attn_dtype": one_of("auto", "float32", "compute"), "device.bf16": one_of("autocast", "weights"),
    "checkpoint.every_seconds": non_negative,
    **{f"kernels.{op}": one_of("auto", *kernels.IMPLS) for op in kernels.OPS},
}


def read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(doc).__name__}")
    return doc


def merge(into: dict, over: dict) -> dict:
    out = dict(into)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_chain(path: Path, seen=()) -> dict:
    """A config merged over its `base:` chain; configs/base.yaml is the root of every chain."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: `base:` chain loops back to itself")
    doc = read_yaml(path)
    base = doc.pop("base", None)
    if base is not None:
        parent = load_chain(path.parent / base, seen + (path,))
    elif path != BASE_CONFIG.resolve():
        parent = load_chain(BASE_CONFIG)
    else:
        parent = {}
    return merge(parent, doc)


def apply_override(tree: dict, override: str) -> dict:
    key, eq, text = override.partition("=")
    if not eq or not key:
        raise ConfigError(f"override {override!r}: expected key.sub=value")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({e})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return merge(tree, value)


def coerce(value, typ, key):
    if typ is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)  # YAML 1.1 reads 3e-4 as a string
        except ValueError:
            pass
    if typ is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if typ is str and value is None:
        return ""
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if typ is tuple and isinstance(value, list):
        return tuple(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")
    return value


def build(cls, tree: dict, prefix=""):
    hints = get_type_hints(cls)
    for key in tree:
        if key not in hints:
            close = difflib.get_close_matches(key, hints, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; expected one of {', '.join(hints)}"
            raise ConfigError(f"unknown key {prefix}{key}{hint}")
    values = {}
    for name, typ in hints.items():
        key = prefix + name
        if name not in tree:
            raise ConfigError(f"missing key {key} (configs/base.yaml defines every key)")
        value = tree[name]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
            values[name] = build(typ, value, key + ".")
            continue
        value = coerce(value, typ, key)
        if key in CHECKS and not CHECKS[key][0](value):
            raise ConfigError(f"{key}: expected {CHECKS[key][1]}, got {value!r}")
        values[name] = value
    return cls(**values)


def validate(cfg: Config):
    m, o = cfg.model, cfg.optim
    if m.n_embd % m.n_head or m.n_head % m.n_kv_head or (m.n_embd // m.n_head) % 2:
        raise ConfigError(f"model: n_embd ({m.n_embd}) must split into n_head ({m.n_head}) heads of even size, "
                          f"and n_kv_head ({m.n_kv_head}) must divide n_head")
    if not 0 <= m.parallel_layers <= m.n_layer:
        raise ConfigError(f"model.parallel_layers: expected 0..{m.n_layer} (at most model.n_layer), got {m.parallel_layers}")
    if not 0 <= m.xsa_layers <= m.n_layer:
        raise ConfigError(f"model.xsa_layers: expected 0..{m.n_layer} (at most model.n_layer), got {m.xsa_layers}")
    if not 1 <= m.gate_window <= m.n_embd:
        raise ConfigError(f"model.gate_window: expected 1..{m.n_embd} (model.n_embd), got {m.gate_window}")
    head_dim = m.n_embd // m.n_head
    if 2 * round(m.rope_fraction * head_dim / 2) < 2:
        raise ConfigError(f"model.rope_fraction: {m.rope_fraction} of a head's {head_dim} dimensions rotates none of "
                          f"them; expected at least {2 / head_dim:.3g} (one pair)")
    slow = int(slow_pairs(m, cfg.data.seq_len).sum()) if m.key_offset else 0
    if m.key_offset and not 0 < slow < head_dim // 2:
        raise ConfigError(f"model.key_offset: a radius of {m.key_offset} rad makes {slow} of a head's {head_dim // 2} "
                          f"rotary pairs slow (turning less than it over data.seq_len = {cfg.data.seq_len} positions); "
                          f"expected some, not all")
    if m.skip_gates and not m.unet:
        raise ConfigError("model.skip_gates: gates the U-net skips, so it needs model.unet=true")
    if m.parallel_lanes == 2 and not m.parallel_layers:
        raise ConfigError("model.parallel_lanes=2: the parallel decoder is the last model.parallel_layers blocks, "
                          "so it needs model.parallel_layers >= 1 (at most model.n_layer)")
    if m.parallel_lanes == 2 and cfg.mod.granularity != "none":
        raise ConfigError(f"model.parallel_lanes=2: two residual lanes are not routed; expected mod.granularity=none, "
                          f"got {cfg.mod.granularity}")
    for key, value, needs in (("value_embed_ends", m.value_embed_ends, "value_embed"),
                              ("x0_init", m.x0_init, "x0_shortcut")):
        if value and not getattr(m, needs):
            raise ConfigError(f"model.{key}={value}: changes model.{needs}, so it needs model.{needs}=true")
    if (o.head_betas or m.head_init_std) and m.tie_embeddings:
        raise ConfigError(f"optim.head_betas={list(o.head_betas)}, model.head_init_std={m.head_init_std}: the untied "
                          f"head's; with model.tie_embeddings=true there is none (expected [] and 0)")
    if o.head_wd >= 0 and m.tie_embeddings:
        raise ConfigError(f"optim.head_wd: the head is the embedding table with model.tie_embeddings=true (its decay is "
                          f"optim.weight_decay); expected -1, got {o.head_wd}")
    if o.warmdown_steps and not o.warmdown:
        raise ConfigError(f"optim.warmdown_steps: cuts the warm-down into steps, so it needs optim.warmdown > 0, got "
                          f"{o.warmdown_steps} steps and optim.warmdown {o.warmdown}")
    if len(o.mtp_until) != len(o.mtp_weights) or any(a <= b for a, b in zip(o.mtp_until, o.mtp_until[1:])):
        raise ConfigError(f"optim.mtp_until: expected one progress per optim.mtp_weights entry ({len(o.mtp_weights)}), "
                          f"decreasing (the farthest target fades first), got {list(o.mtp_until)}")
    for steps, fraction in (("warmup_steps", "warmup"), ("muon_momentum_warmup_steps", "muon_momentum_warmup")):
        if getattr(o, steps) and getattr(o, fraction):
            raise ConfigError(f"optim.{steps}={getattr(o, steps)} and optim.{fraction}={getattr(o, fraction)}: one "
                              f"ramp, in steps or in a fraction of the budget; expected one of them 0")
    if o.warmup + o.warmdown > 1:
        raise ConfigError(f"optim.warmup + optim.warmdown must be <= 1, got {o.warmup} + {o.warmdown}")
    if o.batch_tokens % (o.micro_batch * cfg.data.seq_len):
        raise ConfigError(f"optim.batch_tokens ({o.batch_tokens}) must be a multiple of optim.micro_batch * "
                          f"data.seq_len ({o.micro_batch} * {cfg.data.seq_len})")
    e, window = cfg.eval, eval_seq_len(cfg)  # evaluation scores whole windows
    window_key = "eval.seq_len" if e.seq_len else "data.seq_len"
    if 0 < e.tokens < window:
        raise ConfigError(f"eval.tokens ({e.tokens}) must be 0 (all) or at least {window_key} ({window})")
    if e.every_seconds and e.curve_tokens < window:
        raise ConfigError(f"eval.curve_tokens ({e.curve_tokens}) must be at least {window_key} ({window}) when "
                          f"eval.every_seconds is set")
    kit_batch = eval_rows(cfg, e.kit_seq_len) * e.kit_seq_len
    if cfg.data.tokenizer_kind == "tiktoken" and 0 < e.kit_tokens < kit_batch:
        raise ConfigError(f"eval.kit_tokens ({e.kit_tokens}) must be 0 (off) or at least one batch of the kit's rows, "
                          f"{eval_rows(cfg, e.kit_seq_len)} x eval.kit_seq_len ({e.kit_seq_len}) = {kit_batch}")
    r = cfg.mod
    if r.recur and r.granularity not in ("block", "token"):
        raise ConfigError(f"mod.recur: routes a loop's passes by tile or token, so it needs mod.granularity block or "
                          f"token, got {r.granularity}")
    if r.granularity != "none":
        if (not r.layers and not r.recur) or len(set(r.layers)) != len(r.layers) \
                or not all(0 <= i < m.n_layer for i in r.layers):
            raise ConfigError(f"mod.layers: expected distinct layer indices in [0, {m.n_layer}) (model.n_layer), "
                              f"got {list(r.layers)} (empty only with mod.recur)")
        if r.granularity == "block" and cfg.data.seq_len % r.block_size:
            raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) must be a multiple of mod.block_size ({r.block_size})")
    source, readers = m.attn_source_after, m.attn_source_layers
    if source != -1 and not 0 <= source < m.n_layer - 1:
        raise ConfigError(f"model.attn_source_after: expected -1 (off) or a block 0..{m.n_layer - 2} (model.n_layer - 2: "
                          f"later blocks read it), got {source}")
    if (source == -1) != (not readers):
        raise ConfigError(f"model.attn_source_after, model.attn_source_layers: expected both set (the source block and "
                          f"the later blocks that read it) or neither, got {source} and {list(readers)}")
    if readers and (len(set(readers)) != len(readers) or not all(source < i < m.n_layer for i in readers)):
        raise ConfigError(f"model.attn_source_layers: expected distinct blocks after model.attn_source_after ({source}), "
                          f"in {source + 1}..{m.n_layer - 1}, got {list(readers)}")
    if readers and m.parallel_layers:
        raise ConfigError(f"model.attn_source_layers: attention-source reuse is defined for sequential blocks; expected "
                          f"model.parallel_layers=0, got {m.parallel_layers}")
    if readers and r.granularity != "none" and set(readers) & set(r.layers):
        raise ConfigError(f"model.attn_source_layers: the readers {sorted(set(readers) & set(r.layers))} may not be "
                          f"Mixture-of-Depths layers (mod.layers)")
    b = cfg.budget
    if b.clock == "calibrated" and (not b.calibration or b.count_compile):
        raise ConfigError("budget.clock=calibrated needs budget.calibration (a calibration file, made by python sweep.py "
                          "SWEEP --calibrate-only) and budget.count_compile=false (compile time is not calibrated)")
    if b.clock == "wall" and (b.calibration or b.reference_step_ms):
        raise ConfigError("budget.calibration and budget.reference_step_ms need budget.clock=calibrated")
    d = cfg.data
    if d.source == "shards" and not d.tokenizer:
        raise ConfigError("data.tokenizer: data.source=shards needs the shards' tokenizer (a sentencepiece .model, or "
                          "with data.tokenizer_kind=tiktoken a folder with tokenizer.pkl and token_bytes.pt)")
    if d.source == "parquet" and (d.tokenizer_kind != "tiktoken" or not d.tokenizer):
        raise ConfigError(f"data.source=parquet reads the kit's text with the kit's tokenizer: expected "
                          f"data.tokenizer_kind=tiktoken and data.tokenizer=<folder with tokenizer.pkl and token_bytes.pt>, "
                          f"got {d.tokenizer_kind} and {d.tokenizer!r}")
    if d.source != "builtin" and d.path == base_values()["data.path"]:
        files = "the kit's shard_*.parquet files" if d.source == "parquet" else "fineweb_{train,val}_*.bin shards"
        raise ConfigError(f"data.path: data.source={d.source} reads {files} from it, but it is left at base.yaml's "
                          f"{d.path!r} (the built-in corpus's cache); expected their folder")
    if d.val_shard and d.source != "parquet":
        raise ConfigError(f"data.val_shard names a parquet file of data.path: needs data.source=parquet, got {d.source}")
    if d.row_pool and d.order == "shuffle":
        raise ConfigError(f"data.row_pool={d.row_pool}: pools the rows of an ordered stream, and data.order=shuffle "
                          f"already draws its rows at random; expected data.order contiguous or packed, or data.row_pool=0")
    if (d.order == "replay") != bool(d.replay):
        raise ConfigError(f"data.order={d.order}, data.replay={d.replay!r}: a replay trains on the rows of the file "
                          f"data.replay names; expected both (data.order=replay and a file) or neither")
    if d.replay and d.row_pool:
        raise ConfigError(f"data.row_pool={d.row_pool}: data.replay's rows are replayed in the order they were trained on; "
                          f"expected data.row_pool=0")
    if d.row_pool_from and not d.row_pool:
        raise ConfigError(f"data.row_pool_from={d.row_pool_from}: the micro-batches before the row pool starts, but "
                          f"data.row_pool=0 (no pool); expected data.row_pool > 0 or data.row_pool_from=0")
    if b.charge == "kit" and b.count_compile:
        raise ConfigError("budget.count_compile: with budget.charge=kit every step after budget.startup_steps counts, "
                          "compile included, and the startup before is free up to budget.startup_cap_s; expected false")
    stages = resolve_stages(cfg)
    lengths = [s.seq_len for s in stages if s.seq_len != d.seq_len]
    if d.row_pool and lengths:
        raise ConfigError(f"data.row_pool={d.row_pool}: the pool holds rows of data.seq_len ({d.seq_len}) tokens, but a "
                          f"schedule stage sets seq_len {lengths[0]}; expected data.row_pool=0 with such stages")
    if d.replay and lengths:
        raise ConfigError(f"data.replay={d.replay}: holds rows of data.seq_len ({d.seq_len}) + 1 tokens, but a schedule "
                          f"stage sets seq_len {lengths[0]}; expected no such stage with a replay")
    if readers and any(stage.recur > 1 for stage in stages):
        raise ConfigError("model.attn_source_layers: a loop (a schedule stage with recur > 1) is not defined with "
                          "attention-source reuse")
    if r.granularity == "block" and any(stage.doc_mask for stage in stages):
        raise ConfigError("model.doc_mask: a routed tile can hold the end of one document and the start of the "
                          "next, and its routing reads the tile before it; expected mod.granularity token, layer "
                          "or microbatch with document masking, got block")


SWITCH_POINT = re.compile(r"^\s*([0-9][0-9.e+]*)\s*(s|tokens)\s*$")


def switch_point(value, key: str, seconds: float) -> tuple:
    """A stage's `at` -> (fraction of the budget, training tokens or 0): a number is a fraction of
    budget.seconds, "45s" seconds of the budget's clock (kept as a fraction of it, so 45 s stay
    45 s whatever the budget), "2e6 tokens" the training tokens after which the stage starts."""
    if not isinstance(value, str):
        return coerce(value, float, key), 0
    match = SWITCH_POINT.match(value)
    try:
        number = float(match[1]) if match else None
    except ValueError:
        number = None
    if number is None:
        raise ConfigError(f"{key}: expected a fraction of the budget, seconds ('45s') or tokens ('2e6 tokens'), "
                          f"got {value!r}")
    if match[2] == "s":
        return number / seconds, 0
    if not number.is_integer() or number < 1:
        raise ConfigError(f"{key}: expected a whole number of tokens >= 1, got {value!r}")
    return 0.0, int(number)


def resolve_stages(cfg: Config) -> tuple:
    """schedule.stages -> Stage tuple, each checked against the model; no stages = one static stage."""
    m, full_hidden, extra = cfg.model, cfg.model.mlp_mult * cfg.model.n_embd, len(cfg.optim.mtp_weights)
    previous = Stage(0.0, m.n_layer, full_hidden, cfg.data.seq_len, 1.0, 1.0, cfg.mod.capacity, cfg.optim.batch_tokens,
                     doc_mask=m.doc_mask, xsa_layers=m.xsa_layers, mtp=extra)
    if not cfg.schedule.stages:
        if cfg.mod.recur:
            raise ConfigError("mod.recur: routes the extra passes of a loop, but no schedule stage sets recur > 1")
        return (previous,)
    fields = {k: v for k, v in get_type_hints(Stage).items() if k != "at_tokens"}  # tokens are written in `at`
    stages = []
    order = depth_order(m.n_layer, cfg.schedule.grow_depth)
    for n, entry in enumerate(cfg.schedule.stages):
        key = f"schedule.stages[{n}]"
        if not isinstance(entry, dict) or "at" not in entry:
            raise ConfigError(f"{key}: expected a mapping with `at` (a fraction of the budget, seconds or tokens), "
                              f"got {entry!r}")
        for name in entry:
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1)
                raise ConfigError(f"unknown key {key}.{name}; " + (f"did you mean {close[0]}?" if close else
                                                                   f"expected one of {', '.join(fields)}"))
        at, at_tokens = switch_point(entry["at"], f"{key}.at", cfg.budget.seconds)
        values = {k: coerce(v, fields[k], f"{key}.{k}") for k, v in entry.items() if k != "at"}
        stage = dataclasses.replace(previous, at=at, at_tokens=at_tokens, **values)
        if "lr" not in values:  # the square-root rule for this stage's batch, not the stage before's lr
            stage = dataclasses.replace(stage, lr=(max(stage.batch_tokens, 0) / cfg.optim.batch_tokens) ** 0.5)
        rows = stage_rows(cfg, stage)
        least = previous if n else Stage(0.0, 1, 1, 1, 0.0, 0.0, 0.0, 1)  # growth only: from the stage before
        copy = cfg.schedule.grow_init == "copy"
        span = stage.recur_span
        looped = sorted(order[:stage.depth])[span[0]:span[1] + 1] if stage.recur > 1 and len(span) == 2 else []
        problems = [
            (n == 0 and (at, at_tokens) != (0, 0), "at: the first stage must be at 0"),
            (n > 0 and at_tokens and not (previous.at == 0 and previous.at_tokens < at_tokens),
             f"at: expected increasing token counts, after {previous.at_tokens}, before any stage switched by time "
             f"(a schedule switches by tokens, then by time)"),
            (n > 0 and not at_tokens and not previous.at < at < 1,
             f"at: expected increasing values in (0, 1), after {previous.at} (seconds count as fractions of "
             f"budget.seconds, {cfg.budget.seconds:g})"),
            (not least.depth <= stage.depth <= m.n_layer,
             f"depth: expected {least.depth}..{m.n_layer} (growing, at most model.n_layer)"),
            (not least.mlp_hidden <= stage.mlp_hidden <= full_hidden
             or (stage.mlp_hidden % MLP_GRANULE and stage.mlp_hidden != full_hidden),
             f"mlp_hidden: expected a multiple of {MLP_GRANULE} or {full_hidden} (model.mlp_mult * model.n_embd), "
             f"growing from {least.mlp_hidden}"),
            (n > 0 and copy and stage.depth > 2 * previous.depth,
             f"depth: schedule.grow_init=copy copies active layers, so a stage at most doubles the depth "
             f"({previous.depth} before it)"),
            (copy and cfg.schedule.grow_depth != "append", "depth: schedule.grow_init=copy needs schedule.grow_depth=append"),
            (n > 0 and stage.depth > previous.depth and m.x0_init,
             f"depth: a block entering with model.x0_init={m.x0_init} adds x0 and changes the function; growing depth "
             f"needs model.x0_init 0"),
            (stage.seq_len <= 0 or stage.batch_tokens <= 0 or rows != int(rows) or rows < 1,
             f"seq_len, batch_tokens: the micro-batch's sequences, optim.micro_batch * data.seq_len * batch_tokens / "
             f"(optim.batch_tokens * seq_len) = {cfg.optim.micro_batch} * {cfg.data.seq_len} * {stage.batch_tokens} / "
             f"({cfg.optim.batch_tokens} * {stage.seq_len}), must be a whole number"),
            (cfg.mod.granularity == "block" and stage.seq_len % cfg.mod.block_size,
             f"seq_len: expected a multiple of mod.block_size ({cfg.mod.block_size})"),
            (min(stage.attn_scale, stage.mlp_scale) < 0, "attn_scale, mlp_scale: expected >= 0"),
            (previous.at_tokens and not at_tokens and (stage.attn_scale, stage.mlp_scale) != (previous.attn_scale,
                                                                                           previous.mlp_scale),
             "attn_scale, mlp_scale: they move linearly between two stages switched alike; expected those of the stage "
             "switched by tokens before it"),
            (stage.lr <= 0, "lr: expected > 0"),
            (not 0 < stage.capacity <= 1, "capacity: expected in (0, 1]"),
            ("capacity" in entry and cfg.mod.granularity == "none", "capacity: needs mod.granularity other than none"),
            (stage.recur < 1, "recur: expected passes through the loop span >= 1 (1 = no loop)"),
            (stage.recur > 1 and not (len(span) == 2 and all(isinstance(i, int) for i in span)
                                      and 0 <= span[0] <= span[1] < stage.depth),
             f"recur_span: expected [first, last] positions of the active layers, 0 <= first <= last < depth "
             f"({stage.depth})"),
            (set(looped) & set(cfg.mod.layers) and cfg.mod.granularity != "none",
             f"recur_span: the looped layers {looped} may not be Mixture-of-Depths layers (mod.layers; route the loop's "
             f"passes with mod.recur instead)"),
            (stage.recur > 1 and m.unet, "recur: a loop is not defined with model.unet's skips"),
            (stage.recur > 1 and m.parallel_lanes == 2, "recur: a loop is not defined with model.parallel_lanes=2"),
            (not 0 <= stage.xsa_layers <= m.n_layer, f"xsa_layers: expected 0..{m.n_layer} (at most model.n_layer)"),
            (not 0 <= stage.mtp <= extra,
             f"mtp: expected 0..{extra} (the extra targets of optim.mtp_weights it computes)"),
            (stage.mtp < extra and (at_tokens or any(until > at for until in cfg.optim.mtp_until[stage.mtp:])),
             f"mtp: the extra targets after the first {stage.mtp} are left out only once their weights have faded: "
             f"expected a stage switched by time at or after optim.mtp_until {list(cfg.optim.mtp_until[stage.mtp:])}"),
        ]
        for failed, message in problems:
            if failed:
                raise ConfigError(f"{key}.{message}, got {entry}")
        stages.append(previous := stage)
    if cfg.mod.recur and all(stage.recur == 1 for stage in stages):
        raise ConfigError("mod.recur: routes the extra passes of a loop, but no schedule stage sets recur > 1")
    return tuple(stages)


def stage_rows(cfg: Config, stage: Stage) -> float:
    """Sequences per micro-batch in a stage (whole in a valid stage): the tokens per micro-batch
    scale with the stage's tokens per step (the accumulation steps stay), cut into seq_len rows."""
    return cfg.optim.micro_batch * cfg.data.seq_len * stage.batch_tokens / (cfg.optim.batch_tokens * stage.seq_len)


def stage_for(stages: tuple, reached: int, tokens: int, progress: float) -> int:
    """The stage at this progress, or for the tokens trained where stages switch by tokens; never one before
    `reached`, the latest entered (a resumed run with a longer budget keeps its grown model)."""
    return max(reached, max(i for i, stage in enumerate(stages)
                            if (tokens >= stage.at_tokens if stage.at_tokens else stage.at <= progress)))


def eval_seq_len(cfg: Config) -> int:
    """The windows AION's val_bpb scores: eval.seq_len, 0 = the training rows' data.seq_len."""
    return cfg.eval.seq_len or cfg.data.seq_len


def eval_rows(cfg: Config, seq_len: int) -> int:
    """Rows of seq_len per evaluation forward: eval.batch_size rows of data.seq_len's tokens (at least one row)."""
    return max(1, cfg.eval.batch_size * cfg.data.seq_len // seq_len)


def accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank; the global batch must split evenly over the ranks."""
    rank_tokens = cfg.optim.micro_batch * cfg.data.seq_len * world_size
    if cfg.optim.batch_tokens % rank_tokens:
        raise ConfigError(f"optim.batch_tokens ({cfg.optim.batch_tokens}) must be a multiple of optim.micro_batch "
                          f"* data.seq_len * WORLD_SIZE ({cfg.optim.micro_batch} * {cfg.data.seq_len} * {world_size})")
    return cfg.optim.batch_tokens // rank_tokens


def depth_order(n_layer: int, policy: str) -> list:
    """The order in which blocks become active as depth grows: append (at the end) or interleave
    (even blocks first, then the odd ones between them)."""
    return list(range(n_layer)) if policy == "append" else list(range(0, n_layer, 2)) + list(range(1, n_layer, 2))


def load_config(path, overrides=()) -> Config:
    tree = load_chain(Path(path))
    for override in overrides:
        tree = apply_override(tree, override)
    cfg = build(Config, tree)
    validate(cfg)
    return cfg


def flatten(tree: dict, prefix="") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


# Config keys that cannot change what a run learns: seeds, names, paths, notes and tags, and logging,
# checkpointing, profiling and evaluation cadence (their time is kept out of the budget), and the clock (the
# ledger's clock and calibration columns keep runs of other clocks apart). Runs whose configs differ only here
# are repeats of one recipe: an arm of an experiment.
RECIPE_IGNORED = frozenset([
    "run.name", "run.seed", "run.out_dir", "run.log_every", "run.precompile", "run.profile_steps",
    "data.path", "data.tokenizer", "data.prefetch", "data.replay", "eval.batch_size", "eval.every_seconds", "eval.curve_tokens",
    "device.compile_cache", "ledger.path", "ledger.notes", "ledger.sweep", "ledger.variant", "checkpoint.path",
    "checkpoint.every_seconds", "checkpoint.resume", "budget.clock", "budget.calibration", "data.val_shard",
    "eval.kit_seq_len", "eval.kit_tokens",
])


# Keys added after runs were recorded. At its configs/base.yaml value (where each changes nothing) such a
# key is left out of the hash, so a config that does not use it keeps the recipe its earlier rows have.
RECIPE_NEUTRAL = ("model.value_embed", "model.value_embed_ends", "model.x0_shortcut", "model.x0_init",
                  "model.head_init_std", "model.mlp_in_init", "optim.muon_bf16", "optim.embed_betas", "optim.head_betas",
                  "optim.scalar_betas", "optim.mtp_levels", "model.bigram_buckets", "model.unet",
                  "model.parallel_layers", "optim.ema", "model.doc_mask", "model.smear_gate", "model.gate_window",
                  "model.attn_gate", "model.attn_gate_scale", "model.rope_fraction", "model.ln_scale",
                  "model.skip_gates", "model.xsa_layers", "model.parallel_lanes", "optim.muon_ns",
                  "optim.muon_row_norm", "optim.muon_wd", "optim.muon_wd_cautious", "optim.normuon_beta2",
                  "optim.mlp_proj_lr", "optim.head_wd", "optim.warmdown_steps",
                  "optim.muon_momentum_start", "optim.muon_momentum_warmup", "schedule.grow_init",
                  "optim.warmup_steps", "optim.muon_momentum_warmup_steps",
                  "budget.reference_step_ms", "device.attn_dtype", "mod.recur", "schedule.recur_gate",
                  "data.tokenizer_kind", "budget.charge", "budget.startup_steps", "budget.startup_cap_s",
                  "data.row_pool", "data.row_pool_from",
                  "model.leaky_slope", "model.qk_gain_learned", "model.key_offset", "model.attn_source_after",
                  "model.attn_source_layers",
                  "optim.ema_every", "optim.ema_blend", "optim.ema_prewarm", "optim.mtp_weights", "optim.mtp_until",
                  "optim.mask_bos_targets", "eval.seq_len")


@functools.cache
def base_values() -> dict:
    """configs/base.yaml, flattened: read once per process."""
    return flatten(load_chain(BASE_CONFIG))


def recipe(flat_config: dict, data_sha: str) -> str:
    """12 hex digits naming what is learned: the flattened config without RECIPE_IGNORED (and the
    RECIPE_NEUTRAL keys at their base.yaml value), and the data fingerprint (which stands for the
    data paths)."""
    neutral = base_values()
    kept = {k: v for k, v in flat_config.items()  # (a config's tuples are the base's lists)
            if k not in RECIPE_IGNORED and not (k in RECIPE_NEUTRAL and (list(v) if isinstance(v, tuple) else v) == neutral[k])}
    return hashlib.sha256(json.dumps([kept, data_sha], sort_keys=True, default=list).encode()).hexdigest()[:12]
