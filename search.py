"""The recipe search: Optuna trials of train.py under the calibrated clock, pruned on their curves.

    python sweep.py SEARCH.yaml [--jobs N] [--storage URL] [--max-runs N] [--no-confirm] [key.sub=value ...]

A search file is a sweep file (sweep.py) with a `search:` section instead of variants:
    name: dense_search
    config: configs/cpu.yaml
    clock: calibrated                   # required: trials run beside each other
    overrides: []                       # every trial and the confirmation, before the trial's own
    search:
      trials: 60                        # trials that ran (ok, pruned, diverged, failed); invalid ones do not count
      seed: 0                           # the sampler's seed (mixed with the study's size and the worker's pid)
      budget: 150                       # the trials' budget.seconds (default: the config's)
      space:                            # a config key, or a name a template uses: {int|float: [low, high]}
        model.n_layer: {int: [3, 8]}    #   (optional log: true, step: s) or {choice: [values]}
        optim.muon_lr: {float: [0.005, 0.08], log: true}
        grow_at: {float: [0.2, 0.6]}
      templates:                        # optional: keys whose value is built from sampled names ($name)
        schedule.stages: [{at: 0, depth: 2}, {at: $grow_at, depth: 4}]
      prune: {at: [0.25, 0.5], keep: 0.5}   # optional: at these fractions of the budget keep the best half
                                        #   (after: 5 trials have finished)
      enqueue: [{model.n_layer: 4, ...}]  # optional: trials to run first, a value for each space name (the
                                        #   base config's own, say), each once per study
      confirm: {best: 3, seeds: [1337, 7, 2024]}  # the best trials again at the config's budget, paired
                                        #   against the config (or against: another config file)
      calibration_rounds: 10            # rounds of each trial's cost calibration

Each trial is a train.py process, like a sweep's run: the ledger's `sweep` is the search's name, its
`variant` the trial (`<machine>-t<number>`), its sampled overrides in `overrides`, its seed the
config's. A sampled config that does not validate is an Optuna FAIL with the error in its user
attributes and no run. Pruning reads the trial's curve points: eval.every_seconds is set to the
first `at` fraction of the budget, so every trial has a point at each fraction (the same validation
tokens, the same p); Optuna's PercentilePruner (after 5 finished trials) stops those outside the best
`keep` there, by SIGUSR1: the run ends with a `pruned` row, which no verdict, show or search reads as
a result.

Costs: before a trial runs, the stages it lacks in the search's calibration (sweeps/<name>/
calibration-<machine>.json, measured on the trials' threads) are measured against the base config's
first stage, interleaved as clock.py does, in a process of their own (a fresh torch.compile cache,
torch's on-disk caches warm). Ratios measured beside a running trial were 5-15 % off those measured
alone on 3 shapes (docs/experiments.md, "The recipe search"), so the calibration stops this worker's
running trials (SIGSTOP, then SIGCONT however it ends; each trial records which it paused:
`paused_for_calibration`): under the calibrated clock a pause changes none of their steps. Run one
worker per machine (with --jobs N): a second worker's trials would run on beside the first's calibrations.

The study lives in an Optuna storage: by default the journal file sweeps/<name>/study.journal; any
URL Optuna takes (postgresql://, mysql://, or a journal file on a shared file system) with --storage,
opened before any trial (a URL it cannot use is an error naming it). A database's calls wait out its
loss (a restart) for up to RETRY_S, each retried on a new connection (RetryingStorage).
A study is one machine kind: its name is <name>-<machine> (the calibration's machine hash: CPU
model, ISA flags, threads, torch), because a trial's steps and dtype depend on the machine; on
another kind the same command starts that kind's study and leaves the other's trials as they are.
Workers on several machines of a kind share its study. kill -9 of a worker: its running trials get
SIGTERM (checkpoint, interrupted row) and stay RUNNING in the study; the same command on the same
host takes each over (its lock, locks.py, tells whether its run still goes) and resumes it from its
checkpoint; one that had finished is told from its row. A host is $AION_HOST, else its name (locks.host).
Output, in sweeps/<name>/: trials-<machine>.md (best first), history, importance and slice plots
(both rewritten as each trial ends), and confirm/verdict.md (a sweep's table).
"""
import dataclasses
import difflib
import fcntl
import functools
import hashlib
import inspect
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import sqlalchemy

import clock
import ledger
import locks
import sweeprun
from config import ConfigError, flatten, load_config

KEYS = {"trials", "seed", "budget", "space", "templates", "prune", "confirm", "calibration_rounds", "enqueue"}
COUNTED = ("ok", "pruned", "diverged", "failed")  # outcomes of trials that ran
# Validation before the calibration exists: the clock the trials will run under (the file is read only by a run).
CHECKED_CLOCK = ("budget.clock=calibrated", "budget.calibration=unread.json")
PRUNE_AFTER = 5  # default prune.after: finished trials before the pruner judges anyone
RETRY_S = 600  # how long a worker waits out a database it lost (a restart, a failover) before it gives up
optuna.logging.set_verbosity(optuna.logging.WARNING)


