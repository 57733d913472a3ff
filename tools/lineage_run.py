"""Runs a competition-lineage training script unchanged on AION's task and scores what it saves as AION scores its
own runs: one ledger row, as tools/nanogpt.py writes nanoGPT's recipe's. Made for team FrontierForge's
recipes/K82s4/train.py (github marker2601/trainium-simulator), the lineage's best public recipe; the script is never
part of this repository.

    python -m tools.lineage_run --script PATH/TO/K82s4/train.py [--seconds 600] [--seed 73] [--threads N]
                                [--dtype aion|script|bfloat16|float32] [--clock FILE --steps N] [--record-rows]
                                [--rows-only FILE --steps N]
                                [--config configs/cpu_lineage.yaml] [--name K82s4] [key.sub=value ...]

The script runs as one process (a world of 1) on --threads threads (OMP_NUM_THREADS; default torch's here, as
train.py runs; the scoring after it, untimed, keeps this process's threads; its torch.compile cache in a folder of
that count, TORCHINDUCTOR_CACHE_DIR=<inductor's cache>/threads-N, as kernels compiled for one count run at it), with
tools/kit_prepare on PYTHONPATH as the kit's prepare.py over the config's data (AION_KIT_DATA; the built-in corpus
is prepared on first use, as train.py does) and these of its FF_* settings from the config:
- the shape: model.n_layer (FF_DEPTH), model.n_embd / model.n_head (FF_HEAD_DIM), n_embd / n_layer (FF_ASPECT_RATIO:
  its width is depth x aspect rounded up to whole heads), model.n_kv_head (FF_KV_HEADS), optim.batch_tokens
  (FF_TOTAL_BATCH) in micro-batches of optim.micro_batch rows (FF_MB) of data.seq_len, which must be its SEQ_LEN of
  1,024; attention-source reuse model.attn_source_after:attn_source_layers (FF_ATTN_SRC; its own 5:6,7,8 needs 9
  layers, "" = off);
- the budget: --seconds is the kit's TRAIN_TIME_BUDGET_SECONDS (AION_KIT_SECONDS) and FF_TIME_TARGET is 5 s less (its
  1,795 of the kit's 1,800); its charged clock starts at the end of the 5th step (the startup before that is free up
  to the kit's 900 s); --seed is FF_SEED;
- what one CPU process needs: its batch ramp (FF_ACCUM_SCHED=1:0.06,2:0.2,4) wants 4 micro-batches a step, so at
  another count K it runs FF_ACCUM_SCHED=K with FF_ACCUM_LR=1 (no ramp); FF_STREAM_MIX at most the micro-batch's rows;
  FF_MUON_ZERO, FF_MUON_ZERO2 and FF_ADAMW_ZERO off: they shard the optimizer over ranks and need torch.distributed
  with more than one (its docstrings: each gives the unsharded update bit for bit).
All else is its default. It writes <run.out_dir>/<run id>/: train.py (the script as it ran), log.txt (its output),
steps.log (the kit's step boundaries), final.pt (its checkpoint), metrics.jsonl (its training loss as `ledger.py
plot curves` reads AION's: a record per step line of its log, every 10th step, its loss there a debiased EMA (0.9)
of the last micro-batch's, at the charged seconds and tokens after that step).

The arithmetic (--dtype): the script's compute_dtype_for returns float32 on every device but CUDA and Neuron, so on
a CPU it would train in float32 where AION trains in bfloat16 (train.compute_dtype: CPUs with AVX512-BF16 or AMX),
and compare arithmetic, not recipes. `aion` (the default) is the dtype train.py computes in on this machine,
`bfloat16` and `float32` are those, `script` its own choice. Any but `script` replaces the body of its
compute_dtype_for (found by its syntax tree, in the copy run_dir/train.py; the original is not touched) with a
return of that dtype: its one change, on every device (training and load_for_eval). The row's notes name the dtype,
the threads and both files' sha256.

Equal steps (--clock FILE --steps N): FILE a calibration made elsewhere (clock.py) with one cost for every step, as
`python -m tools.equal_steps` writes it; the script's charged clock becomes the kit shim's virtual clock
(AION_KIT_STEP_SECONDS: that cost for every step, its 5 startup steps included; tools/kit_prepare), so every time-keyed
switch falls on the step the cost puts it, and it stops at step N (its --num-steps, NEURON_COMPETITION_R1_NUM_STEPS);
no wall-clock limit kills it then (its steps end it, not this machine's speed; Ctrl-C still stops it).
AION takes the same steps and switch points with budget.clock=calibrated budget.calibration=FILE
budget.charge=kit budget.seconds=<its FF_TIME_TARGET> budget.max_steps=N. The row's clock is then `calibrated`
with FILE's id, and its train_s the charged seconds of the virtual clock.

The same tokens (--record-rows): after the run, run_dir/rows.bin holds the rows it trained on, in order, as a shard
of rows of SEQ_LEN + 1 tokens that train.py replays (data.order=replay data.replay=FILE): the first steps x
batch_tokens / SEQ_LEN rows its own training loader (make_train_stream_loader over the shim's documents) yields,
imported from the script with the run's settings and run apart from training. Its rows depend on the documents, its
seed and those settings alone (its streams, its row pool and its generator's seed), not on training, so they are the
rows the run drew, micro-batch after micro-batch; each row is its inputs and the last target (its masked BOS
targets, -1, are BOS again). `--rows-only FILE --steps N` writes the same rows of N steps to FILE without the run
(no row in the ledger): the rows a replay needs without the script's training.

The score: final.pt loaded through the script's own load_for_eval (the script imported by its path, in the run's
environment), its rotary tables extended to the windows scored (it builds them for its rows and refuses longer
input; its key offset keeps the channels chosen for its rows, as AION's load_for_eval does), then AION's exact val_bpb
(tools/nanogpt.evaluate over its logits: the whole validation split, or eval.tokens, in windows of eval.seq_len,
config.eval_rows of them per forward) and the kit's protocol (kit_val_bpb, as train.py's evaluate_kit). The row:
config "lineage:<name>" (default: the script's folder), clock wall, steps and train_s from the kit's step boundaries
(the charged seconds: from the end of the 5th step), tokens and tokens_per_s from the script's ff_summary line, the
recipe a hash of the script, its FF_* settings but the seed, the data and the budget. Exit 2 before the run for a
missing script or a bad config or data; a run that fails (its exit code and the tail of its output), leaves no
checkpoint or is interrupted still appends its row (status failed or interrupted; exit 1 or 128 + the signal).
"""
import argparse
import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import clock
import config
import data
import ledger
import train
from config import ROOT, ConfigError, load_config
from tools import nanogpt

