"""The competition kit's prepare.py interface over an AION data folder, so that a training script written against
the kit (`from prepare import ...`: team FrontierForge's recipes/K82s4/train.py, github
marker2601/trainium-simulator) runs unchanged on AION's data. Put this folder on PYTHONPATH and name the data
folder in AION_KIT_DATA: fineweb_{train,val}_*.bin shards with tokenizer.pkl and token_bytes.pt beside them, as
`python data.py prepare --tokenizer-kind tiktoken` writes them (data/builtin/tiktoken8192 for the built-in corpus).
tools/lineage_run.py runs a script this way and scores the model it saves.

The kit's own prepare.py is not public (docs/competition.md). Known, from karpathy/autoresearch's prepare.py (the
kit's parent), FrontierForge's calls and their offline stand-in of it (a test stub with these signatures):
TOKENIZER_VOCAB_SIZE 8192; TRAIN_STARTUP_STEPS_EXCLUDED 5 and TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS 900 (the charged
clock starts at the end of the 5th optimizer step, the startup before it is free up to 900 s); the Tokenizer (a
pickled tiktoken Encoding, BOS <|reserved_0|>, texts encoded as ordinary text, BOS prepended on request);
make_dataloader's BOS-aligned best-fit packing from 1,000 documents (data.py's packed order); _document_batches
yielding (texts, epoch) forever, epochs from 1; evaluate_bpb's formula (kit.evaluate_bpb: nats over the kit's
token_bytes, 0-byte targets left out) and its "val_bpb"; causality_check's {"passed", "max_abs_diff"};
record_step_boundary(step) after each optimizer step.
Assumed: TRAIN_TIME_BUDGET_SECONDS is AION_KIT_SECONDS (default 600; the kit's is 1800); EVAL_TIMEOUT_SECONDS 1200
(the stub's); make_dataloader's state {"epoch"} (the stub's); rank r of a world of n reads documents r, r + n, ...
of the split (the kit shards its parquet row groups); "val" and "public_val" are AION's validation shards;
evaluate_bpb's default max_tokens autoresearch's 40 x 524,288; causality_check's test (the tokens after a position
changed, the logits up to it within AION's contract tolerance 1e-5); record_step_boundary writes "step
monotonic-seconds" lines to the file AION_KIT_STEP_LOG names, if any (the kit feeds its charged clock from it).
Tokenizer.encode uses at most torch's threads (a one-thread run stays one thread; the ids do not change).

The virtual charged clock (AION_KIT_STEP_SECONDS=c, for runs at equal steps; after FrontierForge's GPU proxy, their
docs/SIMULATOR.md, "Virtual charged clock"): the script that imports this module (the process's __main__) gets a
`time` whose monotonic() stands still from this import on and moves on by c at each record_step_boundary. So every
step it times took c, its startup steps included (their compilation cannot end a run early through its stop rule's
step estimate), its charged clock (monotonic since the end of the startup) reads c x the steps after the startup,
and every time-keyed switch and the stop fall on the step a chip's (or any machine's) step time of c puts them,
whatever this machine's speed. One cost for every step: the script's micro-batches per step (its batch ramp) are its
own and never reach this module. steps.log keeps the real seconds.
"""
import functools
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.append(str(_ROOT))
import data  # noqa: E402  (AION's, found through _ROOT)
import kit  # noqa: E402

EVAL_TIMEOUT_SECONDS = 1200
TOKENIZER_VOCAB_SIZE = 8192
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS = 900
TRAIN_STARTUP_STEPS_EXCLUDED = 5


def _budget_seconds() -> float:
    value = os.environ.get("AION_KIT_SECONDS") or "600"
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"AION_KIT_SECONDS={value}: expected the training budget in seconds, > 0")
    return seconds


TRAIN_TIME_BUDGET_SECONDS = _budget_seconds()
EVAL_TOKENS = 40 * 524288
EXPECTED = "fineweb_train_*.bin and fineweb_val_*.bin shards with tokenizer.pkl and token_bytes.pt"
SPLITS = {"train": "train", "val": "val", "public_val": "val"}


