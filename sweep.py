"""Sweeps and ablations: variants x seeds of train.py runs, one after another, each tagged in the
ledger with its sweep and variant, resumable after a kill, ending with the verdict table of every
variant against the baseline (and its plots) in <sweep file's folder>/<name>/.

    python sweep.py sweeps/batch_order.yaml [--nproc N | --jobs N] [--max-runs N] [--calibrate-only]
                    [--calibration-rounds N] [key.sub=value ...]
    python sweep.py --ablate configs/aion.yaml [--seeds 1337 7] [--clock calibrated] [--nproc N] [key.sub=value ...]

A sweep file (YAML):
    name: batch_order                  # the ledger's `sweep` column
    config: configs/cpu.yaml           # every variant starts from it
    seeds: [1337, 7]                   # every variant runs once per seed
    overrides: [budget.seconds=600]    # optional: for every variant, before its own
    baseline: contiguous               # optional (default: the first variant): what the others are judged against
    clock: calibrated                  # optional (default wall): see below
    variants:                          # name: its overrides, or {config: another config file, overrides: [...]}
      contiguous: [data.order=contiguous]
      shuffle: [data.order=shuffle]
    grid:                              # optional: one more variant per combination, named key=value,...
      optim.muon_lr: [0.02, 0.08]

Overrides after the sweep file apply to every run (and so change the recipes: another arm).

`clock: calibrated` runs every run under the calibrated clock (clock.py): first, alone on the
machine, the calibration of every stage the variants run (its cost relative to the baseline's
first stage, in interleaved rounds) into <name>/calibration-<machine hash>.json, which a resumed
sweep reuses and extends with the stages it lacks; on another machine it is measured again. The runs themselves
then give the same steps and results however busy the machine is; only the calibration needs it
alone. `--calibrate-only` stops after the calibration (a file a single run can take too:
budget.clock=calibrated budget.calibration=FILE). So a calibrated sweep may run `--jobs N` runs at
once, each on cpus/N threads: its calibration is then measured on that many threads too (the thread
count is part of the calibration's machine), still alone.
A (variant, seed) pair with an ok or diverged row of the variant's recipe is done and skipped; one
whose checkpoint exists resumes from it. Ctrl-C (SIGINT) or SIGTERM: the running train.py saves a
checkpoint and writes an `interrupted` row, then the sweep stops; run the same command to resume.
A sweep that dies alone (kill -9, the OOM killer) sends its train.py SIGTERM, the same end. Each pair
runs under its lock, <ledger's folder>/locks/<name>/<variant>-seed<seed>.lock (locks.py), which
its train.py holds too: a pair another process runs (a second sweep on the ledger, the child of a
killed sweep still saving) is waited for, then skipped if that run finished it. A stale lock and a
checkpoint without a ledger row (its run killed by kill -9, the OOM killer or a reboot) are said in
one line each; the pair then resumes from the checkpoint.

--ablate derives the variants from a config: `full`, and one per AION component switched off:
routing (mod.granularity=none), Mixture-of-Recursions alone (mod.recur=false) when MoD layers
stay, annealing (no schedule), each schedule key (removed from every stage; recur with its
recur_span), copy growth (schedule.grow_init=zero) when the schedule copies, the loop's gate,
the records' recipe items the config has (parallel_layers and its lanes, ema, leaky_relu2, doc_mask,
smear_gate, attn_gate, rope_fraction, ln_scale, skip_gates, xsa_layers, muon_ns, muon_row_norm,
muon_wd), torch.compile
(device.compile=false) when the config compiles, and each kernel that is not the reference on
the run's backend (kernels.<op>=torch). The table then reads as each
component's contribution: the full system (B) against the system without it (A).
"""
import argparse
import ctypes
import dataclasses
import hashlib
import itertools
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

import clock
import kernels
import ledger
import locks
import train
from config import ConfigError, flatten, load_config, recipe, resolve_stages

ROOT = Path(__file__).resolve().parent
DONE = ("ok", "diverged")  # a diverged run is a result too: running it again would diverge again
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dies_with(parent: int):
    """A child's preexec_fn: SIGTERM to the child when the sweep ends, however it ends (kill -9, the
    OOM killer), so a run never outlives its sweep unnoticed: it finishes its step, checkpoints and
    writes an interrupted row. Linux only; elsewhere the pair's lock still keeps a restarted sweep
    off a pair whose child runs on. (The signal follows the thread that started the child: the main one.)"""
    def preexec():
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the sweep died before prctl: nobody else will tell the child
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec if LIBC else None


