"""The run ledger: one CSV row per run, appended atomically and never rewritten.

train.py calls append(path, row) at the end of every run; people read the ledger with
    python ledger.py show [-n N] [--path ledger.csv]
    python ledger.py compare RUN_A RUN_B [--path ledger.csv]
    python ledger.py verdict ARM_A ARM_B [--path ledger.csv]
    python ledger.py plot curves [LABEL=]ARM[+ARM...] [...] --out curves.png [--runs-dir runs] [--val-only]
    python ledger.py plot variants SWEEP --out variants.png
    python ledger.py migrate PATH   (an older schema -> PATH's name with .migrated.csv, beside it)
    python ledger.py merge A.csv B.csv ... --out ledger.csv   (hosts' ledgers -> one, each run once)
where a run id may be abbreviated to a unique prefix, and an arm is a set of ok runs named by a
recipe, SWEEP/VARIANT, a config name, a run id prefix or a notes tag, and is always one recipe
(see `arm`). The verdict uses scipy, the plots matplotlib, and a config's arm config.py (for the
recipe the file has now), each imported only there; the rest is standard library.
"""
import argparse
import csv
import dataclasses
import fcntl
import io
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

COLUMNS = [
    "time", "run_id", "git_commit", "git_dirty", "config", "config_sha", "overrides", "device",
    "world_size", "seed", "data_sha", "params", "active_params", "budget_s", "train_s",
    "compile_s", "data_wait_s", "eval_s", "steps", "tokens", "tokens_per_s", "step_ms_p50",
    "flops_per_token", "mfu", "val_loss", "val_bpb", "val_tokens", "val_bytes", "kit_val_bpb",
    "xla_compiles", "peak_mem_mb", "stages", "status", "recipe", "sweep", "variant", "profile", "machine", "clock",
    "calibration", "step_cost_ms", "notes",
]
STATUSES = ("ok", "diverged", "failed", "interrupted", "pruned")  # pruned: stopped early by a search (search.py)
# Columns where `compare` prints a B - A delta; ids, hashes and seeds look numeric but are not.
NUMERIC_COLUMNS = frozenset([
    "world_size", "params", "active_params", "budget_s", "train_s", "compile_s", "data_wait_s",
    "eval_s", "steps", "tokens", "tokens_per_s", "step_ms_p50", "flops_per_token", "mfu",
    "val_loss", "val_bpb", "val_tokens", "val_bytes", "kit_val_bpb", "xla_compiles", "peak_mem_mb",
])
SHOW_COLUMNS = ["time", "run_id", "config", "device", "steps", "tokens_per_s", "mfu", "val_bpb",
                "status", "notes"]
NOTES_WIDTH = 40
LEDGER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ledger.csv")


class LedgerError(ValueError):
    pass


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, ".6g")
    return str(value)


def _csv_line(values):
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(values)
    return buffer.getvalue()


