"""The calibrated clock: training time that does not depend on what else the machine is doing.

A run's val_bpb is, to float rounding, a function of its recipe, its seed and how many steps of
each annealing stage it gets; the machine only decides that last number. Under
`budget.clock=calibrated` a step advances training time by its stage's calibrated cost instead of
the seconds it took, so the step counts, and with them the result, are the same on a busy machine
as on a quiet one. `wall` stays the default: it is what a real run is.

The costs come from a calibration (`measure`): each stage the arms of a sweep run, timed after
warm-up in interleaved rounds, so that the machine's drift moves every stage alike and cancels out
of their ratios. A stage is named by its cost key (`stage_key`): the model and what a step computes
in that stage, not what it learns (LRs, init scales, switch points, the budget), so the same
computation gets the same cost in every arm that runs it.

A calibration file (JSON, written by `python sweep.py SWEEP --calibrate-only` or any sweep with
`clock: calibrated`):
    id           12 hex digits, fixed when the file is first written; ledger rows name it
    machine      `machine()`: CPU model, family, model and ISA flags, CPUs, torch threads, torch version
    date, method when it was measured; rounds, timed steps per stage per round, steps run untimed first
    baseline     the stage the others are measured against (and that `budget.reference_step_ms` sets)
    stages       {stage key: {name, config, overrides, dtype, step_ms, ratio, se, rounds, round_ms}}
where name is variant/stage index, step_ms the cost, ratio that over the baseline's, se the relative
standard error of the ratio over the rounds (for the baseline, of its level: the machine's drift),
and round_ms the median step of each round.

A calibration made elsewhere (a chip's published step times, or equal steps: `made_elsewhere`) has no stages:
    id, version  as above
    source       where its costs come from (a run log, a paper, "equal steps"): named in every row that uses it
    machine      where they were measured ("trn2", or "any" for costs that were set, not measured)
    step_ms      {tokens per optimizer step: ms}, or {"*": ms} for every step alike
A run under it on any machine takes the steps that machine's costs give: each stage costs the entry of its
tokens per step (the batch ramp's phases), whatever its model, so what it assumes (ASSUMED: this run's step costs there
what the measured program's did, its stages map to that program's batch phases) goes with it into the row. Such costs
need no data and no machine, so `train.py --plan` predicts the steps and stage switches they give (`predict`), by the
loop's rules. sweeps/trn2_chip/calibration-trn2.json is one: a trn2 chip's step seconds from FrontierForge's chip logs.
"""
import dataclasses
import json
import math
import os
import platform
import secrets
import statistics
import time
from pathlib import Path

from config import ConfigError, recipe, stage_for

VERSION = 1
# What a run under a calibration made elsewhere takes for granted, said wherever one is used (--plan, the ledger row).
ASSUMED = ("assumed: each step costs what the measured program's step of the same tokens per step cost there, "
           "this run's stages standing for its batch phases")
# Per stage: rounds, timed steps per round, steps run untimed before them. On a 2-core VM the ratio
# of two identical stages' round medians scattered by 11 % (sd of its log) and the first steps after
# another stage ran were a few % slower than the later ones, so: steps 4-8 after a switch, and about
# 0.11 / sqrt(ROUNDS) = 2 % standard error.
ROUNDS, STEPS, SKIP = 30, 5, 3
WARMUP = 3  # steps of each stage before the rounds (compilation, optimizer state)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what decides a CPU's matmul speed here
# Keys that change what a step learns but not what it computes (its shapes and operations).
COST_IGNORED = ("optim.muon_lr", "optim.muon_momentum", "optim.muon_momentum_start", "optim.muon_momentum_warmup",
                "optim.muon_momentum_warmup_steps", "optim.warmup_steps",
                "optim.embed_lr", "optim.head_lr", "optim.scalar_lr", "optim.beta1", "optim.beta2",
                "optim.weight_decay", "optim.head_wd", "optim.warmup", "optim.warmdown", "optim.warmdown_steps",
                "optim.lr_floor", "model.qk_gain_init", "model.embed_init_std", "model.rope_base",
                "model.attn_gate_scale", "model.leaky_slope", "data.row_pool", "data.row_pool_from",
                "optim.ema_blend", "optim.ema_prewarm", "optim.mtp_until", "optim.mtp_levels", "optim.embed_betas",
                "optim.head_betas", "optim.scalar_betas", "model.x0_init", "model.head_init_std", "model.mlp_in_init")