class SearchError(sweeprun.SweepError):
    pass


def load(path: Path, doc: dict = None) -> dict:
    """A search file (a sweep file with `search:`), checked -> the sweep dict of sweep.load_sweep plus `search`."""
    doc = sweeprun.read_file(path) if doc is None else doc
    where = f"{path}: search"
    s = doc["search"]
    if not isinstance(s, dict) or set(s) - KEYS:
        raise SearchError(f"{where}: expected a mapping with {', '.join(sorted(KEYS))}"
                          + (f"; unknown {', '.join(sorted(set(s) - KEYS))}" if isinstance(s, dict) else ""))
    if doc.get("clock") != "calibrated":
        raise SearchError(f"{path}: a search needs clock: calibrated (its trials run beside each other)")
    for key in ("variants", "grid", "baseline", "seeds"):
        if key in doc:
            raise SearchError(f"{path}: {key}: not part of a search (its trials are sampled; confirm: sets the seeds)")
    if not isinstance(doc.get("config"), str):
        raise SearchError(f"{path}: config: expected the path of a config file, got {doc.get('config')!r}")
    sweeprun.override_list(path, doc.get("overrides") or [], "overrides")

    def number(key, value, integer=False, low=None, high=None):
        ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
        if not ok or (low is not None and not value > low) or (high is not None and not value < high):
            raise SearchError(f"{where}.{key}: expected {'an integer' if integer else 'a number'}"
                              + (f" > {low}" if low is not None else "") + (f" and < {high}" if high is not None else "")
                              + f", got {value!r}")
        return value

    trials = number("trials", s.get("trials"), integer=True, low=0)
    seed = number("seed", s.get("seed", 0), integer=True, low=-1)
    rounds = number("calibration_rounds", s.get("calibration_rounds", 10), integer=True, low=1)
    cfg = load_config(doc["config"], [*(doc.get("overrides") or []), *CHECKED_CLOCK])
    budget = number("budget", s.get("budget", cfg.budget.seconds), low=0)
    prune = s.get("prune")
    if prune is not None:
        at, keep = (prune.get("at"), prune.get("keep", 0.5)) if isinstance(prune, dict) else (None, None)
        if (not isinstance(prune, dict) or set(prune) - {"at", "keep", "after"} or not isinstance(at, list) or not at
                or at != sorted(set(at))):
            raise SearchError(f"{where}.prune: expected {{at: [increasing fractions of the budget], keep: fraction, "
                              f"after: finished trials before any is pruned}}, "
                              f"got {prune!r}")
        for i, p in enumerate(at):
            number(f"prune.at[{i}]", p, low=0, high=1)
            if abs(p / at[0] - round(p / at[0])) > 1e-9:
                raise SearchError(f"{where}.prune.at: every fraction must be a multiple of the first ({at[0]}), the "
                                  f"trials' curve spacing; got {p}")
        prune = dict(at=at, keep=number("prune.keep", keep, low=0, high=1),
                     after=number("prune.after", prune.get("after", PRUNE_AFTER), integer=True, low=-1))
    confirm = s.get("confirm", {})
    if not isinstance(confirm, dict) or set(confirm) - {"best", "seeds", "against"}:
        raise SearchError(f"{where}.confirm: expected {{best: N, seeds: [..], against: CONFIG}}, got {confirm!r}")
    seeds = confirm.get("seeds", [1337, 7, 2024])
    if not sweeprun.seed_list(seeds) or len(seeds) < 2:
        raise SearchError(f"{where}.confirm.seeds: expected at least two non-negative integers (a paired verdict), "
                          f"got {seeds!r}")
    against = confirm.get("against", doc["config"])
    try:
        load_config(against, [*(doc.get("overrides") or []), *CHECKED_CLOCK])
    except ConfigError as e:
        raise SearchError(f"{where}.confirm.against: {e}") from None
    confirm = dict(best=number("confirm.best", confirm.get("best", 3), integer=True, low=0), seeds=seeds,
                   against=against)
    templates = s.get("templates") or {}
    if not isinstance(templates, dict):
        raise SearchError(f"{where}.templates: expected a mapping of config key: value with $names, got {templates!r}")
    space = s.get("space") or {}
    if not isinstance(space, dict) or not space:
        raise SearchError(f"{where}.space: expected a mapping of at least one key to search, got {space!r}")
    space = {name: distribution(f"{where}.space.{name}", value) for name, value in space.items()}
    enqueue = s.get("enqueue") or []
    if not isinstance(enqueue, list) or not all(isinstance(params, dict) for params in enqueue):
        raise SearchError(f"{where}.enqueue: expected a list of {{name: value}} mappings, got {enqueue!r}")
    for i, params in enumerate(enqueue):
        if set(params) != set(space):
            raise SearchError(f"{where}.enqueue[{i}]: expected a value for each space name; missing "
                              f"{sorted(set(space) - set(params))}, unknown {sorted(set(params) - set(space))}")
        for name, value in params.items():
            if not in_space(space[name], value):
                raise SearchError(f"{where}.enqueue[{i}].{name}: {value!r} is outside the space ({space[name]})")
    spec = dict(name=sweeprun.plain_name(doc.get("name"), f"{path}: name"), config=doc["config"],
                overrides=doc.get("overrides") or [], out=path.parent / doc["name"], clock="calibrated",
                search=dict(trials=trials, seed=seed, budget=budget, space=space, templates=templates, prune=prune,
                            confirm=confirm, rounds=rounds, enqueue=enqueue))
    check_space(spec, where, flatten(dataclasses.asdict(cfg)))
    return spec


