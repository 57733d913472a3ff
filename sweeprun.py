"""The running of a sweep's runs, which sweep.py (sweeps and ablations) and search.py (each trial, the
confirmation) build on: Sweep, the variants x seeds of train.py runs, each tagged in the ledger with
its sweep and variant, under its lock, resumable, on the sweep's clock (calibrated: its calibration
measured first), ending with the verdict table and plots; and the helpers both read sweep and
search files with. Its behaviour is described in sweep.py's docstring. It imports neither of them.
"""
import ctypes
import dataclasses
import hashlib
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


class Sweep:
    """The runs of a sweep spec (sweep.load_sweep's, sweep.ablation's, or one search.py builds): run()
    runs the pairs not yet done and writes the verdict table; a search uses its parts one trial at a time."""

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