def git_state(root) -> tuple:
    """(commit, dirty) of the repository at root, the code a run's row records."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""
    # ledger.csv changes with every run; it does not make the code dirty.
    return git("rev-parse", "--short=12", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!ledger.csv"))


def append(path, row):
    """Append one run; the header is written only into an empty file and must match COLUMNS."""
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise LedgerError(f"unknown ledger columns: {', '.join(unknown)}")
    if row.get("status") not in STATUSES:
        raise LedgerError(f"status {row.get('status')!r} is not one of {', '.join(STATUSES)}")
    line = _csv_line([_cell(row.get(column)) for column in COLUMNS])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # One locked write of header+row per run, so concurrent runs never interleave or double the header.
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.fstat(f.fileno()).st_size == 0:
                line = _csv_line(COLUMNS) + line
            else:
                f.seek(0)
                header = next(csv.reader([f.readline().decode()]), [])
                if header != COLUMNS:
                    raise header_error(path, header)
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a row torn by a full disk or a kill: ours starts on a line of its own
                    line = _end_torn(f, line)
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _end_torn(f, line):
    """`line` prefixed with what ends the torn last row of the ledger open as f: a quote that closes a
    field it was cut in (else ours would be read into that field), and where the cut left every field
    (the last one cut short) an empty one more, so that readers still see it torn (read_checked)."""
    f.seek(0)
    text = f.read().decode(errors="replace")
    end = '"' if text.count('"') % 2 else ""  # a quote inside a field is doubled: an odd count is an open field
    records = list(csv.reader(io.StringIO(text + end)))
    if len(records) > 1 and len(records[-1]) == len(COLUMNS):
        end += ","
    return end + "\n" + line


def header_error(path, header):
    missing = [c for c in COLUMNS if c not in header]
    extra = [c for c in header if c not in COLUMNS]
    detail = f"missing: {', '.join(missing) or '-'}; unexpected: {', '.join(extra) or '-'}"
    if not missing and not extra:
        detail = "same columns in a different order"
    return LedgerError(f"{path}: header differs from ledger.COLUMNS ({detail}); an older ledger: run "
                       f"`python ledger.py migrate {path}` to write a migrated copy beside it")


def check_header(path):
    """Raises LedgerError unless the ledger is missing, empty or has the header COLUMNS."""
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:
            raise header_error(path, header)


def read_checked(path, torn=None):
    """-> (rows, problems): the well-formed rows as dicts of strings (empty cells are ""), and one
    message per torn or malformed row (wrong number of fields, unknown status, a last row without
    its final newline, as append() sees it) with its line number; `torn`, a list, gets (problem,
    cells) of each. A missing ledger has no rows."""
    if not os.path.exists(path):
        return [], []
    rows, problems = [], []
    with open(path, newline="") as f:
        text = f.read()
        reader = csv.reader(io.StringIO(text))
        header = next(reader, [])
        while True:
            line = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                problems.append(f"{path} line {line}: unreadable row ({e}); the rest of the file not read")
                if torn is not None:
                    torn.append((problems[-1], []))
                break
            row = dict(zip(header, cells))
            if len(cells) != len(header):
                problems.append(f"{path} line {line}: {len(cells)} fields, expected {len(header)} (a torn row?)")
            elif not text.endswith("\n") and reader.line_num == text.count("\n") + 1:  # the last line, unfinished
                problems.append(f"{path} line {line}: no final newline, expected every row to end with one (a torn "
                                f"row: its last field may be cut short)")
            elif "status" in row and row["status"] not in STATUSES:
                problems.append(f"{path} line {line}: status {row['status']!r}, expected one of {', '.join(STATUSES)}")
            else:
                rows.append(row)
                continue
            if torn is not None:
                torn.append((problems[-1], cells))
    return rows, problems


def read(path):
    """The well-formed rows (see read_checked for the others)."""
    return read_checked(path)[0]


def migrate(path):
    """Writes the ledger at `path` (an older schema) with the header COLUMNS and each row's cells
    under their column names (new columns empty) to <name>.migrated.csv beside it; never touches
    `path`. -> (the new file, problems of rows left out)."""
    out = os.path.splitext(path)[0] + ".migrated.csv"
    if os.path.exists(out):
        raise LedgerError(f"{out} exists; move it away first")
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    extra = [c for c in header if c not in COLUMNS]
    if extra:
        raise LedgerError(f"{path}: columns {', '.join(extra)} are not in ledger.COLUMNS; cannot migrate them")
    rows, problems = read_checked(path)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(_csv_line(COLUMNS) + "".join(_csv_line([row.get(c, "") for c in COLUMNS]) for row in rows))
    os.replace(tmp, out)
    return out, problems


def merge(paths, out):
    """Hosts' ledgers -> one new ledger at `out`: every run's row once (by run_id; the same run_id
    with other content is an error naming it), oldest first. Each file must have the header COLUMNS.
    Torn or malformed rows go to <out>.torn.csv (problem, cells), never into the ledger and never
    dropped. -> (rows written, problems, the torn file or None)."""
    out = Path(out)
    if out.exists():
        raise LedgerError(f"{out} exists; a merge writes a new ledger: give another --out")
    runs, problems, torn = {}, [], []
    for path in paths:
        if not os.path.isfile(path):
            raise LedgerError(f"{path}: no such ledger")
        check_header(path)
        rows, found = read_checked(path, torn)
        problems += found
        for row in rows:
            first, where = runs.setdefault(row["run_id"], (row, path))
            if first != row:
                differ = ", ".join(c for c in COLUMNS if first[c] != row[c])
                raise LedgerError(f"run {row['run_id']}: its rows in {where} and {path} differ (in {differ}); "
                                  f"a run has one row: which is right cannot be told here")
    rows = sorted((row for row, _ in runs.values()), key=lambda r: (r["time"], r["run_id"]))
    torn_path = out.with_name(out.stem + ".torn.csv") if torn else None
    if torn_path:
        with open(torn_path, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows([["problem", "the row's cells, as read"]]
                                                          + [[problem, *cells] for problem, cells in torn])
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(_csv_line(COLUMNS) + "".join(_csv_line([row[c] for c in COLUMNS]) for row in rows))
    os.replace(tmp, out)
    return len(rows), problems, torn_path


def _table(rows):
    widths = [max(len(cell) for cell in column) for column in zip(*rows)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def _find(rows, key):
    """The last row of the run whose id is `key` or uniquely starts with it."""
    ids = list(dict.fromkeys(row["run_id"] for row in rows))
    matches = [key] if key in ids else [i for i in ids if i.startswith(key)]
    if not matches:
        raise LedgerError(f"unknown run id {key!r}")
    if len(matches) > 1:
        raise LedgerError(f"ambiguous run id {key!r} matches: {', '.join(matches)}")
    return [row for row in rows if row["run_id"] == matches[0]][-1]


def _delta(a, b):
    try:
        return format(int(b) - int(a), "+d")
    except ValueError:
        pass
    try:
        return format(float(b) - float(a), "+.6g")
    except ValueError:
        return ""


def show(rows, n):
    cells = [[row.get(c) or "" for c in SHOW_COLUMNS] for row in rows[max(len(rows) - n, 0):]]
    for row in cells:
        if len(row[-1]) > NOTES_WIDTH:
            row[-1] = row[-1][:NOTES_WIDTH - 3] + "..."
    print(_table([SHOW_COLUMNS] + cells))


def compare(rows, key_a, key_b):
    a, b = _find(rows, key_a), _find(rows, key_b)
    lines = [["column", a["run_id"], b["run_id"], "delta"]]
    for column in COLUMNS:
        va, vb = a.get(column) or "", b.get(column) or ""
        lines.append([column, va, vb, _delta(va, vb) if column in NUMERIC_COLUMNS else ""])
    print(_table(lines))


# -- arms and verdicts ---------------------------------------------------------------------------

ALPHA, POWER = 0.05, 0.8  # a verdict needs p < ALPHA; "seeds needed" is for this power at ALPHA
MAX_SEEDS = 1000
ARM_KINDS = ("recipe", "sweep/variant", "config", "run id prefix", "notes tag")


def arm(rows, key):
    """-> (kind, rows): the ok runs with a val_bpb that `key` names, trying in turn a recipe, SWEEP/VARIANT,
    a config, a run id prefix and a notes substring; the first kind that matches any run wins. An arm
    is one recipe. A config file (a path, or a name under configs/, with or without .yaml) names the
    runs of the recipe the file has now, whatever config they were recorded under (overrides that
    change what is learned make other recipes; none of its recipe: the closest ones are named). A
    config name with no file, and the other kinds, matching runs of several recipes are refused,
    with the recipes listed."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("val_bpb")]
    path = config_file(key)
    if path and not any(r.get("recipe") == key or f"{r.get('sweep')}/{r.get('variant', '')}" == key for r in ok):
        return "config", config_runs(ok, path)
    tests = (lambda r: r.get("recipe") == key,
             lambda r: r.get("sweep") and f"{r['sweep']}/{r.get('variant', '')}" == key,
             lambda r: key in (r["config"], Path(r["config"]).name, Path(r["config"]).stem),
             lambda r: r["run_id"].startswith(key),
             lambda r: key in r.get("notes", ""))
    for kind, test in zip(ARM_KINDS, tests):
        found = [r for r in ok if test(r)]
        recipes = by_recipe(found)
        if len(recipes) > 1:
            raise LedgerError(f"arm {key!r} ({kind}) matches ok runs of {len(recipes)} recipes; an arm must be one "
                              f"recipe: name it by its recipe (or SWEEP/VARIANT). Newest first:\n" + listing(recipes))
        if found:
            return kind, found
    raise LedgerError(f"no ok run with a val_bpb matches arm {key!r} (tried: {', '.join(ARM_KINDS)})")


