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

This file reads sweep files, derives ablations and holds the command line; the runs themselves are
sweeprun.py's Sweep, which search.py builds on too (a search file given here goes to search.main).
"""
import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

import clock
import kernels
import train
from config import ConfigError, load_config
from sweeprun import Sweep, SweepError, flow, override_list, plain_name, read_file, seed_list

ROOT = Path(__file__).resolve().parent


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
            # The command line's one way into search.py, which builds on sweeprun.py as this file does and
            # imports nothing of this one's; imported here, so that a plain sweep needs no Optuna.
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
    sys.exit(main())  # a search's SearchError is a sweeprun.SweepError, the class main() catches
