"""The prepared GPU check: what only an NVIDIA GPU can verify, in about 9 minutes, in one report.

    python -m tools.gpu_check [--out gpu_check] [--minutes 10] [--train-seconds 90] [--only STEP ...]

Runs STEPS in order, each a subprocess from the repository root with its own timeout (a failure or a
hang does not stop the others), all within --minutes: (1) train.py, configs/base.yaml on CUDA for
--train-seconds; (2) tests/test_kernels.py with the Triton kernels compiled, bf16 included; (3)
python -m tools.kernel_bench on CUDA; (4) a 60 s device.compile=true run. Both runs append to ledger.csv
and profile one step (the op profile of five took minutes on an H200, 2026-12-04). --only reruns the
steps named, e.g. those that failed.
Writes, after every step: <out>/report.md (UTC date, GPU, versions; each step's command, rc, seconds,
figures, output tail; the bench table verbatim), <out>/bench.txt, <out>/<step>.log (whole outputs),
<out>/ledger_rows.csv (the rows the runs appended, to copy back). Exit 0 if every step passed, else 1;
2 without a CUDA device, before anything is run or written. The README asks for this whenever a GPU
is available; then set kernels/__init__.py's AUTO["cuda"] from the bench table (an implementation
only where it beat the reference), with the command, date and numbers.
"""
import argparse
import contextlib
import csv
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SECONDS, COMPILE_SECONDS = 90, 60
GRACE_S = 20  # kept back from --minutes to stop an overrunning step (SIGTERM, SIGKILL 10 s later) and report
NO_CUDA = ("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check. "
           "Run it on a machine with an NVIDIA GPU.")
FIGURES = {"train": ("val_bpb", "tokens_per_s", "mfu", "step_ms_p50", "peak_mem_mb", "status"),
           "compile": ("compile_s", "tokens_per_s", "val_bpb", "status")}
TAIL = 20  # output lines per step in the report


def steps(train_seconds=TRAIN_SECONDS):
    """-> [(name, argv, timeout_s)] in run order. A run's timeout is its budget plus start-up, first
    step, the profiled step, evaluation and checkpoint (and, compiled, inductor's cold compiles: 41 s
    for the train graph on an H200, 2026-12-04). The notes are YAML-quoted: train.py parses an
    override's value as YAML, and `a: b` would be a mapping."""
    py = sys.executable
    return [
        ("train", [py, "train.py", "--config", "configs/base.yaml", f"budget.seconds={train_seconds}",
                   "device.type=cuda", "run.profile_steps=1", "ledger.notes='gpu_check: CUDA path'",
                   "run.name=gpu_check"], train_seconds + 90),
        ("kernel_tests", [py, "-m", "pytest", "-q", "-rs", "tests/test_kernels.py"], 90),
        ("bench", [py, "-m", "tools.kernel_bench", "--config", "configs/base.yaml", "device.type=cuda"], 40),
        ("compile", [py, "train.py", "--config", "configs/base.yaml", f"budget.seconds={COMPILE_SECONDS}",
                     "device.type=cuda", "device.compile=true", "run.profile_steps=1", "run.name=gpu_check_compile",
                     "ledger.notes='gpu_check: device.compile on CUDA'"], COMPILE_SECONDS + 150),
    ]


STEPS = steps()  # timeouts 180 + 90 + 40 + 210 = 520 s; with GRACE_S, 540 s = 9 minutes


def last_line(path):
    lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:120] if lines else "(no output yet)"