def in_space(d, value) -> bool:
    """Whether the distribution could draw value: a choice, or a number in [low, high] on its step grid (an
    int distribution always has one, of at least 1 from a whole low: its values are whole)."""
    if isinstance(d, optuna.distributions.CategoricalDistribution):
        return value in d.choices
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not d.low <= value <= d.high:
        return False
    steps = (value - d.low) / d.step if d.step else 0
    return math.isclose(steps, round(steps), abs_tol=1e-9)


def distribution(where, value):
    """{int: [lo, hi]} | {float: [lo, hi]} (log, step) | {choice: [...]} -> an Optuna distribution."""
    kinds = [k for k in ("int", "float", "choice") if isinstance(value, dict) and k in value]
    if len(kinds) != 1 or set(value) - {kinds[0], "log", "step"}:
        raise SearchError(f"{where}: expected {{int: [low, high]}}, {{float: [low, high]}} (with log: true or step: s) "
                          f"or {{choice: [values]}}, got {value!r}")
    kind, bounds, log, step = kinds[0], value[kinds[0]], value.get("log", False), value.get("step")
    if kind == "choice":
        if not isinstance(bounds, list) or len(bounds) < 2 or len(set(map(repr, bounds))) != len(bounds):
            raise SearchError(f"{where}.choice: expected at least two different values, got {bounds!r}")
        if not all(b is None or isinstance(b, (bool, int, float, str)) for b in bounds):
            raise SearchError(f"{where}.choice: values must be numbers, strings, booleans or null (a list or "
                              f"mapping goes in a template), got {bounds!r}")
        return optuna.distributions.CategoricalDistribution(bounds)
    typ = int if kind == "int" else (int, float)
    if (not isinstance(bounds, list) or len(bounds) != 2 or not all(isinstance(b, typ) and not isinstance(b, bool)
                                                                     for b in bounds)):
        raise SearchError(f"{where}.{kind}: expected [low, high] ({kind}s), got {bounds!r}")
    low, high = bounds
    if not low < high:
        raise SearchError(f"{where}.{kind}: an empty range [{low}, {high}]: expected low < high (one value is an "
                          f"override, not a search)")
    if log and low <= 0:
        raise SearchError(f"{where}: log: true needs low > 0, got {low}")
    if log and step:
        raise SearchError(f"{where}: log and step cannot both be set")
    if kind == "int":
        return optuna.distributions.IntDistribution(low, high, log=bool(log), step=step or 1)
    return optuna.distributions.FloatDistribution(low, high, log=bool(log), step=step)


def uses(template, name) -> bool:
    if isinstance(template, str):
        return template == f"${name}"
    if isinstance(template, dict):
        return any(uses(v, name) for v in template.values())
    return isinstance(template, list) and any(uses(v, name) for v in template)


def fill(template, params):
    """A template with each "$name" replaced by its sampled value."""
    if isinstance(template, str) and template.startswith("$"):
        return params[template[1:]]
    if isinstance(template, dict):
        return {k: fill(v, params) for k, v in template.items()}
    if isinstance(template, list):
        return [fill(v, params) for v in template]
    return template


def trial_overrides(spec, params) -> list:
    """Sampled values -> the trial's overrides: its config keys, then its templates filled."""
    s = spec["search"]
    keys = [f"{k}={sweeprun.flow(v)}" for k, v in params.items() if not any(uses(t, k) for t in s["templates"].values())]
    return keys + [f"{k}={sweeprun.flow(fill(t, params))}" for k, t in s["templates"].items()]


def common_overrides(spec) -> list:
    """Before every trial's own: the search's overrides, its budget and the curve spacing pruning reads."""
    s = spec["search"]
    every = [f"eval.every_seconds={s['budget'] * s['prune']['at'][0]:g}"] if s["prune"] else []
    return [*spec["overrides"], f"budget.seconds={s['budget']:g}", *every]