def by_recipe(rows) -> dict:
    """{recipe: its rows}, the recipe with the newest run first."""
    recipes = {}
    for r in rows:
        recipes.setdefault(r.get("recipe") or "?", []).append(r)
    return dict(sorted(recipes.items(), key=lambda item: item[1][-1].get("time", ""), reverse=True))


def listing(recipes: dict, limit=10, differs=None) -> str:
    lines = [f"  {name}: {len(runs)} runs, budget {runs[0].get('budget_s', '?')} s, {runs[-1]['config']} "
             f"{runs[-1].get('overrides') or '-'}, last {runs[-1].get('time', '?')}"
             + (f"; differs in {differs[name]}" if differs else "") for name, runs in list(recipes.items())[:limit]]
    return "\n".join(lines + ([f"  ... and {len(recipes) - limit} more"] if len(recipes) > limit else []))


def config_file(key):
    """The config file `key` names (a path, or configs/KEY or configs/KEY.yaml beside this file), or None."""
    here = Path(__file__).resolve().parent
    for path in (Path(key), here / key, here / "configs" / key, here / "configs" / f"{key}.yaml"):
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return path
    return None


def config_runs(ok, path):
    """The ok runs of the recipe the config file has now, for any of the ledger's data; none: the error
    names the closest recipes (fewest differing config keys, from each run's config and overrides)."""
    from config import RECIPE_IGNORED, ConfigError, flatten, load_config, recipe

    def flat(config, overrides=()):
        try:
            return flatten(dataclasses.asdict(load_config(config, overrides)))
        except (ConfigError, OSError):
            return None
    try:
        now = flatten(dataclasses.asdict(load_config(path)))
    except ConfigError as e:
        raise LedgerError(f"{path}: {e}") from None
    recipes = {recipe(now, sha) for sha in {r.get("data_sha", "") for r in ok}}
    found = [r for r in ok if r.get("recipe") in recipes]
    if found:
        return found
    here, recipes_run, differs = Path(__file__).resolve().parent, by_recipe(ok), {}
    for name, runs in recipes_run.items():
        then = flat(here / runs[-1]["config"], runs[-1].get("overrides", "").split())
        if then is not None:
            differs[name] = sorted(k for k in now if k not in RECIPE_IGNORED and then.get(k) != now[k])
    closest = dict(sorted(((n, recipes_run[n]) for n in differs), key=lambda item: len(differs[item[0]]))[:3])
    raise LedgerError(f"no ok run of the recipe {path} has now ({', '.join(sorted(recipes)) or 'no data in the ledger'})"
                      f"; the closest recipes:\n" + listing(closest, differs={
        n: ", ".join(differs[n]) or "no config key (another corpus or an older version of the code)" for n in closest}))