def machine(accelerator="") -> str:
    """What a step's cost depends on: the accelerator's name (cuda, Trainium), else the CPU's model
    and ISA flags; the CPUs this process may use, torch's threads and torch's version."""
    import torch
    info = {}
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = " ".join(f for f in ISA_FLAGS if f in info.get("flags", "").split())
    cpu = (f"{info.get('model name', platform.processor() or platform.machine())} (family {info.get('cpu family', '?')}, "
           f"model {info.get('model', '?')}; {flags or 'no AVX2'})")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{accelerator or cpu}, {cpus} CPUs, {torch.get_num_threads()} threads, torch {torch.__version__}"


def stage_key(flat_config: dict, data_sha: str, stage) -> str:
    """A stage's name in a calibration: the recipe without the budget, the schedule and COST_IGNORED,
    with the resolved stage's shape (its depth, MLP width, sequence, tokens per step, capacity). A
    stage's doc_mask and xsa_layers enter only where they differ from the model's (already in the key), its mtp only
    where it leaves out some of optim.mtp_weights' targets."""
    kept = {k: v for k, v in flat_config.items()
            if not k.startswith(("budget.", "schedule.")) and k not in COST_IGNORED}
    shape = {k: v for k, v in dataclasses.asdict(stage).items() if k not in ("at", "at_tokens", "attn_scale", "mlp_scale", "lr")
             and not (k in ("recur", "recur_span") and stage.recur == 1)  # no loop: the key it had before loops
             and not (k in ("doc_mask", "xsa_layers") and v == flat_config[f"model.{k}"])
             and not (k == "mtp" and v == len(flat_config["optim.mtp_weights"]))}
    return recipe({**kept, "stage": shape}, data_sha)


def read(path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"budget.calibration={path}: cannot read a calibration from it ({e})") from None
    if isinstance(doc, dict) and "step_ms" in doc:
        check_elsewhere(path, doc)
        return doc
    if (not isinstance(doc, dict) or doc.get("version") != VERSION or not {"id", "machine", "stages", "baseline"} <= set(doc)
            or not isinstance(doc["stages"], dict) or not all(isinstance(s, dict) for s in doc["stages"].values())
            or not isinstance(doc.get("method", {}), dict) or not isinstance(doc["baseline"], str)):
        raise ConfigError(f"budget.calibration={path}: not a calibration file of version {VERSION} (see clock.py)")
    check_numbers(path, doc)
    return doc


def check_numbers(path, doc: dict):
    """Every number a calibration supplies, checked before a run counts on it: a step_ms of 0 would
    never advance the clock (a run without budget.max_steps would not end), a string would fail
    mid-run. Stage rounds are optional (files from before they were recorded)."""
    def check(where, record, field, integer=False, zero=False, required=True):
        if field not in record and not required:
            return
        value = record.get(field)
        kind = "an integer" if integer else "a finite number"
        if (field not in record or isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
                or not (isinstance(value, int) or math.isfinite(value)) or not (value > 0 or zero and value == 0)):
            got = "it is missing" if field not in record else f"got {value!r}"
            raise ConfigError(f"budget.calibration={path}: {where}: {field}: expected {kind} "
                              f"{'>= 0' if zero else '> 0'}, {got}")

    for field in ("rounds", "steps", "skip", "warmup"):
        check("method", doc.get("method", {}), field, integer=True, zero=field in ("skip", "warmup"), required=False)
    for key, stage in doc["stages"].items():
        where = f"stage {stage.get('name') or key}"
        check(where, stage, "step_ms")
        check(where, stage, "ratio")
        check(where, stage, "se", zero=True)  # 0 where the drift cancelled exactly
        check(where, stage, "rounds", integer=True, required=False)
        if not isinstance(stage.get("round_ms"), list) or not stage["round_ms"]:
            raise ConfigError(f"budget.calibration={path}: {where}: round_ms: expected a non-empty list (each round's "
                              f"median step), " + (f"got {stage['round_ms']!r}" if "round_ms" in stage else "it is missing"))
        for i, value in enumerate(stage["round_ms"]):
            check(where, {f"round_ms[{i}]": value}, f"round_ms[{i}]")
    if doc["baseline"] not in doc["stages"]:
        raise ConfigError(f"budget.calibration={path}: baseline {doc['baseline']} is not one of its stages")


def made_elsewhere(doc: dict) -> bool:
    return "step_ms" in doc


