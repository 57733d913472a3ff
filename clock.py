"""The calibrated clock: training time that does not depend on what else the machine is doing.

A run's val_bpb is, to float rounding, a function of its recipe, its seed and how many steps of
each annealing stage it gets; the machine only decides that last number. Under
`budget.clock=calibrated` a step advances training time by its stage's calibrated cost instead of
the seconds it took, so the step counts, and with them the result, are the same on a busy machine
as on a quiet one. The costs come from a calibration: each arm's median step time per stage,
measured after warm-up in interleaved rounds (A B C ... A B C ...), so that a drift of the
machine's speed moves every arm alike. `wall` stays the default: it is what a real run is.

A calibration file (JSON, written by `measure` through `python sweep.py ... --calibrate-only` or
any sweep with `clock: calibrated`):
    id           12 hex digits, fixed when the file is first written; ledger rows name it
    machine      `machine()`: CPU model, family, model and ISA flags, CPUs, torch threads, torch version
    date, method when it was measured; rounds, timed steps per stage per round, steps skipped first
    baseline     the arm whose first-stage cost `budget.reference_step_ms` rescales (see `costs`)
    arms         {cost key: {name, config, overrides, dtype, stages: [{step_ms, round_ms, spread}]}}
where an arm's cost key is its recipe without what does not change a step's cost (`cost_key`), step_ms the median of all its timed steps, round_ms each round's median and spread
(max - min) / median of those.
"""
import json
import math
import os
import platform
import secrets
import statistics
import time
from pathlib import Path

from config import ConfigError, recipe

VERSION = 1
ROUNDS, STEPS, SKIP = 12, 6, 2  # per arm and stage: rounds, timed steps per round, steps run untimed before them
WARMUP = 3  # steps of each stage before the rounds (compilation, optimizer state)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # what decides a CPU's matmul speed here


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


# Keys that change what a step learns but not what it computes (its shapes and operations): arms that
# differ only in them, or in the budget or when their stages start, share one cost, so an LR or a
# switch point is compared at exactly equal steps.
COST_IGNORED = ("optim.muon_lr", "optim.muon_momentum", "optim.muon_momentum_start", "optim.muon_momentum_warmup",
                "optim.embed_lr", "optim.head_lr", "optim.scalar_lr", "optim.beta1", "optim.beta2",
                "optim.weight_decay", "optim.warmup", "optim.warmdown", "optim.lr_floor", "model.qk_gain_init",
                "model.embed_init_std", "model.rope_base")


def cost_key(flat_config: dict, data_sha: str) -> str:
    """An arm's name in a calibration: its recipe without the budget, COST_IGNORED and the stages' `at`."""
    kept = {k: v for k, v in flat_config.items() if not k.startswith("budget.") and k not in COST_IGNORED}
    kept["schedule.stages"] = [{k: v for k, v in stage.items() if k != "at"} for stage in kept["schedule.stages"]]
    return recipe(kept, data_sha)