def timebase(row) -> str:
    """What a row's training seconds were: 'calibrated <calibration id>', or 'wall <machine>'."""
    if row.get("clock") == "calibrated":
        return f"calibrated {row.get('calibration')}"
    return f"wall {row.get('machine') or '(machine not recorded)'}"


def seeds_needed(diff, sd, paired=False):
    """Runs per arm (pairs when paired) for a two-sided t-test at ALPHA to detect `diff` with power
    POWER (noncentral t): Welch's with standard deviation sd in both arms, or the paired test with
    sd the spread of the per-seed differences; None if there is no difference to find."""
    from scipy import stats
    if not diff or not math.isfinite(diff) or not math.isfinite(sd):
        return None
    for n in range(2, MAX_SEEDS + 1):
        df, spread = (n - 1, sd / math.sqrt(n)) if paired else (2 * n - 2, sd * math.sqrt(2 / n))
        ncp = abs(diff) / spread if sd else math.inf
        critical = stats.t.ppf(1 - ALPHA / 2, df)
        if ncp == math.inf or stats.nct.sf(critical, df, ncp) + stats.nct.cdf(-critical, df, ncp) >= POWER:
            return n
    return MAX_SEEDS + 1


def verdict(a, b, higher_is_better, paired=False):
    """Arm B against arm A (lists of floats; paired: a[i] and b[i] are one seed's): means, spreads,
    B - A with its 95 % confidence interval and the p-value of Welch's t-test or, paired, of the
    t-test on the per-seed differences (scipy), and keep (B better, p < ALPHA) | revert (B worse,
    p < ALPHA) | inconclusive, with the runs per arm that would resolve a difference of this size."""
    from scipy import stats
    out = dict(n_a=len(a), mean_a=statistics.fmean(a), sd_a=statistics.stdev(a) if len(a) > 1 else math.nan,
               n_b=len(b), mean_b=statistics.fmean(b), sd_b=statistics.stdev(b) if len(b) > 1 else math.nan,
               test="paired t-test" if paired else "Welch's t-test")
    out["diff"] = out["mean_b"] - out["mean_a"]
    out["low"] = out["high"] = out["p"] = math.nan
    sd = statistics.stdev([y - x for x, y in zip(a, b)]) if paired and len(a) > 1 else math.sqrt(
        (out["sd_a"] ** 2 + out["sd_b"] ** 2) / 2)
    if len(a) > 1 and len(b) > 1 and sd:
        test = stats.ttest_rel(b, a) if paired else stats.ttest_ind(b, a, equal_var=False)
        out["p"] = float(test.pvalue)
        out["low"], out["high"] = test.confidence_interval(1 - ALPHA)
    better = out["diff"] > 0 if higher_is_better else out["diff"] < 0
    out["verdict"] = ("inconclusive" if not out["p"] < ALPHA else "keep" if better else "revert")
    out["seeds"] = seeds_needed(out["diff"], sd, paired)
    return out