def check_elsewhere(path, doc: dict):
    """A calibration made elsewhere: its id, source and machine named, every cost a finite number > 0 keyed by tokens
    per step (a whole number > 0) or "*"."""
    def fail(what):
        raise ConfigError(f"budget.calibration={path}: {what} (a calibration made elsewhere, see clock.py)")

    if doc.get("version") != VERSION:
        fail(f"version: expected {VERSION}, got {doc.get('version')!r}")
    for field in ("id", "source", "machine"):
        if not isinstance(doc.get(field), str) or not doc[field].strip():
            fail(f"{field}: expected a non-empty string, " + (f"got {doc[field]!r}" if field in doc else "it is missing"))
    costs = doc["step_ms"]
    if not isinstance(costs, dict) or not costs:
        fail(f"step_ms: expected {{tokens per step: ms}} with at least one entry, got {costs!r}")
    for key, value in costs.items():
        if key != "*" and not (key.isdigit() and int(key) > 0):
            fail(f"step_ms: key {key!r}: expected tokens per optimizer step (a whole number > 0) or \"*\"")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            fail(f"step_ms[{key}]: expected a finite number > 0, got {value!r}")


def write(path, doc: dict):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def costs(budget, keys: list, here: str, batch_tokens: list):
    """-> (calibration id, seconds per step of each stage) for a run under budget.clock=calibrated
    whose stages have cost `keys` and `batch_tokens` tokens per step, from the file budget.calibration: one
    measured on this machine (`here`, which also decides what device.dtype=auto computes in) holding every
    stage, or one made elsewhere holding every stage's tokens per step (or "*"). With
    budget.reference_step_ms every cost is scaled so that the calibration's baseline costs that: a budget
    of the baseline's steps on a reference machine, each other stage getting its steps by its cost ratio
    measured here."""
    path, doc = budget.calibration, read(budget.calibration)
    if made_elsewhere(doc):
        if budget.reference_step_ms:
            raise ConfigError(f"budget.reference_step_ms: scales a calibration measured here; {path} was made elsewhere "
                              f"({doc['source']}): its costs are used as they are")
        missing = sorted({t for t in batch_tokens if str(t) not in doc["step_ms"]}) if "*" not in doc["step_ms"] else []
        if missing:
            raise ConfigError(f"budget.calibration={path} has no step_ms for {', '.join(map(str, missing))} tokens per "
                              f"step (this run's stages); it has {', '.join(doc['step_ms'])}")
        return doc["id"], [doc["step_ms"].get(str(t), doc["step_ms"].get("*")) / 1000 for t in batch_tokens]
    if doc["machine"] != here:
        raise ConfigError(f"budget.calibration={path} was measured on {doc['machine']}; this is {here}: calibrate "
                          f"again here (python sweep.py SWEEP --calibrate-only)")
    for index, key in enumerate(keys):
        if key not in doc["stages"]:
            names = ", ".join(str(stage.get("name") or k) for k, stage in doc["stages"].items())  # or keys: made by hand
            raise ConfigError(f"budget.calibration={path} has no stage {index} of this run (cost key {key}); it has "
                              f"{names}: calibrate this config (python sweep.py SWEEP --calibrate-only)")
    scale = budget.reference_step_ms / doc["stages"][doc["baseline"]]["step_ms"] if budget.reference_step_ms else 1.0
    return doc["id"], [doc["stages"][key]["step_ms"] / 1000 * scale for key in keys]


def free_step(budget, step: int, profile_steps: int, stage_first: bool) -> bool:
    """Whether the calibrated clock charges nothing for optimizer step `step` (1, 2, ... of a run never resumed, so a
    resumed run gets its steps too): budget.charge=kit its startup steps; aion the run's first step, its profiled ones
    (3 .. 2 + profile_steps) and, stage_first under device.compile, a stage's first (compiling)."""
    if budget.charge == "kit":
        return step <= budget.startup_steps
    return step == 1 or 2 < step <= 2 + profile_steps or stage_first