def check_space(spec, where, keys: dict):
    """Before any trial: every name is a config key or a template's, every template key a config key,
    and every bound or choice validates with some values of the other names (the base config's first)."""
    s = spec["search"]
    for key in s["templates"]:
        if key not in keys:
            raise SearchError(f"{where}.templates: unknown config key {key}")
    for name in s["space"]:
        if name not in keys and not any(uses(t, name) for t in s["templates"].values()):
            close = difflib.get_close_matches(name, keys, n=1)
            raise SearchError(f"{where}.space: unknown key {name}: neither a config key"
                              + (f" (did you mean {close[0]}?)" if close else "") + " nor a name a template uses ($name)")
        if name in keys and any(uses(t, name) for t in s["templates"].values()):
            raise SearchError(f"{where}.space: {name} is a config key and a template's name: rename the latter")

    def candidates(d):
        if isinstance(d, optuna.distributions.CategoricalDistribution):
            return list(d.choices)
        high = d.high if d.step is None else d.low + (d.high - d.low) // d.step * d.step
        return [d.low, high]

    values = {name: candidates(d) for name, d in s["space"].items()}
    middle = {name: v[len(v) // 2] for name, v in values.items()}
    rng = random.Random(0)
    for name, tried in values.items():
        for value in tried:
            others = [dict(middle)] + [{n: rng.choice(v) for n, v in values.items()} for _ in range(200)]
            first = None
            for params in others:
                params[name] = value
                try:
                    load_config(spec["config"], [*common_overrides(spec), *trial_overrides(spec, params), *CHECKED_CLOCK])
                    break
                except ConfigError as e:
                    first = first or e
            else:
                raise SearchError(f"{where}.space.{name}: the value {value!r} validates with none of 200 draws of the "
                                  f"other keys ({first})")


def open_storage(storage, journal: Path):
    """--storage -> an Optuna storage: a journal file (default `journal`), or a database URL, reached
    here, so that a URL Optuna cannot use is named before any trial."""
    if storage is None or "://" not in storage:
        Path(storage or journal).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage or journal)))
    shown = hidden(storage)
    for _ in range(3):
        try:
            return RetryingStorage(storage, engine_kwargs={"pool_pre_ping": True})  # a connection cut: a new one
        except (ImportError, sqlalchemy.exc.ArgumentError) as e:  # an unknown dialect, a missing driver, no URL
            raise SearchError(f"--storage {shown}: Optuna cannot use this URL ({first_line(e.__cause__ or e)}); "
                              f"expected postgresql://USER:PASSWORD@HOST[:PORT]/DATABASE (driver psycopg), another "
                              f"database URL SQLAlchemy has a driver for here, or a journal file's path") from None
        except sqlalchemy.exc.OperationalError as e:
            raise SearchError(f"--storage {shown}: cannot open the database ({first_line(e.orig or e)}); expected a "
                              f"running server that takes this user, password and database") from None
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.InternalError) as e:
            error = e  # in a new database, another worker was creating Optuna's tables too: they exist now
    raise SearchError(f"--storage {shown}: cannot create Optuna's tables in it ({first_line(error.orig)}); expected a "
                      f"database this user may create tables in") from None


def hidden(url: str) -> str:
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        return url


def first_line(error) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


CALLS = threading.local()  # .inside: a retried call is running (the calls it makes are not retried on their own)


def retried(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if getattr(CALLS, "inside", False):
            return method(self, *args, **kwargs)
        deadline, pause, lost = time.monotonic() + RETRY_S, 0.1, None
        while True:
            CALLS.inside = True
            try:
                result = method(self, *args, **kwargs)
            except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                    optuna.exceptions.StorageInternalError) as e:  # Optuna's, raised from SQLAlchemy's
                cause = e.__cause__ if isinstance(e, optuna.exceptions.StorageInternalError) else e
                if not isinstance(cause, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)):
                    raise
                if time.monotonic() > deadline:
                    raise SearchError(f"--storage {hidden(self.url)}: the database has been unreachable for "
                                      f"{RETRY_S} s ({first_line(cause.orig or cause)})") from None
                if lost is None:
                    lost = time.monotonic()
                    print(f"search: lost the database {hidden(self.url)} ({first_line(cause.orig or cause)}); "
                          f"waiting for it (up to {RETRY_S} s)", flush=True)
            else:
                if lost is not None:
                    print(f"search: the database {hidden(self.url)} is back after {time.monotonic() - lost:.1f} s",
                          flush=True)
                return result
            finally:
                CALLS.inside = False
            time.sleep(pause)
            pause = min(2 * pause, 5)
            if self.stopped:
                raise SearchError(f"--storage {hidden(self.url)}: stopped by a signal while the database was "
                                  f"unreachable; run the same command to resume")
    return call


class RetryingStorage(optuna.storages.RDBStorage):
    """Optuna's RDBStorage, each call of which waits out a lost database (a restart, a failover) for
    up to RETRY_S: a call that failed on its connection is made again. Optuna's own answer, heartbeats
    with RetryFailedTrialCallback, beats only inside study.optimize (not ask and tell) and fails a
    silent trial, to start a copy of it on any worker; here a trial belongs to its host, which
    resumes it from its checkpoint, and the worker outlives the outage."""
    stopped = False  # set by the worker's SIGINT or SIGTERM: it stops waiting