# (column, higher is better); kit_val_bpb (the competition kit's protocol) where every run of both arms has it
METRICS = (("val_bpb", False), ("kit_val_bpb", False), ("tokens_per_s", True))


def cost_ratio(rows_a, rows_b) -> dict:
    """Tokens/s under the calibrated clock: tokens over the calibrated seconds, a constant of the
    recipe and the calibration, not a sample: B's over A's is the calibration's cost ratio, stated
    as such (a t-test of constants says nothing)."""
    a, b = ([float(r["tokens_per_s"]) for r in rows] for rows in (rows_a, rows_b))
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    return dict(n_a=len(a), mean_a=mean_a, sd_a=math.nan, n_b=len(b), mean_b=mean_b, sd_b=math.nan,
                diff=mean_b - mean_a, low=math.nan, high=math.nan, p=math.nan, ratio=mean_b / mean_a, seeds=None,
                test="calibrated cost ratio", verdict=f"x{mean_b / mean_a:.3f} by the calibration")


def judge(rows_a, rows_b) -> dict:
    """{column of METRICS: verdict} of B against A, and "pairs": the seeds both arms ran. With at least
    two, the runs are paired seed by seed (a seed run more than once counts with its mean) and the
    runs of other seeds left out; else every run counts, unpaired."""
    def per_seed(rows, column):
        seeds = {}
        for r in rows:
            seeds.setdefault(r.get("seed"), []).append(float(r[column]))
        return {seed: statistics.fmean(values) for seed, values in seeds.items()}
    common = sorted(set(per_seed(rows_a, "val_bpb")) & set(per_seed(rows_b, "val_bpb")) - {None, ""}, key=str)
    out = dict(pairs=common if len(common) > 1 else [])
    calibrated = all(r.get("clock") == "calibrated" for r in [*rows_a, *rows_b])
    for column, higher in METRICS:
        if not all(r.get(column) for r in [*rows_a, *rows_b]):
            continue
        if column == "tokens_per_s" and calibrated:
            out[column] = cost_ratio(rows_a, rows_b)
        elif out["pairs"]:
            a, b = per_seed(rows_a, column), per_seed(rows_b, column)
            out[column] = verdict([a[s] for s in common], [b[s] for s in common], higher, paired=True)
        else:
            out[column] = verdict([float(r[column]) for r in rows_a], [float(r[column]) for r in rows_b], higher)
    return out


