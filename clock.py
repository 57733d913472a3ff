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
import os
import platform
import secrets
import statistics
import time
from pathlib import Path

from config import ConfigError, recipe

VERSION = 1
ROUNDS, STEPS, SKIP = 5, 10, 2  # per arm and stage: rounds, timed steps per round, steps run untimed before them
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
    """Calibrate `arms` ({cost key: (name, config, overrides, trainer)}, every trainer built in this
    process with budget.clock=wall) into the file `path`, or extend the calibration there: arms it
    lacks are measured in rounds with its baseline, and their costs scaled by the baseline's
    recorded cost over its cost now. -> the calibration."""
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
    log(f"calibration:{path} arms:{len(todo)} rounds:{ROUNDS} steps:{STEPS} (+{SKIP} untimed per round, "
        f"{WARMUP} per stage first) machine:{here}")
    for key, (name, _, _, trainer) in todo.items():
        start = time.perf_counter()
        for index in range(len(trainer.stages)):
            trainer.timed_steps(index, WARMUP)
        log(f"calibration warm-up {name}: {len(trainer.stages)} stages in {time.perf_counter() - start:.1f} s")
    times = {key: [[] for _ in trainer.stages] for key, (_, _, _, trainer) in todo.items()}
    for r in range(ROUNDS):
        for key, (name, _, _, trainer) in todo.items():  # the same order every round: drift moves every arm alike
            for index, rounds in enumerate(times[key]):
                rounds.append(trainer.timed_steps(index, SKIP + STEPS)[SKIP:])
        log(f"calibration round {r + 1}/{ROUNDS}: " + " ".join(
            f"{todo[k][0]}=" + "/".join(f"{statistics.median(s[-1]) * 1000:.1f}" for s in stages)
            for k, stages in times.items()) + " ms")
    new = {}
    for key, (name, config, overrides, trainer) in todo.items():
        stages = []
        for rounds in times[key]:
            medians = [statistics.median(r) * 1000 for r in rounds]
            step_ms = statistics.median([t for r in rounds for t in r]) * 1000
            stages.append(dict(step_ms=round(step_ms, 3), round_ms=[round(m, 2) for m in medians],
                               spread=round((max(medians) - min(medians)) / step_ms, 4)))
        new[key] = dict(name=name, config=str(config), overrides=list(overrides), dtype=trainer.backend.dtype_name,
                        stages=stages)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if old:
        scale = old["arms"][baseline]["stages"][0]["step_ms"] / new[baseline]["stages"][0]["step_ms"]
        for key in set(new) - set(old["arms"]):
            for stage in new[key]["stages"]:
                stage["step_ms"] *= scale
            new[key]["added"] = f"{date}, scaled by the baseline's recorded cost over its cost then ({scale:.4f})"
            old["arms"][key] = new[key]
        doc = old
    else:
        doc = dict(version=VERSION, id=secrets.token_hex(6), machine=here, date=date,
                   method=dict(rounds=ROUNDS, steps=STEPS, skip=SKIP, warmup=WARMUP), baseline=baseline, arms=new)
    write(path, doc)
    for key, arm in new.items():
        log(f"calibration {arm['name']}: " + ", ".join(f"stage {i} {s['step_ms']:.1f} ms (spread {s['spread']:.1%})"
                                                         for i, s in enumerate(arm["stages"])))
    return doc