def predict(budget, stages: tuple, step_costs: list, profile_steps: int, compiled: bool) -> tuple:
    """The steps a run under the calibrated clock takes, before it runs: the loop's rules (the stage before each step
    by stage_for, each step charged its stage's cost unless free_step, the end once the budget or budget.max_steps is
    reached), its own clock never read. -> ([(stage, its first step, its steps)], charged seconds)."""
    timeline, step, tokens, charged = [], 0, 0, 0.0
    while charged < budget.seconds and not (budget.max_steps and step >= budget.max_steps):
        index = stage_for(stages, timeline[-1][0] if timeline else 0, tokens, charged / budget.seconds)
        if not timeline or index != timeline[-1][0]:
            timeline.append([index, step, 0])
        step, tokens, timeline[-1][2] = step + 1, tokens + stages[index].batch_tokens, timeline[-1][2] + 1
        charged += 0.0 if free_step(budget, step, profile_steps, compiled and timeline[-1][2] == 1) else step_costs[index]
    return [tuple(entry) for entry in timeline], charged


def measure(stages: dict, path, baseline: str, here: str, log=print, rounds=None, before_rounds=None) -> dict:
    """Calibrate `stages` ({stage key: (name, config, overrides, trainer, stage index)}, every trainer
    built in this process with budget.clock=wall) into the file `path`, or extend the calibration
    there with the stages it lacks, measured with its baseline. Each trainer stays in its stage, as
    a run does for hundreds of steps. Every round times SKIP + STEPS steps of each stage, in one
    order, reversed every other round, so that the machine's drift (a step's time moved by 10-20 %
    within seconds on a shared 2-core VM) moves every stage alike and cancels out of the ratios: a
    stage's cost is its median per-round ratio to the baseline, times the baseline's median step
    (the recorded one when extending). rounds: default ROUNDS. before_rounds: called once the warm-up
    (compilation) is done, before the first timed step. -> the calibration."""
    rounds = rounds or ROUNDS
    old = read(path) if Path(path).is_file() else None
    if old and old["machine"] != here:
        raise ConfigError(f"{path} was measured on {old['machine']}; this is {here}")
    todo = {k: s for k, s in stages.items() if not old or k not in old["stages"]}
    if not todo:
        return old
    baseline = old["baseline"] if old else baseline
    if baseline not in stages:
        raise ConfigError(f"{path}: its baseline stage {baseline} is not among the stages to measure with")
    todo = {baseline: stages[baseline], **{k: s for k, s in todo.items() if k != baseline}}
    log(f"calibration:{path} stages:{len(todo)} rounds:{rounds} steps:{STEPS} (+{SKIP} untimed per round, "
        f"{WARMUP} first) machine:{here}")
    for name, _, _, trainer, index in todo.values():
        start = time.perf_counter()
        trainer.timed_steps(index, WARMUP)
        log(f"calibration warm-up {name}: {time.perf_counter() - start:.1f} s")
    if before_rounds:
        before_rounds()
    medians = {key: [] for key in todo}
    order = list(todo.items())
    for r in range(rounds):
        for key, (_, _, _, trainer, index) in order if r % 2 == 0 else order[::-1]:
            medians[key].append(statistics.median(trainer.timed_steps(index, SKIP + STEPS)[SKIP:]))
        if (r + 1) % 10 == 0 or r + 1 == rounds:
            log(f"calibration round {r + 1}/{rounds}: " + " ".join(f"{todo[k][0]}={m[-1] * 1000:.1f}"
                                                                 for k, m in medians.items()) + " ms")
    base = medians[baseline]
    level = statistics.median(base)
    base_ms = old["stages"][baseline]["step_ms"] if old else level * 1000
    new = {}
    for key, (name, config, overrides, trainer, _) in todo.items():
        logs = [math.log(m / (level if key == baseline else b)) for m, b in zip(medians[key], base)]
        ratio = 1.0 if key == baseline else math.exp(statistics.median(logs))
        new[key] = dict(name=name, config=str(config), overrides=list(overrides), dtype=trainer.backend.dtype_name,
                        step_ms=round(base_ms * ratio, 3), ratio=round(ratio, 5),
                        se=round(statistics.stdev(logs) / math.sqrt(rounds), 5), rounds=rounds,
                        round_ms=[round(m * 1000, 2) for m in medians[key]])
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if old:
        for key in set(new) - set(old["stages"]):
            old["stages"][key] = dict(new[key], added=f"{date}, by its ratio to the baseline measured then")
        doc = old
    else:
        doc = dict(version=VERSION, id=secrets.token_hex(6), machine=here, date=date,
                   method=dict(rounds=rounds, steps=STEPS, skip=SKIP, warmup=WARMUP), baseline=baseline, stages=new)
    write(path, doc)
    for stage in new.values():
        log(f"calibration {stage['name']}: {stage['step_ms']:.1f} ms (x{stage['ratio']:.4f}, se {stage['se']:.1%})")
    return doc