for _name, _method in vars(optuna.storages.RDBStorage).items():
    if inspect.isfunction(_method) and not _name.startswith("__"):
        setattr(RetryingStorage, _name, retried(_method))


def machine_hash(here: str) -> str:
    return hashlib.sha256(here.encode()).hexdigest()[:8]


class Worker:
    """One search process: up to `jobs` trials at once, each a train.py child."""

    def __init__(self, spec, extra, jobs=1, storage=None, max_trials=0):
        self.spec, self.extra, self.jobs, self.max_trials = spec, extra, jobs, max_trials
        self.s, self.name, self.out = spec["search"], spec["name"], spec["out"]
        self.base = self.sweep_for("base", [])  # the calibration's machine, file and baseline
        self.mhash = machine_hash(self.base.here)
        self.storage = open_storage(storage, self.out / "study.journal")
        self.out.mkdir(parents=True, exist_ok=True)
        self.study_name = f"{self.name}-{self.mhash}"
        pruner = (optuna.pruners.PercentilePruner(self.s["prune"]["keep"] * 100, n_startup_trials=self.s["prune"]["after"])
                  if self.s["prune"] else optuna.pruners.NopPruner())
        self.study = optuna.create_study(study_name=self.study_name, storage=self.storage, pruner=pruner,
                                         direction="minimize", load_if_exists=True)
        # Seeded by the search's seed, the study's size and the pid: a resumed or second worker
        # never replays another's draws (Optuna's random start-up trials come from this seed).
        seed = hash((self.s["seed"], len(self.study.trials), os.getpid())) % 2**31
        self.study.sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        for params in self.s["enqueue"]:  # asked before any draw; once per study, however often a worker starts
            self.study.enqueue_trial(params, skip_if_exists=True)
        self.study.set_user_attr("machine", self.base.here)
        self.running = {}  # trial number -> dict(trial, child, lock, variant, sweep, start, points, reported)
        self.stop_signal, self.walls, self.calibrating = None, [], None

    def job(self, variant, overrides) -> dict:
        """trial_sweep's arguments for this trial (JSON too: the calibration process gets them)."""
        return dict(name=self.name, config=self.spec["config"], overrides=common_overrides(self.spec), out=str(self.out),
                    variant=variant, trial=overrides, extra=self.extra, jobs=self.jobs, rounds=self.s["rounds"])

    def sweep_for(self, variant, overrides) -> sweeprun.Sweep:
        return trial_sweep(**self.job(variant, overrides))

    def variant(self, number):
        return f"{self.mhash}-t{number:03d}"

    # -- trials ---------------------------------------------------------------------------------
    def outcome(self, t):
        return t.user_attrs.get("outcome", "running" if t.state == optuna.trial.TrialState.RUNNING else None)

    def counted(self):
        return [t for t in self.study.get_trials(deepcopy=False) if self.outcome(t) in (*COUNTED, "running")]

    def orphan(self):
        """A RUNNING trial of this host whose lock nobody holds (its worker died) -> taken over."""
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if (t.number in self.running or t.user_attrs.get("host") != locks.host()
                    or "overrides" not in t.user_attrs or locks.alive(t.user_attrs["pid"])):
                continue
            runner = self.sweep_for(self.variant(t.number), t.user_attrs["overrides"])
            lock = runner.take(self.variant(t.number), runner.configs["base"].run.seed)
            if lock:
                how = ("resumes from its checkpoint" if runner.checkpoint(self.variant(t.number), runner.configs["base"].run.seed).exists()
                       else "runs again from its start: no checkpoint of it here")
                print(f"search:{self.name} trial {t.number} was left running by pid {t.user_attrs.get('pid')}, which is "
                      f"gone: taken over; it {how}", flush=True)
                trial = optuna.Trial(self.study, t._trial_id)
                trial.set_user_attr("pid", os.getpid())
                if not self.calibrate(runner, trial):  # cut off in its calibration, it has none yet
                    lock.release()
                    return None
                return trial, runner, lock, set(t.intermediate_values)
        return None

    def ask(self):
        """-> (trial, its Sweep, its lock, the steps it reported) to run next, or None when the study has its trials."""
        if taken := self.orphan():
            return taken
        if self.stop_signal is not None:  # stopped while it calibrated a trial it took over
            return None
        for _ in range(1000):  # invalid draws do not count
            if len(self.counted()) >= self.s["trials"]:
                return None
            trial = self.study.ask(self.s["space"])
            trial.set_user_attr("host", locks.host())
            trial.set_user_attr("pid", os.getpid())
            ahead = [t for t in self.counted() if t.number < trial.number]
            if len(ahead) >= self.s["trials"]:  # another worker asked first
                trial.set_user_attr("outcome", "surplus")
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                return None
            overrides = trial_overrides(self.spec, trial.params)
            try:
                runner = self.sweep_for(self.variant(trial.number), overrides)
            except (ConfigError, sweeprun.SweepError) as e:
                self.invalid(trial, str(e))
                continue
            # Its lock first, then `overrides`, which makes it a trial orphan() may take over: held, it is not.
            lock = runner.take(self.variant(trial.number), runner.configs["base"].run.seed)
            trial.set_user_attr("overrides", overrides)
            try:
                calibrated = self.calibrate(runner, trial)
            except ConfigError as e:
                lock.release()
                self.invalid(trial, str(e))
                continue
            if not calibrated:
                lock.release()
                return None
            return trial, runner, lock, set()
        raise SearchError(f"search {self.name}: 1000 draws in a row did not validate; narrow the space")

    def invalid(self, trial, error):
        trial.set_user_attr("outcome", "invalid")
        trial.set_user_attr("error", error[-1000:])
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        print(f"search:{self.name} trial {trial.number} invalid, not counted: {error[:300]}", flush=True)

    def calibrate(self, runner, trial) -> bool:
        """The trial's lacking stages, in a process of its own, which pauses this worker's running
        trials while it measures (SIGSTOP: under the calibrated clock a pause changes none of their steps).
        -> False when the worker was stopped meanwhile: the trial stays RUNNING, and the next worker
        takes it over and calibrates it."""
        number = trial.number
        calibration = runner.calibration
        if all(key in (clock.read(calibration)["stages"] if calibration.is_file() else {})
               for key in runner.stage_keys()):
            return True
        variant = self.variant(number)
        paused = {r["variant"]: r["child"].pid for r in self.running.values() if r["child"] and r["child"].poll() is None}
        trial.set_user_attr("paused_for_calibration", sorted(paused))
        job = dict(self.job(variant, runner.spec["variants"][variant]), paused=list(paused.values()))
        start = time.time()
        self.calibrating = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "calibrate", json.dumps(job)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            preexec_fn=sweeprun.dies_with(os.getpid()))
        stdout, stderr = self.calibrating.communicate()
        returncode, self.calibrating = self.calibrating.returncode, None
        trial.set_user_attr("calibration_s", round(time.time() - start, 1))
        log = self.out / "trials" / f"{variant}.calibration.log"
        log.parent.mkdir(exist_ok=True)
        log.write_text(stdout + stderr)
        if returncode and self.stop_signal is not None:
            return False
        if returncode == 2:
            raise ConfigError(stderr.strip().splitlines()[-1] if stderr.strip() else "calibration refused it")
        if returncode:
            raise RuntimeError(f"search {self.name}: the calibration of trial {number} failed (exit {returncode}); "
                               f"see {log}")
        return True

    def start(self, trial, runner, lock, reported):
        """Its train.py, or, for a trial taken over whose run had ended, its row told at once."""
        variant = self.variant(trial.number)
        record = dict(trial=trial, lock=lock, variant=variant, sweep=runner, start=time.time(), points=[],
                      reported=reported)
        self.running[trial.number] = record
        if runner.rows(variant, ("ok", "diverged", "pruned")):
            record["child"] = None
            return
        log = self.out / "trials" / f"{variant}.log"
        log.parent.mkdir(exist_ok=True)
        seed = runner.configs["base"].run.seed
        env = {**os.environ, "OMP_NUM_THREADS": str(runner.threads)} if runner.threads else None  # as calibrated
        # Its output goes to a file, never a pipe: a run whose search died still writes its last lines and row.
        with open(log, "a") as out:
            record["offset"] = out.tell()
            child = subprocess.Popen(runner.command(variant, seed), stdout=out, stderr=subprocess.STDOUT, env=env,
                                     pass_fds=(lock.fd,), preexec_fn=sweeprun.dies_with(os.getpid()))
        lock.note(child=child.pid)
        record["child"], record["log"] = child, log

    @staticmethod
    def read_points(record):
        """The curve points (train_s, val_bpb) its run has logged since the last call."""
        with open(record["log"], "rb") as f:
            f.seek(record["offset"])
            text = f.read()
        end = text.rfind(b"\n") + 1  # whole lines only
        record["offset"] += end
        for line in text[:end].decode(errors="replace").splitlines():
            if line.startswith("curve "):
                fields = dict(part.split(":", 1) for part in line.split()[1:])
                record["points"].append((float(fields["train_s"]), float(fields["val_bpb"])))

    def prune_check(self, record):
        """Report each curve point at a prune fraction; stop the run if Optuna says so."""
        prune, budget = self.s["prune"], self.s["budget"]
        if not prune or record.get("pruning") or record["child"] is None:
            return
        spacing = prune["at"][0]
        if "log" in record:
            self.read_points(record)
        while record["points"]:
            train_s, bpb = record["points"].pop(0)
            p = train_s / budget
            for at in prune["at"]:
                step = round(at * 1000)
                if at - 1e-9 <= p < at + spacing / 2 and step not in record["reported"]:
                    record["reported"].add(step)
                    record["trial"].report(bpb, step)
                    if record["trial"].should_prune():
                        record["pruning"] = (at, bpb)
                        record["child"].send_signal(signal.SIGUSR1)
                        return

    def finish(self, number):
        """Tell Optuna the trial's result, from its ledger row."""
        record = self.running.pop(number)
        trial, runner, variant, child = record["trial"], record["sweep"], record["variant"], record["child"]
        seed = runner.configs["base"].run.seed
        rows = [r for r in runner.rows(variant, ledger.STATUSES) if int(r["seed"]) == seed]
        row = rows[-1] if rows else None
        status = row["status"] if row else "failed"
        if status == "interrupted" or (self.stop_signal is not None and not row):
            record["lock"].release()
            return None  # stays RUNNING: the same command resumes it
        self.walls.append(time.time() - record["start"])
        trial.set_user_attr("outcome", status)
        if row:
            trial.set_user_attr("run_id", row["run_id"])
            trial.set_user_attr("steps", int(row["steps"]))
        if status == "ok":
            trial.set_user_attr("val_bpb", float(row["val_bpb"]))
            self.study.tell(trial, float(row["val_bpb"]))
        elif status == "pruned":
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            trial.set_user_attr("error", row["notes"][-1000:] if row else f"exit {child.returncode}, no ledger row")
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        runner.checkpoint(variant, seed).unlink(missing_ok=True)
        record["lock"].release()  # only once told: until then no other worker may take it over
        return status, row

    def progress(self, number, params, status, row, pruning):
        done = len([t for t in self.counted() if self.outcome(t) != "running"])
        best = self.best()
        left = (sum(self.walls) / len(self.walls)) * max(self.s["trials"] - done, 0) / self.jobs if self.walls else 0
        result = (f"val_bpb {float(row['val_bpb']):.4f} in {row['steps']} steps" if status == "ok" else
                  f"pruned at p={pruning[0]:g} (curve val_bpb {pruning[1]:.4f})" if status == "pruned" and pruning else
                  f"{status}" + (f" ({row['notes'][-120:]})" if row and status != "pruned" else ""))
        print(f"search:{self.name} trial {done}/{self.s['trials']} #{number} "
              + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
              + f" -> {result}; " + (f"best {best.value:.4f} (#{best.number})" if best else "best -")
              + f"; ends ~{time.strftime('%H:%M', time.gmtime(time.time() + left))} UTC", flush=True)

    def best(self):
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return min(done, key=lambda t: t.value) if done else None

    def on_signal(self, signum, frame):
        self.stop_signal = signum
        if isinstance(self.storage, RetryingStorage):  # a call waiting for the database ends
            self.storage.stopped = True
        if self.calibrating:  # it continues the trials it paused, which then save and stop
            self.calibrating.send_signal(signum)
        for record in self.running.values():
            if record["child"] and record["child"].poll() is None:
                record["child"].send_signal(signum)

    def run(self, confirm=True) -> int:
        counted = self.counted()
        running = sum(self.outcome(t) == "running" for t in counted)
        print(f"search:{self.name} study {self.study_name} ({len(counted)}/{self.s['trials']} trials counted so far, "
              f"{running} of them left running) machine: {self.base.here}; jobs: {self.jobs}", flush=True)
        handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        ran = 0
        try:
            exhausted = False
            while self.stop_signal is None and not (exhausted and not self.running):
                if (not exhausted and len(self.running) < self.jobs
                        and not (self.max_trials and ran >= self.max_trials)):
                    taken = self.ask()
                    if taken is None:
                        exhausted = True
                    else:
                        self.start(*taken)
                        ran += 1
                        continue
                elif self.max_trials and ran >= self.max_trials:
                    exhausted = True
                for number, record in list(self.running.items()):
                    self.prune_check(record)
                    if record["child"] is None or record["child"].poll() is not None:
                        ended = self.finish(number)
                        if ended:
                            self.progress(number, record["trial"].params, *ended, record.get("pruning"))
                            self.write_table()
                            self.write_plots()  # a long search shows where it stands as it goes
                time.sleep(0.2)
            while self.running:  # after a signal: each child saves and writes its interrupted row
                for number, record in list(self.running.items()):
                    if record["child"] is None or record["child"].poll() is not None:
                        self.finish(number)
                time.sleep(0.2)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        if self.stop_signal is not None:
            print(f"search:{self.name} stopped by signal {self.stop_signal}; run the same command to resume", flush=True)
            return 128 + self.stop_signal
        self.write_table()
        self.write_plots()
        if self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            print(f"search:{self.name} trials still run elsewhere: no confirmation yet", flush=True)
            return 0
        if len(self.counted()) < self.s["trials"] or not confirm:
            return 0
        return self.confirm()

    # -- output ---------------------------------------------------------------------------------
    def write_table(self):
        complete = optuna.trial.TrialState.COMPLETE
        trials = sorted(self.study.get_trials(deepcopy=False),
                        key=lambda t: (t.state != complete, t.value if t.state == complete else 0, t.number))
        names = list(self.s["space"])
        lines = [f"# Search {self.name}: study {self.study_name}", "",
                 f"Machine: {self.base.here}. Trials at {self.s['budget']:g} s (calibrated clock); best first.", "",
                 "| trial | variant | status | val_bpb | steps | " + " | ".join(names) + " | pruned at (curve val_bpb) |",
                 "|" + " --- |" * (6 + len(names))]
        for t in trials:
            pruned = ", ".join(f"p={step / 1000:g}: {v:.4f}" for step, v in sorted(t.intermediate_values.items()))
            lines.append(f"| {t.number} | {self.variant(t.number)} | {self.outcome(t)} | "
                         f"{f'{t.value:.4f}' if t.state == complete else ''} | {t.user_attrs.get('steps', '')} | "
                         + " | ".join(f"{t.params[n]:.4g}" if isinstance(t.params.get(n), float) else str(t.params.get(n, ""))
                                      for n in names) + f" | {pruned if self.outcome(t) == 'pruned' else ''} |")
        (self.out / f"trials-{self.mhash}.md").write_text("\n".join(lines) + "\n")

    def write_plots(self):
        """Optuna's history, importance and slice plots (matplotlib), once two trials have finished."""
        complete = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if len(complete) < 2:
            return
        import warnings

        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as vis
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", UserWarning)  # tight_layout and Optuna's axes
            for kind, plot in (("history", vis.plot_optimization_history), ("importance", vis.plot_param_importances),
                               ("slices", vis.plot_slice)):
                try:
                    axes = plot(self.study)
                except (ValueError, RuntimeError) as e:  # e.g. importance of a space with one value sampled
                    print(f"search:{self.name} no {kind} plot: {e}", flush=True)
                    continue
                figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
                figure.set_size_inches(max(6.4, 3 * len(self.s["space"])) if kind == "slices" else 8, 4.8)
                figure.tight_layout()
                figure.savefig(self.out / f"{kind}-{self.mhash}.png", dpi=110)
                plt.close(figure)

    def confirm(self) -> int:
        """The best trials at the config's budget, `seeds` paired against the `against` config: a sweep."""
        c = self.s["confirm"]
        best = sorted(self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)),
                      key=lambda t: t.value)[:c["best"]]
        if not best:
            return 0
        spec = dict(name=f"{self.name}-confirm", config=self.spec["config"], seeds=c["seeds"],
                    overrides=self.spec["overrides"], baseline="base",
                    variants={"base": [], **{self.variant(t.number): t.user_attrs["overrides"] for t in best}},
                    variant_configs={"base": c["against"]}, out=self.out / "confirm", ablation=False,
                    clock="calibrated")
        print(f"search:{self.name} confirming the best {len(best)} at the config's budget against {c['against']}, "
              f"seeds {c['seeds']}", flush=True)
        return sweeprun.Sweep(spec, self.extra, nproc=1, jobs=self.jobs).run()