def read(path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"budget.calibration={path}: cannot read a calibration from it ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not {"id", "machine", "arms", "baseline"} <= set(doc):
        raise ConfigError(f"budget.calibration={path}: not a calibration file of version {VERSION} (see clock.py)")
    return doc


def write(path, doc: dict):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def costs(budget, key: str, stages: int, here: str):
    """-> (calibration id, seconds per step of each stage) for a run under budget.clock=calibrated, from
    the file budget.calibration: measured on this machine (`here`, which also decides what
    device.dtype=auto computes in), holding this arm (cost `key`) with every stage. With budget.reference_step_ms every cost is scaled so that the
    baseline arm's first stage costs that: a budget of the baseline's steps on a reference machine,
    each other arm getting its steps by the cost ratio measured here."""
    path, doc = budget.calibration, read(budget.calibration)
    if doc["machine"] != here:
        raise ConfigError(f"budget.calibration={path} was measured on {doc['machine']}; this is {here}: calibrate "
                          f"again here (python sweep.py SWEEP --calibrate-only)")
    arm = doc["arms"].get(key)
    if arm is None:
        names = ", ".join(f"{a['name']} ({k})" for k, a in doc["arms"].items())
        raise ConfigError(f"budget.calibration={path} has no arm with this run's model and stages (cost key {key}); "
                          f"it has {names}: calibrate this config (python sweep.py SWEEP --calibrate-only)")
    if len(arm["stages"]) != stages:
        raise ConfigError(f"budget.calibration={path}: arm {arm['name']} has {len(arm['stages'])} stages measured, "
                          f"this run has {stages}")
    scale = 1.0
    if budget.reference_step_ms:
        scale = budget.reference_step_ms / doc["arms"][doc["baseline"]]["stages"][0]["step_ms"]
    return doc["id"], [stage["step_ms"] / 1000 * scale for stage in arm["stages"]]


def measure(arms: dict, path, baseline: str, here: str, log=print) -> dict:
    """Calibrate `arms` ({cost key: (name, config, overrides, [a trainer per stage])}, every trainer
    built in this process with budget.clock=wall) into the file `path`, or extend the calibration
    there with the arms it lacks, measured with its baseline. Each trainer stays in its stage, as
    a run does for hundreds of steps. Every round times SKIP + STEPS steps of each (arm, stage),
    in one order, reversed every other round, so that the machine's drift, which moves a step's
    time by 10-20 % within minutes on a shared 2-core VM, moves every arm alike and cancels out of
    the ratios: a stage's cost is its median per-round ratio to the baseline's first stage, times
    the baseline's median step (the recorded one when extending). -> the calibration."""
    old = read(path) if Path(path).is_file() else None
    if old and old["machine"] != here:
        raise ConfigError(f"{path} was measured on {old['machine']}; this is {here}")
    todo = {k: a for k, a in arms.items() if not old or k not in old["arms"]}
    if not todo:
        return old
    if old:
        baseline = old["baseline"]
        if baseline not in arms:
            raise ConfigError(f"{path}: its baseline {baseline} is not among the arms to measure with")
        todo.setdefault(baseline, arms[baseline])
    todo = {baseline: todo.pop(baseline), **todo}
    units = [(key, index, trainer) for key, (_, _, _, trainers) in todo.items() for index, trainer in enumerate(trainers)]
    log(f"calibration:{path} arms:{len(todo)} stages:{len(units)} rounds:{ROUNDS} steps:{STEPS} (+{SKIP} untimed "
        f"per round, {WARMUP} first) machine:{here}")
    for key, index, trainer in units:
        start = time.perf_counter()
        trainer.timed_steps(index, WARMUP)
        log(f"calibration warm-up {todo[key][0]} stage {index}: {time.perf_counter() - start:.1f} s")
    medians = {(key, index): [] for key, index, _ in units}
    for r in range(ROUNDS):
        for key, index, trainer in units if r % 2 == 0 else units[::-1]:
            medians[key, index].append(statistics.median(trainer.timed_steps(index, SKIP + STEPS)[SKIP:]))
        log(f"calibration round {r + 1}/{ROUNDS}: " + " ".join(f"{todo[k][0]}/{i}={m[-1] * 1000:.1f}"
                                                             for (k, i), m in medians.items()) + " ms")
    base = medians[baseline, 0]
    level = statistics.median(base)
    base_ms = old["arms"][baseline]["stages"][0]["step_ms"] if old else level * 1000
    new = {}
    for key, (name, config, overrides, trainers) in todo.items():
        stages = []
        for index in range(len(trainers)):
            first = (key, index) == (baseline, 0)  # its rounds against its level: the machine's drift
            logs = [math.log(m / (level if first else b)) for m, b in zip(medians[key, index], base)]
            ratio = 1.0 if first else math.exp(statistics.median(logs))
            stages.append(dict(step_ms=round(base_ms * ratio, 3), ratio=round(ratio, 5),
                               se=round(statistics.stdev(logs) / math.sqrt(ROUNDS), 5),
                               round_ms=[round(m * 1000, 2) for m in medians[key, index]]))
        new[key] = dict(name=name, config=str(config), overrides=list(overrides),
                        dtype=trainers[0].backend.dtype_name, stages=stages)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if old:
        for key in set(new) - set(old["arms"]):
            old["arms"][key] = dict(new[key], added=f"{date}, by its ratio to the baseline measured then")
        doc = old
    else:
        doc = dict(version=VERSION, id=secrets.token_hex(6), machine=here, date=date,
                   method=dict(rounds=ROUNDS, steps=STEPS, skip=SKIP, warmup=WARMUP), baseline=baseline, arms=new)
    write(path, doc)
    for key, arm in new.items():
        log(f"calibration {arm['name']}: " + ", ".join(f"stage {i} {s['step_ms']:.1f} ms (x{s['ratio']:.4f}, "
                                                         f"se {s['se']:.1%})" for i, s in enumerate(arm["stages"])))
    return doc
