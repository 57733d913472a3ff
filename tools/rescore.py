"""Scores finished runs again on windows of another length, each with the scorer it was scored by, so that one table
can hold val_bpb on windows of 1,024 and of 2,048 for AION and a lineage script alike:

    python -m tools.rescore --seq-len N RUN [RUN ...] [--ledger ledger.csv] [--out FILE.csv]

RUN is a run id or its run folder (the id is the folder's name); its ledger row tells the rest, paths in it (a
relative config, run.out_dir, checkpoint.path) from the ledger's folder, where the run ran:
- AION's runs (train.py): the row's config file and overrides rebuild its config; the weights are train.load_for_eval's
  of its checkpoint (checkpoint.path, else <run folder>/checkpoint.pt; it must be the run's), computed as
  train.Trainer.evaluate computes them: its loss (compiled where device.compile), under the backend's autocast, the
  attention core in float32 where the backend puts it, bfloat16 weights where it had them; tools/nanogpt.evaluate
  scores it (it sums in float64 what Trainer.evaluate sums by window in float32 first: about 1e-8 apart);
- a lineage script's (config lineage:<name>): the row's overrides are tools/lineage_run.py's command line, which
  rebuilds its config and the script's FF_* and kit settings as lineage_run set them; the script copy in the run
  folder (train.py; the --script itself under --dtype script) loads final.pt through lineage_run.load_model (its rotary
  tables extended to N) and lineage_run.score scores it.
Both score the validation targets the row scored (eval.tokens; 0, as in every config but smoke.yaml, the whole split)
in windows of N, eval.batch_size x data.seq_len tokens per forward, as the runs scored theirs: at a run's own window
length the row's val_bpb comes back. One line per run is printed; --out appends them as CSV (the header once). The
ledger is not written. Exit 2 for an unknown run, a missing config file, checkpoint or script, or a bad config.
"""
import argparse
import csv
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn as nn

import config
import data
import ledger
import train
from config import ConfigError, load_config
from tools import lineage_run, nanogpt

COLUMNS = ["run_id", "config", "variant", "seed", "steps", "row_seq_len", "row_val_bpb", "seq_len", "val_bpb"]


class RescoreError(ValueError):
    pass


@dataclasses.dataclass
class Run:
    row: dict
    cfg: config.Config
    checkpoint: Path
    val_files: list
    tokenizer: Path
    script: Path = None  # a lineage script's copy; None for AION's runs
    env: dict = None  # its FF_* and kit settings


class AionLoss(nn.Module):
    """A checkpoint's model (train.load_for_eval) as tools/nanogpt.evaluate scores a model, computing what
    train.Trainer.evaluate computes (module docstring)."""

    def __init__(self, cfg, checkpoint: Path):
        super().__init__()
        backend = train.Backend(cfg.device)
        self.model, self.autocast = train.load_for_eval(checkpoint, backend.device), backend.autocast
        if backend.bf16_weights:
            self.model.to(torch.bfloat16)
        for block in self.model.blocks:  # load_for_eval's GPT computes attention in the compute dtype
            block.attn.float32_core = backend.attn_float32
        self.wte = self.model.wte
        self.loss = backend.compile(self.model.loss) if cfg.device.compile and not backend.xla else self.model.loss

    def forward(self, idx, targets, reduction="none"):
        with self.autocast():
            return self.loss(idx, targets, reduction=reduction)


def resolve(name: str, ledger_path: str) -> Run:
    """The run `name` (an id or its folder) of the ledger, checked; RescoreError naming it and what is missing."""
    folder = Path(name) if Path(name).is_dir() else None
    run_id, here = folder.name if folder else name, Path(ledger_path).resolve().parent
    row = next((r for r in ledger.read(ledger_path) if r["run_id"] == run_id), None)
    if row is None:
        raise RescoreError(f"run {run_id}: no row in {ledger_path}")
    try:
        if row["config"].startswith("lineage:"):
            args = lineage_run.arguments().parse_intermixed_args(row["overrides"].split())
            config_file, overrides = here / args.config, args.overrides
        else:
            config_file, overrides = here / row["config"], row["overrides"].split()
        if not config_file.is_file():
            raise RescoreError(f"its config file {config_file} no longer exists")
        cfg = load_config(config_file, overrides)
        folder = (folder or here / cfg.run.out_dir / run_id).resolve()
        train_files, val_files, tokenizer, _ = train.open_data(cfg)
        if row["config"].startswith("lineage:"):
            run = Run(row, cfg, folder / "final.pt", val_files, tokenizer,
                      here / args.script if args.dtype == "script" else folder / "train.py",
                      {**lineage_run.script_settings(cfg, args.seconds, args.seed),
                       **lineage_run.kit_env(train_files[0].parent.resolve(), args.seconds, folder)})
            if not run.script.is_file():
                raise RescoreError(f"its script {run.script} is missing")
        else:
            run = Run(row, cfg, here / cfg.checkpoint.path if cfg.checkpoint.path else folder / "checkpoint.pt",
                      val_files, tokenizer)
        if not run.checkpoint.is_file():
            raise RescoreError(f"its checkpoint {run.checkpoint} is missing")
        if not run.script:  # a shared checkpoint.path may hold another run's weights
            saved = train.load_checkpoint(run.checkpoint)["run_id"]
            if saved != run_id:
                raise RescoreError(f"its checkpoint {run.checkpoint} holds run {saved}'s weights")
        return run
    except (RescoreError, ConfigError, data.DataError, train.CheckpointError) as e:
        raise RescoreError(f"run {run_id}: {e}") from None


def rescore(run: Run, seq_len: int) -> float:
    """The run's val_bpb on windows of seq_len (module docstring)."""
    cfg = dataclasses.replace(run.cfg, eval=dataclasses.replace(run.cfg.eval, seq_len=seq_len, kit_tokens=0))
    if run.script:
        model = lineage_run.load_model(run.script, run.env, run.checkpoint, seq_len)
        return lineage_run.score(cfg, model, run.val_files, run.tokenizer)["val_bpb"]
    return nanogpt.evaluate(AionLoss(cfg, run.checkpoint), run.val_files, seq_len, config.eval_rows(cfg, seq_len),
                            data.ByteTable(run.tokenizer), cfg.eval.tokens)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, required=True, help="the windows to score, in tokens")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run id, or its run folder")
    parser.add_argument("--ledger", default=ledger.LEDGER, help="the ledger holding the runs' rows")
    parser.add_argument("--out", default="", help="a CSV file to append the lines to")
    args = parser.parse_args(argv)
    try:
        if args.seq_len < 1:
            raise RescoreError(f"--seq-len {args.seq_len}: expected a window of at least one token")
        if args.out and Path(args.out).is_file() and Path(args.out).stat().st_size:
            with open(args.out, newline="") as f:
                if next(csv.reader(f), []) != COLUMNS:
                    raise RescoreError(f"--out {args.out}: its header is not {','.join(COLUMNS)}")
        runs = [resolve(name, args.ledger) for name in args.runs]
    except RescoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        r = run.row
        line = dict(run_id=r["run_id"], config=r["config"], variant=r["variant"], seed=r["seed"], steps=r["steps"],
                    row_seq_len=config.eval_seq_len(run.cfg), row_val_bpb=r["val_bpb"], seq_len=args.seq_len,
                    val_bpb=format(rescore(run, args.seq_len), ".6g"))
        print(" ".join(f"{k}:{v}" for k, v in line.items()), flush=True)
        if args.out:
            with open(args.out, "a", newline="") as f:
                writer = csv.DictWriter(f, COLUMNS)
                if not f.tell():
                    writer.writeheader()
                writer.writerow(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
