"""The run ledger: one CSV row per run, appended atomically and never rewritten.

train.py calls append(path, row) at the end of every run; people read the ledger with
    python ledger.py show [-n N] [--path ledger.csv]
    python ledger.py compare RUN_A RUN_B [--path ledger.csv]
where a run id may be abbreviated to a unique prefix. Standard library only.
"""
import argparse
import csv
import fcntl
import io
import os
import sys

COLUMNS = [
    "time", "run_id", "git_commit", "git_dirty", "config", "config_sha", "overrides", "device",
    "world_size", "seed", "data_sha", "params", "active_params", "budget_s", "train_s",
    "compile_s", "data_wait_s", "eval_s", "steps", "tokens", "tokens_per_s", "step_ms_p50",
    "flops_per_token", "mfu", "val_loss", "val_bpb", "val_tokens", "val_bytes", "xla_compiles",
    "peak_mem_mb", "stages", "status", "profile", "notes",
]
STATUSES = ("ok", "diverged", "failed", "interrupted")
# Columns where `compare` prints a B - A delta; ids, hashes and seeds look numeric but are not.
NUMERIC_COLUMNS = frozenset([
    "world_size", "params", "active_params", "budget_s", "train_s", "compile_s", "data_wait_s",
    "eval_s", "steps", "tokens", "tokens_per_s", "step_ms_p50", "flops_per_token", "mfu",
    "val_loss", "val_bpb", "val_tokens", "val_bytes", "xla_compiles", "peak_mem_mb",
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
                    missing = [c for c in COLUMNS if c not in header]
                    extra = [c for c in header if c not in COLUMNS]
                    detail = (f"missing: {', '.join(missing) or '-'}; "
                              f"unexpected: {', '.join(extra) or '-'}")
                    if not missing and not extra:
                        detail = "same columns in a different order"
                    raise LedgerError(f"{path}: header differs from ledger.COLUMNS ({detail})")
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read(path):
    """All rows as dicts of strings (empty cells are ""); a missing ledger has no rows."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show_parser = commands.add_parser("show", help="the last runs as a table")
    show_parser.add_argument("-n", type=int, default=20, help="number of runs")
    compare_parser = commands.add_parser("compare", help="two runs side by side")
    compare_parser.add_argument("run_a")
    compare_parser.add_argument("run_b")
    for sub in (show_parser, compare_parser):
        sub.add_argument("--path", default=LEDGER, help="ledger CSV")
    args = parser.parse_args(argv)

    rows = read(args.path)
    if not rows:
        print(f"no runs in {args.path}", file=sys.stdout if args.command == "show" else sys.stderr)
        return 0 if args.command == "show" else 2
    if args.command == "show":
        show(rows, args.n)
        return 0
    try:
        compare(rows, args.run_a, args.run_b)
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