def trial_sweep(name, config, overrides, out, variant, trial, extra, jobs, rounds) -> sweeprun.Sweep:
    """A sweeprun.Sweep of the base config and one trial: its command, rows, checkpoint, lock, calibration."""
    spec = dict(name=name, config=config, seeds=[0], overrides=overrides, baseline="base",
                variants={"base": [], variant: trial}, variant_configs={}, out=Path(out), ablation=False,
                clock="calibrated")
    return sweeprun.Sweep(spec, extra, nproc=1, jobs=jobs, rounds=rounds)


def calibrate_main(arg: str) -> int:
    """`python search.py calibrate JOB`: a trial's lacking stages into the search's calibration, measured
    with the worker's running trials (JOB's `paused` pids) stopped, so that it runs alone. They are
    stopped only after the warm-up: a trial stopped while it held inductor's compile lock, which the
    warm-up's compile then waited for, deadlocked both (2026-12-04). They are continued however this
    ends: an error, SIGTERM, or the worker's death (its SIGTERM comes here)."""
    job = json.loads(arg)
    paused = job.pop("paused", [])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        runner = trial_sweep(**job)
        runner.calibration.parent.mkdir(parents=True, exist_ok=True)
        with open(runner.calibration.with_suffix(".lock"), "w") as lock:  # one writer of the file at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            runner.calibrate(before_rounds=lambda: [signal_pid(pid, signal.SIGSTOP) for pid in paused])
    except (ConfigError, sweeprun.SweepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for pid in paused:
            signal_pid(pid, signal.SIGCONT)
    return 0


def signal_pid(pid, signum):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it ended meanwhile
        pass


def main(path: Path, doc: dict, args) -> int:
    """`python sweep.py SEARCH.yaml ...` (sweep.main's arguments): one worker of the search."""
    if args.nproc > 1 or args.calibrate_only:
        raise SearchError(f"{path}: a search runs one process per trial and calibrates each trial itself "
                          f"(no --nproc, no --calibrate-only)")
    return Worker(load(path, doc), args.overrides, args.jobs, args.storage, args.max_runs).run(not args.no_confirm)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "calibrate":
        sys.exit(calibrate_main(sys.argv[2]))
    sys.exit("usage: python sweep.py SEARCH.yaml (this file's calibrate command is the search's own)")
