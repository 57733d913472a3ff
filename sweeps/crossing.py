"""Where the learning curves of some sweeps' arms cross, and what pruning on them would have cut.

    python sweeps/crossing.py SWEEP [SWEEP ...] [--seed S] [--every 60] [--ledger ledger.csv] [--runs runs]

An arm is a recipe (a search's trial, a sweep's variant: the same recipe in two sweeps is one arm), its curve the
mean over its seeds (one run per seed) of the curve points' val_bpb, each point put in the bin of `--every`
training seconds nearest its time (the sweeps' eval.every_seconds; a resumed run's extra point shares a bin, the
later kept); a bin counts for an arm where every seed has it. Its final figure is the rows' val_bpb. For each bin,
the pairs of arms whose order there is not their final order (the one that ends better first), and the arms of the
final best three that keeping the better half of the arms there (a percentile pruner at 50 %; ties kept) would
have stopped. Prints one table. The curves are read from runs/ (not in git): run it where the sweeps ran.
"""
import argparse
import collections
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ledger  # noqa: E402


def arms(rows, runs_dir, every):
    """-> {recipe: (sweep, variant, final val_bpb, {bin: mean curve val_bpb})} over the ok rows, one per recipe and seed."""
    runs = {}
    for row in rows:
        runs.setdefault(row["recipe"], {}).setdefault(row["seed"], row)
    out = {}
    for recipe, by_seed in runs.items():
        curves = []
        for row in by_seed.values():
            points = {}
            for record in ledger.read_metrics(runs_dir, row["run_id"]):
                if record["kind"] == "curve":
                    points[round(record["train_s"] / every)] = record["val_bpb"]
            curves.append(points)
        bins = set.intersection(*(set(c) for c in curves))
        first = next(iter(by_seed.values()))
        out[recipe] = (first["sweep"], first["variant"], statistics.mean(float(r["val_bpb"]) for r in by_seed.values()),
                       {b: statistics.mean(c[b] for c in curves) for b in sorted(bins)})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+")
    parser.add_argument("--seed", default="", help="only this seed's runs (a search's trials run one seed: compare on it)")
    parser.add_argument("--every", type=float, default=60.0, help="the bins' width in training seconds")
    parser.add_argument("--ledger", default="ledger.csv")
    parser.add_argument("--runs", default="runs")
    args = parser.parse_args(argv)
    rows = [r for r in ledger.read(args.ledger) if r["status"] == "ok" and r["sweep"] in args.sweeps
            and args.seed in ("", r["seed"])]
    missing = [name for name in args.sweeps if not any(r["sweep"] == name for r in rows)]
    if missing:
        sys.exit(f"error: no ok rows of sweep {', '.join(missing)}{' and seed ' + args.seed if args.seed else ''} "
                 f"in {args.ledger}")
    found = arms(rows, Path(args.runs), args.every)
    variants = collections.Counter(variant for _, variant, _, _ in found.values())
    found = {recipe: (variant if variants[variant] == 1 else f"{sweep}/{variant}", final, curve)
             for recipe, (sweep, variant, final, curve) in found.items()}  # sweep/variant only where a variant repeats
    bare = sorted(arm[0] for arm in found.values() if not arm[2])
    if bare:
        print(f"left out, no curve points under {args.runs}: {', '.join(bare)}")
        found = {recipe: arm for recipe, arm in found.items() if arm[2]}
    ranked = sorted(found.values(), key=lambda arm: arm[1])
    best3 = {arm[0] for arm in ranked[:3]}
    print(f"{len(found)} arms, final best three: " + ", ".join(f"{a[0]} {a[1]:.4f}" for a in ranked[:3]))
    print("| bin (s) | arms | pairs out of their final order | which | best three cut by keeping the better half |")
    print("| --- | --- | --- | --- | --- |")
    for b in sorted(set().union(*(arm[2] for arm in found.values()))):
        here = [arm for arm in ranked if b in arm[2]]
        pairs = list(itertools.combinations(here, 2))  # ranked: the first of each pair ends better
        crossed = [f"{x[0]} > {y[0]}" for x, y in pairs if x[2][b] > y[2][b]]
        median = sorted(arm[2][b] for arm in here)[(len(here) - 1) // 2]  # the better half's last; ties are kept
        cut = sorted(arm[0] for arm in here if arm[0] in best3 and arm[2][b] > median)
        print(f"| {b * args.every:g} | {len(here)} | {len(crossed)} of {len(pairs)} | {'; '.join(crossed)} | "
              f"{', '.join(cut) or 'none'} |")


if __name__ == "__main__":
    main()