def verdict_lines(name_a, rows_a, name_b, rows_b):
    """The verdict table of B against A for every column of METRICS, and the line saying which test."""
    judged = judge(rows_a, rows_b)
    lines = [["metric", "arm", "n", "mean", "sd", "B - A", "95% CI", "p", "verdict", "seeds/arm"]]
    for column in (column for column, _ in METRICS if column in judged):
        v = judged[column]
        seeds = ("-" if v["seeds"] is None else f">{MAX_SEEDS}" if v["seeds"] > MAX_SEEDS else str(v["seeds"]))
        ratio = "ratio" in v  # constants: no spread, no test
        sd_a, sd_b, ci, p = ("", "", "", "") if ratio else (f"{v['sd_a']:.3g}", f"{v['sd_b']:.3g}",
                                                           f"[{v['low']:+.4g}, {v['high']:+.4g}]", f"{v['p']:.3g}")
        lines.append([column, f"A {name_a}", str(v["n_a"]), f"{v['mean_a']:.6g}", sd_a, "", "", "", "", ""])
        lines.append(["", f"B {name_b}", str(v["n_b"]), f"{v['mean_b']:.6g}", sd_b, f"{v['diff']:+.4g}",
                      ci, p, v["verdict"], seeds])
    return lines, test_line(judged, len(rows_a) + len(rows_b))


def test_line(judged, runs) -> str:
    pairs = judged["pairs"]
    if not pairs:
        return "Welch's t-test (unpaired: the arms share fewer than two seeds)"
    left = runs - sum(judged["val_bpb"][n] for n in ("n_a", "n_b"))
    return (f"paired t-test on the per-seed differences, seeds {', '.join(map(str, pairs))}"
            + (f" ({left} runs of other seeds or repeats averaged or left out)" if left else ""))


