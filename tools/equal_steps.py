"""Writes a calibration made elsewhere (clock.py) that gives a run exactly N optimizer steps, for a comparison at equal
steps of AION and a kit-style script (tools/lineage_run.py), with every time-keyed switch of both at the same step:

    python -m tools.equal_steps N [--seconds 600] --out FILE

Both clocks charge nothing for the kit's 5 startup steps and then one cost c per step against a target of
T = seconds - 5 (the script's FF_TIME_TARGET, its 1,795 of the kit's 1,800). The script stops once charged + a step
+ its 5 s reserve reaches T, so c = (T - 5) / (N - 3) puts that stop at step N, where its --steps (num_steps) stops
it too; AION runs with budget.seconds=T, budget.charge=kit and budget.max_steps=N, so that before each step both
read the same progress, (step - 5) x c / T. The file's id is a function of N and the budget, so every run at the same
N names the same calibration (the ledger pairs arms by it). It prints both commands.
"""
import argparse
import hashlib
import sys
from pathlib import Path

import clock
from tools.lineage_run import RESERVE_S, STARTUP_EXCLUDED, TARGET_MARGIN_S


def equal_steps(steps: int, seconds: float) -> dict:
    """The calibration: `steps` steps charged against seconds - TARGET_MARGIN_S."""
    target = seconds - TARGET_MARGIN_S
    step_ms = 1000 * (target - RESERVE_S) / (steps - 3)
    source = (f"equal steps: {steps} optimizer steps against a charged target of {target:g} s ({STARTUP_EXCLUDED} free "
              f"startup steps, then {step_ms:.6g} ms each; tools/equal_steps.py)")
    return dict(version=clock.VERSION, id=hashlib.sha256(source.encode()).hexdigest()[:12], source=source,
                machine="any (costs set, not measured)", step_ms={"*": step_ms})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", type=int, help="optimizer steps, the startup's 5 included")
    parser.add_argument("--seconds", type=float, default=600.0, help="the kit's budget (FF_TIME_TARGET is 5 s less)")
    parser.add_argument("--out", required=True, help="the calibration file to write")
    args = parser.parse_args(argv)
    if args.steps < STARTUP_EXCLUDED + 5 or not args.seconds > TARGET_MARGIN_S + RESERVE_S:
        print(f"error: expected steps >= {STARTUP_EXCLUDED + 5} and --seconds > {TARGET_MARGIN_S + RESERVE_S:g}; got "
              f"{args.steps}, {args.seconds:g}", file=sys.stderr)
        return 2
    doc = equal_steps(args.steps, args.seconds)
    clock.write(Path(args.out), doc)
    target = args.seconds - TARGET_MARGIN_S
    print(f"{args.out}: id {doc['id']}, {doc['step_ms']['*']:.6g} ms a step\n"
          f"the script: python -m tools.lineage_run --script SCRIPT --seconds {args.seconds:g} --clock {args.out} "
          f"--steps {args.steps}\n"
          f"AION:       python train.py --config CONFIG budget.clock=calibrated budget.calibration={args.out} "
          f"budget.charge=kit budget.seconds={target:g} budget.max_steps={args.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