def run_step(name, argv, timeout, log_path):
    """-> (rc, wall seconds, output). Past `timeout` the step's process group gets SIGTERM (train.py
    then still appends an `interrupted` row) and SIGKILL 10 s later; its rc is then 124."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter
    env["PYTHONUNBUFFERED"] = "1"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = None
        while rc is None:
            left = start + timeout - time.monotonic()
            try:
                rc = proc.wait(timeout=max(min(30.0, left), 0.1))
            except subprocess.TimeoutExpired:
                if left > 30:
                    print(f"    {name} {time.monotonic() - start:.0f} s: {last_line(log_path)}", flush=True)
                    continue
                print(f"    {name}: past its {timeout} s timeout, stopping it", flush=True)
                with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = 124
    return rc, time.monotonic() - start, Path(log_path).read_text(errors="replace")


def write_outputs(out, facts, results, new_rows, columns):
    lines = ["# gpu_check report", ""] + [f"- {k}: {v}" for k, v in facts.items()]
    lines += [f"- steps passed: {sum(r['ok'] for r in results)} of {len(results)}", ""]
    for r in results:
        lines += [f"## {r['i']}. {r['name']}: {'passed' if r['ok'] else 'FAILED'}", "", f"    {r['command']}", "",
                  f"rc {r['rc']}, {r['seconds']:.1f} s, timeout {r['timeout']} s (rc 124: stopped at the timeout)", ""]
        lines += [f"- {figure}" for figure in r["figures"]] + ([""] if r["figures"] else [])
        table = [line for line in r["output"].splitlines() if line.startswith(("#", "|"))]
        if r["name"] == "bench" and table:
            lines += ["Bench table (verbatim):", "", *table, ""]
        else:
            lines += ["Output tail:", "", "```", *r["output"].splitlines()[-TAIL:], "```", ""]
    (out / "report.md").write_text("\n".join(lines))
    with open(out / "ledger_rows.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(new_rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "gpu_check"), help="report directory (created)")
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock limit of the whole check")
    parser.add_argument("--train-seconds", type=int, default=TRAIN_SECONDS, help="budget.seconds of step 1")
    parser.add_argument("--only", nargs="+", choices=[name for name, *_ in STEPS], help="run only these steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    import ledger
    deadline = time.monotonic() + args.minutes * 60 - GRACE_S
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError as e:
        triton_version = f"not importable ({e})"
    facts = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "GPU": torch.cuda.get_device_name(),
             "torch": torch.__version__, "triton": triton_version, "CUDA": torch.version.cuda,
             "python": sys.version.split()[0], "data/builtin/sp1024": "present" if (
                 ROOT / "data/builtin/sp1024/meta.json").exists() else "absent: step 1 prepares it first (minutes)"}
    print(" ".join(f"{k}: {v};" for k, v in facts.items()), flush=True)
    before = {row["run_id"] for row in ledger.read(ledger.LEDGER)}
    results, new_rows = [], []
    plan = [step for step in steps(args.train_seconds) if not args.only or step[0] in args.only]
    for i, (name, argv_, timeout) in enumerate(plan, 1):
        timeout = min(timeout, int(deadline - time.monotonic()))
        shown = shlex.join(["python", *argv_[1:]])
        result = dict(i=i, name=name, command=shown, timeout=timeout, rc=None, seconds=0.0, figures=[], ok=False,
                      output="not run: the --minutes limit was spent")
        if timeout >= 10:
            print(f"[{i}/{len(plan)}] {name} starts (timeout {timeout} s): {shown}", flush=True)
            rc, seconds, output = run_step(name, argv_, timeout, out / f"{name}.log")
            result.update(rc=rc, seconds=seconds, output=output, ok=rc == 0)
        run_name = next((a.split("=", 1)[1] for a in argv_ if a.startswith("run.name=")), None)
        if run_name and result["rc"] is not None:
            rows = [r for r in ledger.read(ledger.LEDGER) if r["run_id"] not in before
                    and r["run_id"].startswith(run_name + "-")]
            new_rows += rows
            row = rows[-1] if rows else None
            result["figures"] = ([f"run_id {row['run_id']}"] + [f"{c} {row.get(c) or '-'}" for c in FIGURES[name]]
                                 if row else ["no ledger row of this run in ledger.csv"])
            result["ok"] = result["ok"] and row is not None and row["status"] == "ok"
        if name == "kernel_tests":
            summary = [line for line in result["output"].splitlines()
                       if re.search(r"\d+ (passed|failed|errors?|skipped)", line)]
            result["figures"] = [f"pytest: {summary[-1].strip('= ') if summary else 'no summary line'}"]
        if name == "bench":
            (out / "bench.txt").write_text(result["output"])
        print(f"[{i}/{len(plan)}] {name} {'passed' if result['ok'] else 'FAILED'}: rc {result['rc']}, "
              f"{result['seconds']:.0f} s; {'; '.join(result['figures'])}", flush=True)
        results.append(result)
        write_outputs(out, facts, results, new_rows, ledger.COLUMNS)
    print(f"gpu_check: {sum(r['ok'] for r in results)} of {len(plan)} steps passed; report: {out / 'report.md'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