def print_verdict(rows, key_a, key_b, chosen=None):
    """Arm B against arm A under one timebase (one clock and calibration, or one machine's wall clock):
    `chosen`, else the one both arms ran under (calibrated first, then the newest)."""
    arms = [arm(rows, key) for key in (key_a, key_b)]
    groups = [{} for _ in arms]
    for (_, found), group in zip(arms, groups):
        for r in found:
            group.setdefault(timebase(r), []).append(r)
    common = [t for t in groups[0] if t in groups[1]]
    described = "; ".join(f"arm {k!r}: " + ", ".join(f"{t} ({len(g[t])} runs)" for t in g)
                          for k, g in zip((key_a, key_b), groups))
    if chosen and chosen not in common:
        raise LedgerError(f"--timebase {chosen!r}: not one both arms ran under ({described})")
    if not common:
        raise LedgerError(f"the arms ran under no common clock: a verdict never mixes clocks or calibrations "
                          f"({described})")
    chosen = chosen or max(common, key=lambda t: (t.startswith("calibrated"),
                                                  max(r.get("time", "") for g in groups for r in g[t])))
    arms = [(kind, group[chosen]) for (kind, _), group in zip(arms, groups)]
    budgets = [arm_rows[0]["budget_s"] for _, arm_rows in arms]  # one recipe: one budget
    steps = {r.get("steps") for _, arm_rows in arms for r in arm_rows}
    equal_steps = len(steps) == 1 and all(steps)  # two programs' own time targets on one step-counting clock
    if budgets[0] != budgets[1] and not equal_steps:
        raise LedgerError(f"arm {key_a!r} ran with a budget of {budgets[0]} s, arm {key_b!r} with {budgets[1]} s: "
                          f"a verdict compares equal budgets, or runs that all made the same steps")
    print(f"timebase: {chosen}" + (f" (also in common: {'; '.join(t for t in common if t != chosen)}; "
                                   f"pick one with --timebase)" if len(common) > 1 else ""))
    if budgets[0] != budgets[1]:
        print(f"equal steps: every run of both arms made {steps.pop()} steps (budgets {budgets[0]} s and {budgets[1]} s)")
    for key, (kind, found) in zip((key_a, key_b), arms):
        print(f"arm {key!r}: {kind}, recipe {found[0].get('recipe') or '?'}, budget {found[0]['budget_s']} s, "
              f"{len(found)} ok runs")
    lines, test = verdict_lines(key_a, arms[0][1], key_b, arms[1][1])
    print(_table(lines))
    print(f"{test}; keep: B better with p < {ALPHA}; revert: B worse with p < {ALPHA}; seeds/arm: runs per arm "
          f"(pairs when paired) that detect a difference of this size at this spread with power {POWER}")


# -- plots ---------------------------------------------------------------------------------------