SHIM = ROOT / "tools" / "kit_prepare"
SEQ_LEN = 1024  # the script's rows (its SEQ_LEN; no FF_ variable sets it)
VOCAB = 8192  # the kit's TOKENIZER_VOCAB_SIZE
TARGET_MARGIN_S = 5.0  # FF_TIME_TARGET = budget - this (its 1,795 s of 1,800)
RESERVE_S = 5.0  # its CHECKPOINT_RESERVE_SECONDS: it stops once charged + a step + this reaches FF_TIME_TARGET
DTYPES = ("aion", "script", "bfloat16", "float32")
RAMP_K = 4  # micro-batches a step that its FF_ACCUM_SCHED default ramps up to
STARTUP_EXCLUDED = 5  # the kit's TRAIN_STARTUP_STEPS_EXCLUDED: the charged clock starts at the end of this step
LIMIT_SLACK_S = 900 + 600  # the run is killed past --seconds + the kit's startup cap + time to save
TAIL_LINES = 40
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def script_settings(cfg, seconds: float, seed: int) -> dict:
    """The FF_* settings of the config's shape, budget and seed (module docstring); ConfigError if it has none."""
    m, o = cfg.model, cfg.optim
    if cfg.data.seq_len != SEQ_LEN:
        raise ConfigError(f"data.seq_len: the script trains on rows of {SEQ_LEN} (its SEQ_LEN, no FF_ setting), got "
                          f"{cfg.data.seq_len}")
    head_dim, aspect = m.n_embd // m.n_head, -(-m.n_embd // m.n_layer)
    if head_dim * m.n_head != m.n_embd or -(-m.n_layer * aspect // head_dim) * head_dim != m.n_embd:
        raise ConfigError(f"model.n_embd={m.n_embd}: the script's width is n_layer x an integer aspect ratio rounded up "
                          f"to heads of n_embd / n_head; none gives {m.n_embd} at {m.n_layer} layers, {m.n_head} heads")
    if o.batch_tokens % (o.micro_batch * SEQ_LEN):
        raise ConfigError(f"optim.batch_tokens={o.batch_tokens}: expected a multiple of optim.micro_batch x {SEQ_LEN}")
    k = o.batch_tokens // (o.micro_batch * SEQ_LEN)
    settings = dict(FF_DEPTH=m.n_layer, FF_ASPECT_RATIO=aspect, FF_HEAD_DIM=head_dim, FF_KV_HEADS=m.n_kv_head,
                    FF_MB=o.micro_batch, FF_TOTAL_BATCH=o.batch_tokens, FF_SEED=seed,
                    FF_TIME_TARGET=f"{max(1.0, seconds - TARGET_MARGIN_S):g}",
                    FF_ATTN_SRC=f"{m.attn_source_after}:{','.join(map(str, m.attn_source_layers))}"
                    if m.attn_source_layers else "",
                    FF_MUON_ZERO=0, FF_MUON_ZERO2=0, FF_ADAMW_ZERO=0)
    if k != RAMP_K:
        settings.update(FF_ACCUM_SCHED=k, FF_ACCUM_LR=1)
    if o.micro_batch < 8:
        settings["FF_STREAM_MIX"] = o.micro_batch
    return {key: str(value) for key, value in settings.items()}


def with_dtype(script: Path, dtype: str) -> str:
    """The script's source with its compute_dtype_for's body replaced by `return torch.<dtype>`; ConfigError if it has
    no such top-level function."""
    source = script.read_text()
    function = next((node for node in ast.parse(source).body
                     if isinstance(node, ast.FunctionDef) and node.name == "compute_dtype_for"), None)
    if function is None:
        raise ConfigError(f"--dtype {dtype}: {script} has no top-level compute_dtype_for(device) to set its arithmetic "
                          f"by; use --dtype script")
    lines = source.splitlines(keepends=True)
    first = function.body[0].lineno - 1
    indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
    return "".join(lines[:first] + [f"{indent}return torch.{dtype}  # tools/lineage_run.py --dtype\n"]
                   + lines[function.end_lineno:])


def virtual_step_seconds(calibration: str) -> tuple:
    """-> (its id, the one cost of every step in seconds, its source) of a calibration made elsewhere; ConfigError for
    another kind or costs that differ by tokens per step (the shim charges every step alike)."""
    doc = clock.read(calibration)
    if not clock.made_elsewhere(doc) or len(set(doc["step_ms"].values())) != 1:
        raise ConfigError(f"--clock {calibration}: expected a calibration made elsewhere with one cost for every step "
                          f"(python -m tools.equal_steps writes one); the script's virtual clock charges its steps alike")
    return doc["id"], next(iter(doc["step_ms"].values())) / 1000, f"{doc['source']} ({doc['machine']})"


def record_rows(script: Path, env: dict, out: Path, steps: int, batch_tokens: int):
    """Writes the rows of `steps` steps of `batch_tokens`, the first ones of the script's training loader, to the
    shard `out` (module docstring)."""
    rows = steps * batch_tokens // SEQ_LEN
    os.environ.update(env)
    module = import_script(script)
    if not module.STREAM_MIX:
        raise ConfigError(f"--record-rows: {script} trains on its stream rows only with FF_STREAM_MIX > 0 (its default 8)")
    tokenizer = module.ensure_tokenizer()
    loader = module.make_train_stream_loader(tokenizer, module.DEVICE_BATCH_SIZE, module.TRAIN_SEQ, torch.device("cpu"), 1)
    kept = []
    while len(kept) * module.DEVICE_BATCH_SIZE < rows:
        x, y, _ = next(loader)
        last = y[:, -1:].clone()
        last[last < 0] = tokenizer.get_bos_token_id()
        kept.append(torch.cat([x.long(), last], 1))
    data.write_shard(out, torch.cat(kept)[:rows].numpy().astype(np.uint16).ravel())


def run_script(script: Path, env: dict, run_dir: Path, limit_s) -> tuple:
    """The script in a subprocess (cwd run_dir), its output echoed and kept in log.txt; SIGINT and SIGTERM are passed
    on to it; killed past limit_s (None: never; under the virtual clock a run's wall time is not its budget's).
    -> (exit code, its last lines, its ff_summary dict or None, signals received)."""
    proc = subprocess.Popen([sys.executable, "-u", str(script)], cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)

    def forward(signum, frame):
        signals.append(signum)
        proc.send_signal(signum)

    def kill():
        killed.append(limit_s)
        proc.kill()

    signals, killed = [], []
    handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    watchdog = threading.Timer(limit_s or 0, kill)
    if limit_s:
        watchdog.start()
    tail, summary = deque(maxlen=TAIL_LINES), None
    try:
        with open(run_dir / "log.txt", "w") as log:
            for line in proc.stdout:
                print(line, end="", flush=True)
                log.write(line)
                tail.append(line)
                if line.startswith("ff_summary: "):
                    summary = json.loads(line.removeprefix("ff_summary: "))
        code = proc.wait()
    finally:
        watchdog.cancel()
        for s, h in handlers.items():
            signal.signal(s, h)
    if killed:
        tail.append(f"[lineage_run: killed past {limit_s:.0f} s]\n")
    return code, "".join(tail), summary, signals


STEP_LINE = re.compile(r"^step (\d+) \| loss ([-\w.]+) \|")


def write_curve(run_dir: Path, summary: dict, step_s, micro_tokens: int, batch_tokens: int):
    """run_dir/metrics.jsonl from its log's step lines (module docstring): charged seconds from steps.log (the virtual
    clock's step_s a step, if on), tokens from its batch ramp's switches in its summary (the full batch before)."""
    times = [float(line.split()[1]) for line in (run_dir / "steps.log").read_text().splitlines()] \
        if (run_dir / "steps.log").exists() else []
    switches = {s[1]: s[3] for s in (summary.get("accum_sched") or {}).get("switches", [])}
    k, tokens, records = batch_tokens // micro_tokens, 0, []
    lines = (run_dir / "log.txt").read_text().splitlines()
    losses = {int(m[1]): float(m[2]) for m in map(STEP_LINE.match, lines) if m}
    for step in range(len(times)):
        k = switches.get(step, k)
        tokens += k * micro_tokens
        if step in losses:
            charged = (step_s * max(0, step + 1 - STARTUP_EXCLUDED) if step_s else
                       times[step] - times[min(step, STARTUP_EXCLUDED - 1)])
            records.append(dict(kind="train", step=step + 1, train_s=round(charged, 3), tokens=tokens, loss=losses[step]))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def step_clock(path: Path) -> dict:
    """The kit's clock from record_step_boundary's lines: steps, the charged seconds (the end of step 5 to the end of
    the last) and the median step after it; {} when the script recorded none."""
    times = [float(line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []
    if not times:
        return {}
    charged = times[STARTUP_EXCLUDED - 1:]  # the boundaries from the end of step 5 on
    return dict(steps=len(times), train_s=charged[-1] - charged[0] if charged else 0.0,
                step_ms_p50=1000 * statistics.median(b - a for a, b in zip(charged, charged[1:]))
                if len(charged) > 1 else None)


class NextTokenNLL(nn.Module):
    """A logits model (forward(idx) -> [B, T, V]) as tools/nanogpt.evaluate scores a model: forward(idx, targets,
    reduction) -> the targets' cross-entropy under its logits; wte.num_embeddings, the vocabulary."""

    def __init__(self, model: nn.Module, vocab_size: int):
        super().__init__()
        self.model, self.wte = model, SimpleNamespace(num_embeddings=vocab_size)

    def forward(self, idx, targets, reduction="none"):
        return F.cross_entropy(self.model(idx).float().flatten(0, 1), targets.flatten(), reduction=reduction)


def import_script(script: Path):
    """The script as a module (its module-level settings read the FF_* variables of os.environ now), its
    `from prepare import ...` answered by tools/kit_prepare."""
    if str(SHIM) not in sys.path:
        sys.path.insert(0, str(SHIM))
    spec = importlib.util.spec_from_file_location("lineage_script", script)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def load_model(script: Path, env: dict, checkpoint: Path, length: int) -> nn.Module:
    """The checkpoint through the script's own load_for_eval on the CPU, able to read `length` tokens: the script
    imported by its path in the run's environment (its module-level settings read its FF_* variables), its rotary
    tables rebuilt by its own method for `length` positions (the first ones are unchanged)."""
    os.environ.update(env)
    model = import_script(script).load_for_eval(str(checkpoint), torch.device("cpu"))
    if length > model.config.sequence_len:
        model.config.sequence_len = length
        model.cos, model.sin = model._precompute_rotary_embeddings(
            model._rope_len(), model.config.n_embd // model.config.n_head, model.config.rope_base)
    return model


def score(cfg, model: nn.Module, val_files, tokenizer) -> dict:
    """AION's exact val_bpb (tools/nanogpt.evaluate: train.py's windows) and, where the config scores it, the kit's
    protocol as train.py's evaluate_kit runs it."""
    table, start = data.ByteTable(tokenizer), time.perf_counter()
    seq_len = config.eval_seq_len(cfg)
    val_loss, val_bpb, val_tokens, val_bytes = nanogpt.evaluate(
        NextTokenNLL(model, cfg.model.vocab_size), val_files, seq_len, config.eval_rows(cfg, seq_len), table, cfg.eval.tokens)
    kit_val_bpb = None
    if train.kit_scored(cfg):
        model.eval()
        backend = train.Backend(dataclasses.replace(cfg.device, type="cpu"))
        kit_val_bpb = train.kit_val_bpb(cfg, model, val_files, table.bos_id, data.kit_token_bytes(tokenizer), backend)[0]
    return dict(val_loss=val_loss, val_bpb=val_bpb, val_tokens=val_tokens, val_bytes=val_bytes, kit_val_bpb=kit_val_bpb,
                eval_s=time.perf_counter() - start)


def arguments() -> argparse.ArgumentParser:
    """The command line (module docstring); a row's overrides column holds a run's (tools/rescore.py reads it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", required=True, help="the lineage's train.py (FrontierForge's recipes/K82s4/train.py)")
    parser.add_argument("--seconds", type=float, default=600.0, help="the kit's training budget (its charged clock)")
    parser.add_argument("--seed", type=int, default=73, help="FF_SEED (the script's own default: 73)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="the script's torch threads (OMP_NUM_THREADS); default torch's, as train.py runs")
    parser.add_argument("--dtype", choices=DTYPES, default="aion",
                        help="its arithmetic: aion (what train.py computes in here), script (its own), bfloat16, float32")
    parser.add_argument("--clock", default="", help="equal steps: a calibration made elsewhere, one cost a step "
                                                    "(python -m tools.equal_steps); needs --steps")
    parser.add_argument("--steps", type=int, default=0, help="with --clock: stop after this many optimizer steps; "
                                                              "with --rows-only: the steps whose rows it writes")
    parser.add_argument("--record-rows", action="store_true",
                        help="write run_dir/rows.bin, the rows it trained on, for train.py's data.order=replay")
    parser.add_argument("--rows-only", default="", metavar="FILE",
                        help="write FILE, the rows --record-rows writes after --steps steps, without the run")
    parser.add_argument("--config", default=str(ROOT / "configs" / "cpu_lineage.yaml"), help="shape, data, eval, run, ledger")
    parser.add_argument("--name", default="", help="the row's config is lineage:NAME; default the script's folder name")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides; later ones win")
    return parser


def kit_env(folder: Path, seconds: float, run_dir: Path) -> dict:
    """The kit shim's settings of a run (tools/kit_prepare): its data folder, its budget and its step log."""
    return dict(AION_KIT_DATA=str(folder), AION_KIT_SECONDS=f"{seconds:g}", AION_KIT_STEP_LOG=str(run_dir / "steps.log"))


def main(argv=None) -> int:
    args = arguments().parse_intermixed_args(argv)
    script = Path(args.script).resolve()
    try:
        if not script.is_file():
            raise ConfigError(f"--script {args.script}: no such file; expected a kit-style train.py (FrontierForge's "
                              f"recipes/K82s4/train.py, github marker2601/trainium-simulator; never in this repository)")
        if not args.seconds > 0 or args.threads < 1 or not 0 <= args.seed < 2 ** 63:
            raise ConfigError(f"expected --seconds > 0, --threads >= 1, --seed >= 0; got {args.seconds:g}, "
                              f"{args.threads}, {args.seed}")
        if args.rows_only and args.steps < 1:
            raise ConfigError(f"--rows-only {args.rows_only}: expected --steps N, the steps whose rows it writes")
        if not args.rows_only and bool(args.clock) != (args.steps > STARTUP_EXCLUDED):
            raise ConfigError(f"--clock {args.clock or '(none)'} --steps {args.steps}: equal steps need both, a "
                              f"calibration made elsewhere and more than its {STARTUP_EXCLUDED} startup steps")
        virtual = virtual_step_seconds(args.clock) if args.clock else None
        cfg = load_config(args.config, args.overrides)
        if cfg.data.tokenizer_kind != "tiktoken" or cfg.model.vocab_size != VOCAB:
            raise ConfigError(f"data.tokenizer_kind={cfg.data.tokenizer_kind}, model.vocab_size={cfg.model.vocab_size}: "
                              f"the script needs the kit's kind of tokenizer of {VOCAB} ids (tiktoken, {VOCAB})")
        settings = script_settings(cfg, args.seconds, args.seed)
        if virtual:
            settings.update(AION_KIT_STEP_SECONDS=repr(virtual[1]), NEURON_COMPETITION_R1_NUM_STEPS=str(args.steps))
        dtype = (str(train.compute_dtype(cfg.device, "cpu", False)).removeprefix("torch.") if args.dtype == "aion"
                 else args.dtype)
        source = with_dtype(script, dtype) if dtype != "script" else None
        train_files, val_files, tokenizer, data_sha = train.open_data(cfg)
        folder = train_files[0].parent.resolve()
        if not (folder / "tokenizer.pkl").is_file():
            raise data.DataError(f"{folder}: its shards have no tokenizer.pkl beside them; the kit's prepare.py "
                                 f"(tools/kit_prepare) reads shards and tokenizer from one folder")
        train.check_outputs(cfg)
    except (ConfigError, data.DataError, ledger.LedgerError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.rows_only:  # the rows depend on the documents and the FF_* settings alone (record_rows), not on a run
        out = Path(args.rows_only)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            record_rows(script, {**{k: v for k, v in settings.items() if k.startswith("FF_")},
                                 **kit_env(folder, args.seconds, out.parent)},
                        out, args.steps, cfg.optim.batch_tokens)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"rows:{out} steps:{args.steps} seed:{args.seed} script:{script}", flush=True)
        return 0
    name = args.name or script.parent.name
    run_id = f"lineage-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
    run_dir = (Path(cfg.run.out_dir) / run_id).resolve()
    run_dir.mkdir(parents=True)
    # The script's torch.compile caches CPU kernels whose OpenMP thread count is fixed when they are generated, under
    # a key without that count (torch 2.9; train.Backend.compile puts it in AION's): one cache folder per count.
    # Imported here, as in train.Backend.compile: inductor loaded at import time would load triton under the tests.
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    inductor_cache = os.path.join(cache_dir(), f"threads-{args.threads}")
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(settings, **kit_env(folder, args.seconds, run_dir), NEURON_COMPETITION_R1_OUT_DIR=str(run_dir),
               OMP_NUM_THREADS=str(args.threads), TORCHINDUCTOR_CACHE_DIR=inductor_cache,
               PYTHONPATH=os.pathsep.join([str(SHIM), *filter(None, [os.environ.get("PYTHONPATH")])]))
    script_sha, ran = hashlib.sha256(script.read_bytes()).hexdigest(), script
    if source is not None:
        ran = run_dir / "train.py"
        ran.write_text(source)
    ran_sha = hashlib.sha256(ran.read_bytes()).hexdigest()
    # the recipe: the script, its settings but the seed, the data, the budget; its arithmetic where it was set
    recipe = hashlib.sha256(json.dumps([script_sha, {k: v for k, v in settings.items() if k != "FF_SEED"}, data_sha,
                                        args.seconds] + ([dtype] if dtype != "script" else []),
                                       sort_keys=True).encode()).hexdigest()[:12]
    git_commit, git_dirty = ledger.git_state(ROOT)
    print(f"run_id:{run_id} script:{script} sha256:{script_sha[:12]} " + " ".join(f"{k}={v}" for k, v in settings.items()),
          flush=True)

    code, tail, summary, signals = run_script(ran, env, run_dir, None if virtual else args.seconds + LIMIT_SLACK_S)
    checkpoint, status, error, scores, params = run_dir / "final.pt", "failed", "", {}, None
    try:
        if signals:
            status = "interrupted"
        elif code != 0:
            error = f"the script exited with code {code}; its last lines:\n{tail}"
        elif not checkpoint.is_file():
            error = f"{checkpoint}: the script exited 0 but saved no checkpoint; its last lines:\n{tail}"
        else:
            settled = {k: v for k, v in env.items() if k.startswith(("FF_", "AION_KIT")) and k != "AION_KIT_STEP_SECONDS"}
            if args.record_rows:
                record_rows(ran, settled, run_dir / "rows.bin", step_clock(run_dir / "steps.log")["steps"],
                            cfg.optim.batch_tokens)
            model = load_model(ran, settled, checkpoint,
                               max(config.eval_seq_len(cfg), cfg.eval.kit_seq_len if train.kit_scored(cfg) else 0))
            params = sum(p.numel() for p in model.parameters())
            scores, status = score(cfg, model, val_files, tokenizer), "ok"
    except Exception as e:  # the row still records the run
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        summary, clock_ = summary or {}, step_clock(run_dir / "steps.log")
        if virtual and clock_.get("steps"):  # the charged seconds are the virtual clock's
            clock_["train_s"] = virtual[1] * max(0, clock_["steps"] - STARTUP_EXCLUDED)
        changed = "unchanged" if ran == script else f"run as {ran} (sha256 {ran_sha[:12]}: compute_dtype_for -> {dtype})"
        notes = [f"{script} sha256 {script_sha[:12]}, {changed}, on tools/kit_prepare; shape and data from "
                 f"{args.config}; " + " ".join(f"{k}={v}" for k, v in settings.items()),
                 f"dtype={dtype if dtype != 'script' else 'its own (compute_dtype_for)'} threads={args.threads}"]
        notes += [f"equal steps: the shim's virtual clock, {virtual[1]:.6g} s a step, from {virtual[2]}"] if virtual else []
        notes += [
                 f"its saved weights: {summary.get('saved_weights', '?')}; scored on windows of "
                 f"{config.eval_seq_len(cfg)} (rotary tables extended past its rows of {SEQ_LEN})"]
        notes += [cfg.ledger.notes] if cfg.ledger.notes else []
        notes += [error.splitlines()[0]] if error else []
        row = dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), run_id=run_id, git_commit=git_commit,
                   git_dirty=git_dirty, config=f"lineage:{name}",
                   overrides=" ".join([f"--script {script} --seconds {args.seconds:g} --seed {args.seed} --threads "
                                       f"{args.threads} --dtype {args.dtype}"
                                       + (f" --clock {args.clock} --steps {args.steps}" if virtual else ""),
                                       *args.overrides]),
                   device="cpu", world_size=1, seed=args.seed, data_sha=data_sha, params=params, active_params=params,
                   budget_s=args.seconds, train_s=clock_.get("train_s", summary.get("training_seconds_before_save")),
                   steps=clock_.get("steps", summary.get("steps")), tokens=summary.get("total_tokens"),
                   tokens_per_s=summary.get("tokens_per_second"), step_ms_p50=clock_.get("step_ms_p50"),
                   status=status, recipe=recipe, sweep=cfg.ledger.sweep, variant=cfg.ledger.variant,
                   machine=clock.machine(), clock="calibrated" if virtual else "wall",
                   calibration=virtual[0] if virtual else "", step_cost_ms=f"{virtual[1] * 1000:.2f}" if virtual else "",
                   notes="; ".join(notes), **scores)
        ledger.append(cfg.ledger.path, row)
        write_curve(run_dir, summary, virtual[1] if virtual else None, cfg.optim.micro_batch * SEQ_LEN,
                    cfg.optim.batch_tokens)
        print("summary " + " ".join(f"{k}:{v:.6g}" if isinstance(v, float) else f"{k}:{v}" for k, v in row.items()
                                    if v not in (None, "") and k != "notes"), flush=True)
    if error:
        print(f"error: {error}", file=sys.stderr)
    return 128 + signals[0] if signals else (0 if status == "ok" else 1)


if __name__ == "__main__":
    sys.exit(main())