class SweepError(ValueError):
    pass


def flow(value) -> str:
    """A YAML value on one line, as an override's right-hand side."""
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).removesuffix("...\n").strip()  # a scalar's end mark


def plain_name(name, what):
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise SweepError(f"{what}: expected a plain name (no '/', not empty), got {name!r}")
    return name


def seed_list(value) -> bool:
    """Whether a sweep's seeds are a non-empty list of non-negative integers (YAML's true is no seed)."""
    return isinstance(value, list) and bool(value) and all(type(s) is int and s >= 0 for s in value)


def override_list(path, value, key) -> list:
    if not isinstance(value, list) or not all(isinstance(o, str) and "=" in o for o in value):
        raise SweepError(f"{path}: {key}: expected a list of key.sub=value strings, got {value!r}")
    return value


def read_file(path: Path) -> dict:
    """A sweep (or search) file's YAML mapping."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: cannot read a sweep from it: {e}") from None
    if not isinstance(doc, dict):
        raise SweepError(f"{path}: expected a mapping with name, config, seeds and variants")
    return doc


def load_sweep(path: Path, doc: dict = None) -> dict:
    """A sweep file -> dict(name, config, seeds, overrides, baseline, variants {name: overrides}, out)."""
    doc = read_file(path) if doc is None else doc
    unknown = set(doc) - {"name", "config", "seeds", "overrides", "baseline", "variants", "grid", "clock"}
    if unknown:
        raise SweepError(f"{path}: unknown keys {', '.join(sorted(unknown))}; expected name, config, seeds, "
                         f"overrides, baseline, variants, grid, clock")
    if doc.get("clock", "wall") not in ("wall", "calibrated"):
        raise SweepError(f"{path}: clock: expected wall or calibrated, got {doc['clock']!r}")
    name = plain_name(doc.get("name"), f"{path}: name")
    seeds = doc.get("seeds")
    if not seed_list(seeds):
        raise SweepError(f"{path}: seeds: expected a list of non-negative integers, got {seeds!r}")
    variants, variant_configs, listed = {}, {}, doc.get("variants") or {}
    if not isinstance(listed, dict):
        raise SweepError(f"{path}: variants: expected a mapping of name: [overrides], got {listed!r}")
    for v, value in listed.items():
        v = plain_name(v, f"{path}: variants")
        if isinstance(value, dict):  # {config: another config file, overrides: [...]}
            if set(value) - {"config", "overrides"} or not isinstance(value.get("config"), str):
                raise SweepError(f"{path}: variants.{v}: expected a list of overrides or a mapping with config "
                                 f"(a config file) and optional overrides, got {value!r}")
            variant_configs[v], value = value["config"], value.get("overrides") or []
        variants[v] = override_list(path, value, f"variants.{v}")
    grid = doc.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SweepError(f"{path}: grid: expected a mapping of key.sub: [values], got {grid!r}")
    for combination in itertools.product(*grid.values()) if grid else ():
        pairs = [f"{k}={flow(v)}" for k, v in zip(grid, combination)]
        variants[",".join(pairs)] = pairs
    if not variants:
        raise SweepError(f"{path}: expected at least one variant (variants or grid)")
    baseline = doc.get("baseline", next(iter(variants)))
    if not isinstance(baseline, str) or baseline not in variants:
        raise SweepError(f"{path}: baseline {baseline!r} is not a variant; expected one of {', '.join(variants)}")
    if not isinstance(doc.get("config"), str):
        raise SweepError(f"{path}: config: expected the path of a config file")
    return dict(name=name, config=doc["config"], seeds=seeds, overrides=override_list(path, doc.get("overrides") or [], "overrides"),
                baseline=baseline, variants=variants, variant_configs=variant_configs, out=path.parent / name,
                ablation=False, clock=doc.get("clock", "wall"))


def ablation(config: str, seeds: list, clock="wall") -> dict:
    """One variant per AION component of the config switched off; `full` is the baseline."""
    cfg = load_config(config)
    stages = [dict(stage) for stage in cfg.schedule.stages]

    def stages_without(*keys):
        return f"schedule.stages={flow([{k: v for k, v in s.items() if k not in keys} for s in stages])}"

    variants = {"full": []}
    no_mor = ["mod.recur=false"] + (["mod.granularity=none"] if not cfg.mod.layers else []) if cfg.mod.recur else []
    if cfg.mod.granularity != "none":  # a schedule that sets capacity needs routing: drop it too
        variants["no-routing"] = ["mod.granularity=none", *no_mor[:1]] + ([stages_without("capacity")] if stages else [])
    if cfg.mod.recur and cfg.mod.layers:
        variants["no-mor"] = no_mor
    if stages:
        variants["no-annealing"] = ["schedule.stages=[]", *no_mor]
        for key in sorted({k for stage in stages for k in stage} - {"at", "recur_span"}):  # a loop goes with its span
            variants[f"no-{key}"] = [stages_without(key, "recur_span") if key == "recur" else stages_without(key),
                                     *(no_mor if key == "recur" else [])]
        if cfg.schedule.grow_init == "copy":
            variants["zero-growth"] = ["schedule.grow_init=zero"]
        if cfg.schedule.recur_gate:
            variants["no-recur-gate"] = ["schedule.recur_gate=false"]
    # The parameter-golf records' recipe items, when the config has them.
    m, o = cfg.model, cfg.optim
    items = (
        ("no-parallel", ["model.parallel_layers=0"] + (["model.parallel_lanes=1"] if m.parallel_lanes == 2 else []),
         m.parallel_layers),
        ("one-lane", ["model.parallel_lanes=1"], m.parallel_lanes == 2),
        ("no-ema", ["optim.ema=0"], o.ema),
        ("relu2", ["model.mlp=relu2"], m.mlp == "leaky_relu2"),
        ("no-doc-mask", ["model.doc_mask=false"], m.doc_mask),
        ("no-smear-gate", ["model.smear_gate=false"], m.smear_gate),
        ("no-attn-gate", ["model.attn_gate=none"], m.attn_gate != "none"),
        ("full-rope", ["model.rope_fraction=1"], m.rope_fraction < 1),
        ("no-ln-scale", ["model.ln_scale=false"], m.ln_scale),
        ("no-skip-gates", ["model.skip_gates=false"], m.skip_gates),
        ("no-xsa", ["model.xsa_layers=0"], m.xsa_layers),
        ("quintic-ns", ["optim.muon_ns=quintic"], o.muon_ns != "quintic"),
        ("no-row-norm", ["optim.muon_row_norm=false"], o.muon_row_norm),
        ("no-muon-wd", ["optim.muon_wd=0"], o.muon_wd),
    )
    for name, off, on in items:
        if on:
            variants[name] = off
    if cfg.device.compile:
        variants["no-compile"] = ["device.compile=false"]
    kind = cfg.device.type if cfg.device.type != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    platforms = ("xla-cpu", "xla-neuron") if kind == "xla" else (kind,)  # which XLA device is known only at run time
    for op, choice in dataclasses.asdict(cfg.kernels).items():
        if choice not in ("auto", "torch") or (choice == "auto" and any(kernels.AUTO[p][op] != "torch" for p in platforms)):
            variants[f"kernel-{op}-torch"] = [f"kernels.{op}=torch"]
    if len(variants) == 1:
        raise SweepError(f"{config}: no AION component to switch off (mod.granularity none, no schedule.stages, "
                         f"every kernel the reference)")
    name = f"ablate-{Path(config).stem}"
    return dict(name=name, config=config, seeds=seeds, overrides=[], baseline="full", variants=variants,
                variant_configs={}, out=ROOT / "sweeps" / name, ablation=True, clock=clock)


class Sweep:
    def __init__(self, spec: dict, extra: list, nproc: int, jobs: int = 1, rounds: int = None):
        self.spec, self.extra, self.nproc, self.jobs, self.rounds = spec, extra, nproc, jobs, rounds
        self.fingerprints, self.calibration, self.threads = {}, None, None
        if jobs < 1 or (rounds is not None and rounds < 2):
            raise SweepError(f"sweep {spec['name']}: --jobs must be at least 1 and --calibration-rounds at least 2 "
                             f"(got {jobs} and {rounds})")
        if jobs > 1:
            if spec["clock"] != "calibrated":
                raise SweepError(f"sweep {spec['name']}: --jobs {jobs} needs clock: calibrated (runs that share the "
                                 f"CPU under the wall clock get fewer steps than alone)")
            if nproc > 1:
                raise SweepError(f"sweep {spec['name']}: --jobs and --nproc cannot both be above 1")
            self.threads = max(1, (os.cpu_count() or 1) // jobs)
            torch.set_num_threads(self.threads)  # the calibration's threads: those of each run
        if spec["clock"] == "calibrated":
            base = load_config(self.config_file(spec["baseline"]), [*spec["overrides"], *spec["variants"][spec["baseline"]],
                                                                      *extra, "budget.clock=calibrated",
                                                                      "budget.calibration=unread.json"])  # its device
            self.here = clock.machine(train.Backend(base.device).accelerator)
            self.calibration = spec["out"] / f"calibration-{hashlib.sha256(self.here.encode()).hexdigest()[:8]}.json"
        self.configs = {v: self.variant_config(v) for v in spec["variants"]}  # every variant checked up front
        self.data_sha = {v: self.fingerprint(cfg) for v, cfg in self.configs.items()}
        self.recipes = {v: recipe(flatten(dataclasses.asdict(cfg)), self.data_sha[v])
                        for v, cfg in self.configs.items()}
        self.stop_signal, self.running = None, {}  # running: child -> (variant, seed, start time, its pair's lock)
        self.waiting = set()  # pairs found locked by another process (said once)

    def overrides(self, variant, timed=True):
        """The variant's overrides; timed: with the sweep's clock (calibrated: its calibration file)."""
        clocked = ["budget.clock=calibrated", f"budget.calibration={self.calibration}"] if self.calibration and timed else []
        return [*self.spec["overrides"], *self.spec["variants"][variant], *self.extra, *clocked]

    def calibration_id(self):
        return clock.read(self.calibration)["id"] if self.calibration and self.calibration.is_file() else None

    def stage_keys(self) -> dict:
        """{stage key: (variant, stage index)}: the first variant that runs each stage, the baseline first."""
        wanted = {}
        for variant in [self.spec["baseline"], *self.configs]:
            flat = flatten(dataclasses.asdict(self.configs[variant]))
            for index, stage in enumerate(resolve_stages(self.configs[variant])):
                wanted.setdefault(clock.stage_key(flat, self.data_sha[variant], stage), (variant, index))
        return wanted

    def calibrate(self, before_rounds=None):
        """Measure the stages the sweep's calibration lacks (all, the first time), with its baseline
        (the baseline variant's first stage): a model built here per distinct stage (one that
        several variants run, or that differs only in what a step does not compute, is measured
        once). before_rounds: clock.measure's."""
        wanted = self.stage_keys()
        known = clock.read(self.calibration)["stages"] if self.calibration.is_file() else {}
        base = next(iter(wanted))
        if all(key in known for key in wanted):
            return
        stages = {}
        try:
            for key, (variant, index) in wanted.items():
                if key not in known or key == base:
                    overrides = [*self.overrides(variant, timed=False), "budget.reference_step_ms=0"]
                    trainer = train.Trainer(load_config(self.config_file(variant), overrides))
                    stages[key] = (f"{variant}/{index}", self.config_file(variant), overrides, trainer, index)
            clock.measure(stages, self.calibration, base, self.here, log=lambda line: print(line, flush=True),
                          rounds=self.rounds, before_rounds=before_rounds)
        finally:
            for stage in stages.values():
                stage[3].loader.close()

    def config_file(self, variant) -> str:
        return self.spec["variant_configs"].get(variant, self.spec["config"])

    def variant_config(self, variant):
        try:
            return load_config(self.config_file(variant), self.overrides(variant))
        except (ConfigError, OSError) as e:
            raise SweepError(f"sweep {self.spec['name']}, variant {variant}: {e}") from None

    def fingerprint(self, cfg):
        """The data fingerprint train.py will record (read once per data source)."""
        key = (cfg.data.source, cfg.data.path, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.val_fraction)
        if key not in self.fingerprints:
            self.fingerprints[key] = train.open_data(cfg)[3]
        return self.fingerprints[key]

    def rows(self, variant, statuses=("ok",)):
        """This sweep's ledger rows of the variant's current recipe (and calibration, if calibrated)."""
        calibration = self.calibration_id()
        return [r for r in ledger.read(self.configs[variant].ledger.path)
                if r.get("sweep") == self.spec["name"] and r.get("variant") == variant
                and r.get("recipe") == self.recipes[variant] and r.get("status") in statuses
                and (not self.calibration or r.get("calibration") == calibration)]

    def checkpoint(self, variant, seed) -> Path:
        return Path(self.configs[variant].run.out_dir) / "sweeps" / self.spec["name"] / f"{variant}-seed{seed}.pt"

    def lock_path(self, variant, seed) -> Path:
        """Beside the ledger: every process that writes the pair's rows, on any machine, looks there."""
        folder = Path(self.configs[variant].ledger.path).absolute().parent / "locks" / self.spec["name"]
        return folder / f"{variant}-seed{seed}.lock"

    def take(self, variant, seed):
        """The pair's lock (locks.py), or None while another process holds it (said once)."""
        name, path = self.spec["name"], self.lock_path(variant, seed)
        lock, found = locks.take(path, what=f"sweep {name} {variant} seed {seed}")
        if lock is None and (variant, seed) not in self.waiting:
            self.waiting.add((variant, seed))
            print(f"sweep:{name} lock {path} held ({locks.holder(found)}): {variant} seed {seed} waits for it", flush=True)
        elif lock and found:
            print(f"sweep:{name} stale lock {path} ({locks.holder(found)}; no process holds it): taken over", flush=True)
        return lock

    def command(self, variant, seed):
        ckpt = self.checkpoint(variant, seed)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}"]
                    if self.nproc > 1 else [sys.executable])
        cmd = [*launcher, str(ROOT / "train.py"), "--config", self.config_file(variant), *self.overrides(variant),
               f"run.seed={seed}", f"ledger.sweep={self.spec['name']}", f"ledger.variant={variant}",
               f"checkpoint.path={ckpt}"]
        # An interrupted run resumes, unless its checkpoint is of another recipe (the variant was
        # changed) or unreadable (torn by a kill): then the run starts afresh and overwrites it.
        if ckpt.exists():
            try:
                state = train.load_checkpoint(ckpt)
                saved = recipe(flatten(state["config"]), self.data_sha[variant])
            except train.CheckpointError:
                saved = None
            if saved == self.recipes[variant]:
                cmd.append(f"checkpoint.resume={ckpt}")
                if not any(r["run_id"] == state["run_id"] for r in ledger.read(self.configs[variant].ledger.path)):
                    print(f"sweep:{self.spec['name']} checkpoint {ckpt} (run {state['run_id']}, step {state['step']}) has no "
                          f"ledger row: its run was killed (kill -9, the OOM killer, a reboot); {variant} seed {seed} "
                          f"resumes from it", flush=True)
        return cmd

    def on_signal(self, signum, frame):
        self.stop_signal = signum  # the child got it too when it came from the terminal; a second one is harmless
        for child in list(self.running):
            if child.poll() is None:
                child.send_signal(signum)

    def run(self, max_runs=0, calibrate_only=False) -> int:
        name, seeds = self.spec["name"], self.spec["seeds"]
        if self.calibration:
            self.calibrate()
            print(f"sweep:{name} calibration:{self.calibration} id:{self.calibration_id()}", flush=True)
            if calibrate_only:
                return 0
        elif calibrate_only:
            raise SweepError(f"sweep {name}: --calibrate-only needs clock: calibrated in the sweep file (or --clock calibrated)")
        pairs = [(v, s) for s in seeds for v in self.spec["variants"]]  # seed-major: arms alternate in time
        done = {(r["variant"], int(r["seed"])) for v in self.spec["variants"] for r in self.rows(v, DONE)}
        todo = [p for p in pairs if p not in done]
        if max_runs:
            todo = todo[:max_runs]
        print(f"sweep:{name} variants:{len(self.spec['variants'])} seeds:{len(seeds)} runs:{len(pairs)} "
              f"done_before:{len(pairs) - len([p for p in pairs if p not in done])} to_run_now:{len(todo)}", flush=True)
        for folder in {self.lock_path(v, s).parent for v, s in pairs}:  # left by processes that died holding them
            for path, found in locks.clear_stale(folder):
                print(f"sweep:{name} stale lock {path} ({locks.holder(found)}; no process holds it): removed", flush=True)
        handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        start, failed, walls, pending, started = time.time(), [], [], list(todo), 0
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)} if self.threads else None
        try:
            while pending and self.stop_signal is None:
                if len(self.running) >= self.jobs:
                    self.reap(walls, failed)
                    continue
                lock = None
                for variant, seed in pending:
                    if lock := self.take(variant, seed):
                        break
                if lock is None:  # every pair left is run by another process: wait for one, reaping ours
                    self.reap(walls, failed, block=False)
                    time.sleep(1)
                    continue
                pending.remove((variant, seed))
                if any(int(r["seed"]) == seed for r in self.rows(variant, DONE)):
                    print(f"sweep:{name} {variant} seed {seed} was finished by another process: skipped", flush=True)
                    lock.release()
                    continue
                try:  # the child holds the lock too (pass_fds): one that outlives the sweep keeps its pair
                    child = subprocess.Popen(self.command(variant, seed), env=env, pass_fds=(lock.fd,),
                                             preexec_fn=dies_with(os.getpid()))
                except BaseException:
                    lock.release()
                    raise
                lock.note(child=child.pid)
                self.running[child] = (variant, seed, time.time(), lock)
                started += 1
                per_run = (sum(walls) / len(walls) if walls else self.configs[variant].budget.seconds + 60) / self.jobs
                left = per_run * (len(pending) + 1)
                print(f"sweep:{name} run {started}/{len(todo)} variant:{variant} seed:{seed} pid:{child.pid} "
                      f"elapsed:{(time.time() - start) / 60:.1f}min left:~{left / 60:.0f}min "
                      f"ends:~{time.strftime('%H:%M', time.gmtime(time.time() + left))} UTC"
                      f"{'' if walls else ' (estimate: budget + 60 s per run)'}", flush=True)
            while self.running:
                self.reap(walls, failed)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        if self.stop_signal is not None:
            print(f"sweep:{name} stopped by signal {self.stop_signal}; run the same command to resume", flush=True)
            return 128 + self.stop_signal
        self.report()
        if failed:
            print(f"sweep:{name} runs that did not finish: {', '.join(failed)}", file=sys.stderr)
        return 1 if failed else 0

    def reap(self, walls, failed, block=True):
        """Record every running child that has ended (block: wait for one first) and release its lock."""
        while not (ended := [c for c in self.running if c.poll() is not None]) and block:
            time.sleep(0.5)
        for child in ended:
            variant, seed, t0, lock = self.running.pop(child)
            lock.release()
            walls.append(time.time() - t0)
            if child.returncode not in (0, 1):  # 1: a diverged or failed run, which has its row
                failed.append(f"{variant} seed {seed} (exit {child.returncode})")

    def report(self):
        """The verdict table (printed and written to <out>/verdict.md) and the plots beside it."""
        spec, base = self.spec, self.spec["baseline"]
        arms = {v: self.rows(v) for v in spec["variants"]}
        header = ["variant", "recipe", "n", "val_bpb mean", "sd", "Δ val_bpb", "95% CI", "p", "verdict",
                  "seeds/arm", "test", "tokens/s", "Δ tokens/s", "p", "verdict"]
        lines = [header]
        for variant, rows in arms.items():
            cells = [variant, self.recipes[variant], str(len(rows))]
            if not rows:
                lines.append(cells + ["-"] * (len(header) - 3))
                continue
            bpb = [float(r["val_bpb"]) for r in rows]
            cells += [f"{sum(bpb) / len(bpb):.4f}", f"{statistics.stdev(bpb):.4f}" if len(bpb) > 1 else "-"]
            if variant == base or not arms[base]:
                lines.append(cells + [("baseline" if variant == base else "no baseline runs")] + [""] * 5
                             + [f"{sum(float(r['tokens_per_s']) for r in rows) / len(rows):.0f}", "", "", ""])
                continue
            judged = ledger.judge(*((rows, arms[base]) if spec["ablation"] else (arms[base], rows)))
            bpb_v, tps_v = judged["val_bpb"], judged["tokens_per_s"]
            seeds = "-" if bpb_v["seeds"] is None else str(bpb_v["seeds"])
            lines.append(cells + [f"{bpb_v['diff']:+.4f}", f"[{bpb_v['low']:+.4f}, {bpb_v['high']:+.4f}]",
                                  f"{bpb_v['p']:.3g}", bpb_v["verdict"], seeds,
                                  f"paired ({len(judged['pairs'])} seeds)" if judged["pairs"] else "Welch",
                                  f"{sum(float(r['tokens_per_s']) for r in rows) / len(rows):.0f}",
                                  f"{tps_v['diff']:+.0f}", "" if "ratio" in tps_v else f"{tps_v['p']:.3g}",
                                  tps_v["verdict"]])
        if spec["ablation"]:
            title = (f"Ablation of {spec['config']}: the full system (B) against it without each component (A); "
                     f"Δ = full - without, negative val_bpb = the component helps; keep = the component earns its place")
        else:
            title = f"Sweep {spec['name']} ({spec['config']}): each variant (B) against {base} (A); Δ = B - A"
        print(title)
        print(ledger._table(lines))
        spec["out"].mkdir(parents=True, exist_ok=True)
        text = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        text += ["| " + " | ".join(cells) + " |" for cells in lines[1:]]
        text += ["", f"test: paired t-test on the per-seed differences where both arms ran at least two seeds in common "
                 f"(other runs left out), else Welch's t-test (scipy); keep/revert need p < {ledger.ALPHA}; seeds/arm: "
                 f"runs (pairs) per arm that detect a val_bpb difference of this size at this spread with power "
                 f"{ledger.POWER}." + (f" Calibrated clock: {self.calibration.name} (id {self.calibration_id()})."
                                       if self.calibration else "")]
        (spec["out"] / "verdict.md").write_text("\n".join(text) + "\n")
        ran = {v: rows for v, rows in arms.items() if rows}
        if ran:
            ledger.plot_variants(ran, spec["out"] / "variants.png", f"sweep {spec['name']}")
            runs_dir = self.configs[base].run.out_dir
            ledger.plot_curves(ran, spec["out"] / "curves.png", runs_dir)
        print(f"sweep:{spec['name']} verdict:{spec['out'] / 'verdict.md'} plots:{spec['out']}/variants.png, curves.png")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", nargs="?", help="a sweep YAML file")
    parser.add_argument("--ablate", metavar="CONFIG", help="derive the variants from this config instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 7], help="--ablate: the seeds (default 1337 7)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun --nproc_per_node)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each on cpus/N threads (clock: calibrated only; calibrated on that many threads)")
    parser.add_argument("--max-runs", type=int, default=0, help="run at most this many runs (or trials) now (0 = all)")
    parser.add_argument("--storage", help="a search's Optuna storage: a URL (postgresql://, mysql://, sqlite://) or a "
                                          "journal file (default <name>/study.journal beside the search file)")
    parser.add_argument("--no-confirm", action="store_true", help="a search: stop after its trials")
    parser.add_argument("--clock", choices=("wall", "calibrated"), default="wall", help="--ablate: the runs' clock")
    parser.add_argument("--calibration-rounds", type=int, default=clock.ROUNDS,
                        help=f"rounds per stage of a calibration (default {clock.ROUNDS}; its standard error grows as 1/sqrt)")
    parser.add_argument("--calibrate-only", action="store_true", help="calibrate (clock: calibrated) and stop")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="for every run, after the variant's")
    args = parser.parse_intermixed_args(argv)  # options may come after the sweep file
    if args.sweep and "=" in args.sweep:  # only overrides given: argparse put the first in `sweep`
        args.overrides.insert(0, args.sweep)
        args.sweep = None
    if bool(args.sweep) == bool(args.ablate):
        parser.error("give a sweep file or --ablate CONFIG (not both)")
    try:
        doc = None if args.ablate else read_file(Path(args.sweep))
        if doc and "search" in doc:
            # The command line is this file's one way into search.py, which builds on this module (its Sweep).
            import search
            return search.main(Path(args.sweep), doc, args)
        if args.storage or args.no_confirm:
            raise SweepError("--storage and --no-confirm are options of a search (a sweep file with search:)")
        spec = ablation(args.ablate, args.seeds, args.clock) if args.ablate else load_sweep(Path(args.sweep), doc)
        sweep = Sweep(spec, args.overrides, args.nproc, args.jobs, args.calibration_rounds)
        return sweep.run(args.max_runs, args.calibrate_only)
    except (SweepError, ConfigError, train.data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    import sweep  # the module search.py imports: its SweepError is the one main() catches, not __main__'s copy
    sys.exit(sweep.main())