def read_metrics(runs_dir, run_id):
    """The learning-curve records train.py wrote for a run ([] if its metrics.jsonl is not here)."""
    path = Path(runs_dir) / run_id / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def plot_curves(arms, out, runs_dir, val_only=False):
    """Train loss (unless val_only) and curve val_bpb of every run of each arm ({label: rows}), against
    training seconds and tokens; a row of panels that no run has a point for is left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("curve", "val_bpb", "curve val_bpb"),) if val_only else (
        ("train", "loss", "train loss (nats/token)"), ("curve", "val_bpb", "curve val_bpb"))
    records = {row["run_id"]: read_metrics(runs_dir, row["run_id"]) for rows in arms.values() for row in rows}
    panels = [p for p in panels if any(r["kind"] == p[0] for rs in records.values() for r in rs)] or panels[:1]
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4 * len(panels)), sharey="row", squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for i, (key, rows) in enumerate(arms.items()):
        for j, row in enumerate(rows):
            if not records[row["run_id"]]:
                print(f"warning: no {Path(runs_dir) / row['run_id'] / 'metrics.jsonl'}", file=sys.stderr)
            for r, (kind, value, _) in enumerate(panels):
                points = [p for p in records[row["run_id"]] if p["kind"] == kind]
                for c, x in enumerate(("train_s", "tokens")):
                    axes[r][c].plot([p[x] for p in points], [p[value] for p in points], color=colors[i % len(colors)],
                                    alpha=0.8, label=key if j == 0 and r == c == 0 else None)
            drawn += bool(records[row["run_id"]])
    if not drawn:
        raise LedgerError(f"no learning curves found under {runs_dir} for {', '.join(arms)}")
    for r, (_, _, label) in enumerate(panels):
        for c, x in enumerate(("training seconds", "training tokens")):
            axes[r][c].set(xlabel=x, ylabel=label)
            axes[r][c].grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_variants(arms, out, title):
    """val_bpb of each arm ({label: rows}, e.g. a sweep's variants): every run (seed) as a point,
    the mean as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(arms) + 2), 4))
    for i, rows in enumerate(arms.values()):
        values = [float(r["val_bpb"]) for r in rows]
        ax.scatter([i] * len(values), values, color="C0", zorder=3)
        ax.hlines(statistics.fmean(values), i - 0.3, i + 0.3, color="C3", zorder=2)
    ax.set_xticks(range(len(arms)), list(arms), rotation=20)
    ax.set(ylabel="val_bpb (lower is better)", title=f"{title}: each run (points), mean (line)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show_parser = commands.add_parser("show", help="the last runs as a table")
    show_parser.add_argument("-n", type=int, default=20, help="number of runs")
    compare_parser = commands.add_parser("compare", help="two runs side by side")
    compare_parser.add_argument("run_a")
    compare_parser.add_argument("run_b")
    verdict_parser = commands.add_parser("verdict", help="arm B against arm A, with the seed noise taken into account")
    verdict_parser.add_argument("arm_a", help="recipe, SWEEP/VARIANT, config, run id prefix or notes tag")
    verdict_parser.add_argument("arm_b")
    verdict_parser.add_argument("--timebase", help="the clock to judge under, as the verdict prints it "
                                "(e.g. 'calibrated 3fa2c1d0e9ab'); default: calibrated first, then the newest")
    plot_parser = commands.add_parser("plot", help="PNG plots: learning curves of arms, or val_bpb per sweep variant")
    plot_parser.add_argument("what", choices=("curves", "variants"))
    plot_parser.add_argument("names", nargs="+", help="curves: arms (each named as for verdict, "
                             "labelled LABEL where written LABEL=ARM; ARM+ARM draws their runs as one); variants: a "
                             "sweep name")
    plot_parser.add_argument("--out", required=True, help="PNG file to write")
    plot_parser.add_argument("--runs-dir", default="runs", help="where the runs' metrics.jsonl are (run.out_dir)")
    plot_parser.add_argument("--val-only", action="store_true", help="curves: val_bpb only (a training loss does not "
                             "compare recipes whose loss counts other targets, multi-token prediction's say)")
    for sub in (show_parser, compare_parser, verdict_parser, plot_parser):
        sub.add_argument("--path", default=LEDGER, help="ledger CSV")
    migrate_parser = commands.add_parser("migrate", help="an older ledger with the current columns, beside it")
    migrate_parser.add_argument("path")
    merge_parser = commands.add_parser("merge", help="hosts' ledgers into one new ledger, each run once")
    merge_parser.add_argument("paths", nargs="+", help="ledger CSVs (each with the header ledger.COLUMNS)")
    merge_parser.add_argument("--out", required=True, help="the merged ledger to write (a new file)")
    args = parser.parse_args(argv)

    if args.command == "merge":
        try:
            n, problems, torn = merge(args.paths, args.out)
        except (LedgerError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for problem in problems:
            print(f"warning: set apart in {torn}: {problem}", file=sys.stderr)
        print(f"wrote {args.out}: {n} runs from {len(args.paths)} ledgers")
        return 0

    if args.command == "migrate":
        try:
            out, problems = migrate(args.path)
        except (LedgerError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for problem in problems:
            print(f"warning: left out: {problem}", file=sys.stderr)
        print(f"wrote {out}; check it, then replace {args.path} with it")
        return 0
    rows, problems = read_checked(args.path)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not rows:
        print(f"no runs in {args.path}", file=sys.stdout if args.command == "show" else sys.stderr)
        return 0 if args.command == "show" else 2
    if args.command == "show":
        show(rows, args.n)
        return 0
    try:
        if args.command == "compare":
            compare(rows, args.run_a, args.run_b)
        elif args.command == "verdict":
            print_verdict(rows, args.arm_a, args.arm_b, args.timebase)
        elif args.what == "curves":
            arms = {}
            for name in args.names:  # [LABEL=]ARM[+ARM...]: one label over several arms' runs
                label, _, key = name.rpartition("=")
                arms[label or key] = [r for part in key.split("+") for r in arm(rows, part)[1]]
            plot_curves(arms, args.out, args.runs_dir, args.val_only)
        else:
            sweep = [r for r in rows if r.get("sweep") == args.names[0] and r["status"] == "ok" and r["val_bpb"]]
            if not sweep:
                raise LedgerError(f"no ok runs of sweep {args.names[0]!r}")
            variants = {}
            for r in sweep:
                variants.setdefault(r["variant"], []).append(r)
            plot_variants(variants, args.out, f"sweep {args.names[0]}")
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