def data_dir() -> Path:
    """The data folder AION_KIT_DATA names, checked for the shards of both splits and the tokenizer's files."""
    value = os.environ.get("AION_KIT_DATA", "")
    if not value:
        raise data.DataError(f"AION_KIT_DATA is not set: name an AION data folder holding {EXPECTED} "
                             f"(e.g. data/builtin/tiktoken8192, made by `python data.py prepare --tokenizer-kind "
                             f"tiktoken --vocab-size 8192 --out DIR`)")
    folder = Path(value)
    missing = [name for name in ("tokenizer.pkl", "token_bytes.pt") if not (folder / name).is_file()]
    missing += [f"fineweb_{split}_*.bin" for split in ("train", "val") if not data.split_files(folder, split)]
    if missing:
        raise data.DataError(f"AION_KIT_DATA={value}: no {', '.join(missing)}; expected an AION data folder holding "
                             f"{EXPECTED}")
    return folder


def _files(split: str) -> list:
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    return data.split_files(data_dir(), SPLITS[split])


class Tokenizer:
    """The kit's tokenizer: enc, a tiktoken Encoding whose BOS is <|reserved_0|>."""

    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = data.tiktoken_bos(enc)

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_bos_token_id(self) -> int:
        return self.bos_token_id

    def encode(self, text, prepend=None, num_threads=8):
        """A text -> its ids, a list of texts -> a list of id lists; special-token text is ordinary text;
        prepend (an id or a special token's name) goes before each."""
        first = [] if prepend is None else [prepend if isinstance(prepend, int) else self.enc.encode_single_token(prepend)]
        if isinstance(text, str):
            return first + self.enc.encode_ordinary(text)
        if isinstance(text, list):
            threads = max(1, min(num_threads, torch.get_num_threads()))
            return [first + ids for ids in self.enc.encode_ordinary_batch(text, num_threads=threads)]
        raise ValueError(f"Tokenizer.encode: expected a str or a list of str, got {type(text).__name__}")

    def decode(self, ids) -> str:
        return self.enc.decode(ids)


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str, vocab_size: int) -> Tokenizer:
    return Tokenizer(data.load_tiktoken(folder, vocab_size))


def ensure_tokenizer(build_if_missing: bool = False) -> Tokenizer:
    """AION_KIT_DATA's tokenizer, of TOKENIZER_VOCAB_SIZE ids. Never built here: AION's `data.py prepare` makes it
    with the shards (build_if_missing changes nothing)."""
    return _tokenizer(str(data_dir()), TOKENIZER_VOCAB_SIZE)


def get_token_bytes(device="cpu") -> torch.Tensor:
    """The kit's byte table (token_bytes.pt), int64."""
    return data.kit_token_bytes(data_dir()).to(device)


def get_dist_info() -> tuple:
    """(ddp, rank, local_rank, world_size), from torchrun's environment; (False, 0, 0, 1) without it."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def print0(*args, **kwargs):
    if get_dist_info()[1] == 0:
        print(*args, **kwargs)


class _VirtualClock:
    """monotonic(): the real clock's reading when it was made + step_s x the step boundaries since."""

    def __init__(self, step_s: float):
        self.step_s, self.now = step_s, time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def boundary(self):
        self.now += self.step_s


def _virtual_clock():
    """AION_KIT_STEP_SECONDS's clock, installed as the `time` of the importing script (__main__); None unset."""
    value = os.environ.get("AION_KIT_STEP_SECONDS", "")
    if not value:
        return None
    try:
        step_s = float(value)
    except ValueError:
        step_s = 0.0
    if not (step_s > 0 and step_s < float("inf")):
        raise ValueError(f"AION_KIT_STEP_SECONDS={value}: expected the charged seconds of one step, a finite number > 0")
    clock = _VirtualClock(step_s)
    script = sys.modules.get("__main__")
    if getattr(script, "time", None) is not time:
        raise ValueError(f"AION_KIT_STEP_SECONDS={value}: the script run (__main__) has no `time` module yet to charge "
                         f"by steps; expected `import time` before `from prepare import ...`, as K82s4's")
    virtual = type(time)("time", "the time module, monotonic() charged by steps (prepare.py's virtual clock)")
    virtual.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")}, monotonic=clock.monotonic)
    script.time = virtual
    return clock


_CLOCK = _virtual_clock()


def record_step_boundary(step: int):
    """After optimizer step `step` (0-based): "step monotonic-seconds" (real seconds) appended to AION_KIT_STEP_LOG, if
    set; the virtual clock, if on, moves on."""
    path = os.environ.get("AION_KIT_STEP_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{step} {time.monotonic():.6f}\n")
    if _CLOCK is not None:
        _CLOCK.boundary()


def _document_batches(split, start=0, step=1, tokenizer_batch_size=128):
    """(texts, epoch) forever, epochs from 1: the split's documents (the BOS-delimited spans of its shards,
    decoded without their BOS: Tokenizer.encode gives their ids back), start, start + step, ..., in order,
    tokenizer_batch_size at a time."""
    tokenizer = ensure_tokenizer()
    stream = np.concatenate([data.load_shard(f, tokenizer.get_vocab_size()) for f in _files(split)])
    bounds = [*np.flatnonzero(stream == tokenizer.get_bos_token_id()).tolist(), len(stream)]
    mine = range(start, len(bounds) - 1, step)
    if not mine:
        raise data.DataError(f"{data_dir()}: {len(bounds) - 1} {split} documents, none for rank {start} of {step}")
    epoch = 1
    while True:
        for i in range(0, len(mine), tokenizer_batch_size):
            yield [tokenizer.decode(stream[bounds[d] + 1:bounds[d + 1]].tolist())
                   for d in mine[i:i + tokenizer_batch_size]], epoch
        epoch += 1


def make_dataloader(tokenizer, B, T, split, device="cpu", buffer_size=1000):
    """(inputs, targets, {"epoch"}) forever: int64 [B, T] on device, this rank's rows of T + 1 tokens, each
    starting with BOS, whole documents packed best-fit from a buffer of data.PACK_BUFFER_DOCS (the kit's 1,000),
    the shortest cropped to fill a row (data.TrainLoader's packed order)."""
    if buffer_size != data.PACK_BUFFER_DOCS:
        raise ValueError(f"buffer_size {buffer_size}: AION's packed loader packs from {data.PACK_BUFFER_DOCS} documents")
    _, rank, _, world_size = get_dist_info()
    loader = data.TrainLoader(_files(split), B, T, tokenizer.get_vocab_size(), rank, world_size, prefetch=0,
                              order="packed", bos_id=tokenizer.get_bos_token_id())
    while True:
        x, y = loader.next_batch()
        yield x.to(device), y.to(device), {"epoch": loader.epoch + 1}


def _backend(device) -> SimpleNamespace:
    """What kit.evaluate_bpb needs of train.Backend: the device, its sum dtype, a step boundary (none off XLA)."""
    device = torch.device(device)
    return SimpleNamespace(device=device, mark_step=lambda: None,
                           sum_dtype=torch.float32 if device.type in ("xla", "neuron") else torch.float64)


def evaluate_bpb(model, tokenizer, batch_size, seq_len, device, split="public_val", max_tokens=EVAL_TOKENS,
                 timeout_seconds=EVAL_TIMEOUT_SECONDS) -> dict:
    """The kit's val_bpb of model (forward(idx) -> logits [B, T, V]) over max_tokens of the split's packed rows of
    seq_len, batch_size a batch (data.packed_val_batches: the split's documents repeat when it has fewer), by
    kit.evaluate_bpb; TimeoutError past timeout_seconds. -> {"val_bpb", "nats", "bytes", "tokens", "seconds"}."""
    start = time.monotonic()

    def batches():
        for batch in data.packed_val_batches(_files(split), seq_len, batch_size, tokenizer.get_vocab_size(),
                                             tokenizer.get_bos_token_id(), max_tokens):
            if time.monotonic() - start > timeout_seconds:
                raise TimeoutError(f"evaluate_bpb: past its {timeout_seconds} s (EVAL_TIMEOUT_SECONDS)")
            yield batch

    bpb, nats, n_bytes, tokens = kit.evaluate_bpb(model, batches(), get_token_bytes(), _backend(device))
    return dict(val_bpb=bpb, nats=nats, bytes=n_bytes, tokens=tokens, seconds=time.monotonic() - start)


@torch.no_grad()
def causality_check(model, tokenizer, batch_size, seq_len, device, tolerance=1e-5) -> dict:
    """Whether model's logits at positions <= t stay within tolerance when the tokens after t change (t a quarter
    and half of the row, and its second last position), on batch_size packed validation rows."""
    vocab = tokenizer.get_vocab_size()
    x, _ = next(data.packed_val_batches(_files("val"), seq_len, batch_size, vocab, tokenizer.get_bos_token_id(),
                                        batch_size * seq_len))
    x = x.to(device)
    logits, g, worst = model(x), torch.Generator().manual_seed(0), 0.0
    for t in (seq_len // 4, seq_len // 2, seq_len - 2):
        later = x.clone()
        later[:, t + 1:] = torch.randint(0, vocab, (batch_size, seq_len - t - 1), generator=g).to(device)
        worst = max(worst, (model(later)[:, :t + 1] - logits[:, :t + 1]).abs().max().item())
    return dict(passed=worst <= tolerance, max_abs_diff=worst)
