"""Data for AION: text corpora -> sentencepiece tokenizer -> FineWeb-format token shards,
plus the loaders train.py reads them with and the per-token byte table behind val_bpb.

Shard format (modded-nanogpt / parameter-golf FineWeb shards): a header of 256 little-endian
int32 (magic, version, token count, zeros), then the tokens as little-endian uint16.

    python data.py prepare --input notes/ extra.jsonl --out data/mine      # your text
    python data.py prepare --out data/builtin/sp1024                       # built-in corpus
    python data.py unigram --data data/builtin/sp1024                      # the order-0 bpb floor
"""
import argparse
import hashlib
import io
import json
import os
import queue
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import yaml

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
SHARD_TOKENS = 100_000_000  # per shard file, as in the FineWeb shards
TRAIN_CHUNK_CHARS = 2048  # sentencepiece trains on "sentences"; a chunk of whole lines is one
TRAIN_MAX_CHARS = 12_000_000  # tokenizer training sample: 4M, 12M and all 32M built-in chars compress alike
PREPARE_VERSION = 2  # bump when prepare() writes different shards for the same corpus (2: shuffled train order)


class DataError(ValueError):
    """Bad input data: the message names the file, the problem and what was expected."""


# -----------------------------------------------------------------------------
# shards

def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: token ids must fit uint16, got range [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)  # readers never see a half-written shard


def load_shard(path, vocab_size=None):
    """Memory-maps a shard's tokens (uint16), after checking its header, length and token ids."""
    size, header_bytes = os.path.getsize(path), HEADER_INTS * 4
    if size < header_bytes:
        raise DataError(f"{path}: {size} bytes, shorter than the {header_bytes}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise DataError(f"{path}: magic {header[0]}, expected {MAGIC} (not a FineWeb-format shard)")
    if header[1] != VERSION:
        raise DataError(f"{path}: version {header[1]}, expected {VERSION}")
    n = int(header[2])
    if size != header_bytes + 2 * n:
        problem = "truncated" if size < header_bytes + 2 * n else "trailing bytes"
        raise DataError(f"{path}: {problem}: header says {n} tokens ({header_bytes + 2 * n} bytes), "
                        f"file has {size} bytes")
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=header_bytes, shape=(n,))
    if vocab_size is not None and n and (top := int(tokens.max())) >= vocab_size:
        raise DataError(f"{path}: token id {top} found, expected ids < vocab_size {vocab_size}")
    return tokens


def split_files(folder, split):
    """The shards of a split ("train" or "val") in a folder, in order: fineweb_<split>_NNNNNN.bin."""
    return sorted(Path(folder).glob(f"fineweb_{split}_*.bin"))


# -----------------------------------------------------------------------------
# corpora

def builtin_documents():
    """The text every CPython ships: pydoc topic pages and the standard library's sources."""
    from pydoc_data.topics import topics
    docs = [(f"pydoc/{key}", text) for key, text in topics.items()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if not {"site-packages", "dist-packages"} & set(rel.parts):
            docs.append((rel.as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    return sorted(docs)


def read_documents(paths):
    """User text as (name, text): files, folders (recursive, sorted, hidden entries skipped) and
    .jsonl files with one {"text": ...} per line. Names are relative to the folder given, so the
    train/val split does not depend on where the data lives."""
    docs = []
    for arg in map(Path, paths):
        if arg.is_dir():
            files = [(p, p.relative_to(arg).as_posix()) for p in sorted(arg.rglob("*"))
                     if p.is_file() and not any(part.startswith(".") for part in p.relative_to(arg).parts)]
        elif arg.is_file():
            files = [(arg, arg.name)]
        else:
            raise DataError(f"{arg}: no such file or folder")
        for path, name in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            if path.suffix != ".jsonl":
                docs.append((name, text))
                continue
            for i, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: bad JSON ({e.msg}), expected one JSON object per line") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f'{path}:{i}: expected an object with a string "text" field')
                docs.append((f"{name}:{i}", record["text"]))
    if not docs:
        raise DataError(f"no documents found in {', '.join(map(str, paths)) or 'an empty path list'}")
    return docs


def corpus_sha256(documents):
    h = hashlib.sha256()
    for name, text in documents:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def is_val(name, val_fraction):
    """Stable split: a document's side depends only on its name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64 < val_fraction


def order_key(name):
    """Train documents are written in this stable pseudo-random order: read contiguously, a
    corpus in name order (the stdlib by folder) would end every run on whatever sorts last."""
    return hashlib.sha256(b"order:" + name.encode()).digest()


# -----------------------------------------------------------------------------
# tokenizer and bytes

def _chunks(texts):
    """Whole lines grouped into chunks of <= TRAIN_CHUNK_CHARS (sentencepiece skips longer
    sentences); newlines stay inside the chunks so the tokenizer learns them."""
    for text in texts:
        chunk = ""
        for line in text.splitlines(keepends=True):
            for i in range(0, len(line), TRAIN_CHUNK_CHARS):
                piece = line[i:i + TRAIN_CHUNK_CHARS]
                if len(chunk) + len(piece) > TRAIN_CHUNK_CHARS:
                    yield chunk
                    chunk = ""
                chunk += piece
        if chunk:
            yield chunk


def train_tokenizer(texts, path, vocab_size):
    """Lossless byte-fallback BPE: identity normalization, no dummy prefix, whitespace kept as is
    (indentation runs may become single pieces), digits split."""
    chunks = list(_chunks(texts))
    total = sum(map(len, chunks))
    if total > TRAIN_MAX_CHARS:  # an evenly spaced, deterministic sample
        keep = TRAIN_MAX_CHARS / total
        chunks = [c for i, c in enumerate(chunks) if int((i + 1) * keep) > int(i * keep)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(chunks), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, add_dummy_prefix=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
        max_sentence_length=4 * TRAIN_CHUNK_CHARS, input_sentence_size=0,
        unk_id=0, bos_id=1, eos_id=-1, pad_id=-1, num_threads=os.cpu_count(), minloglevel=2)
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, path)


def sentencepiece_model(path):
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:  # sentencepiece's error for a garbled or foreign file
        raise DataError(f"{path}: not a sentencepiece model ({str(e).strip()}), expected a tokenizer .model file") from None


class ByteTable:
    """UTF-8 bytes each target token decodes to, so val_bpb's denominator is computed on the
    device from (x, y) alone: bytes(y[t]) = base_bytes[y] + (has_space[y] & ~is_boundary[x]).

    base_bytes: the piece's bytes ("▁" = one space byte) without a leading "▁" that the decoder
    drops; byte-fallback pieces 1; control/unknown/unused 0. has_space: the piece starts with a
    "▁" the decoder drops at the start of a document, i.e. after a boundary token (BOS).
    Sentencepiece drops it only for models that add a dummy prefix (the FineWeb sp1024 models);
    our tokenizers (no dummy prefix) keep every "▁", so has_space is all False for them."""

    def __init__(self, tokenizer_path):
        sp = sentencepiece_model(tokenizer_path)
        self.vocab_size = n = sp.vocab_size()
        self.bos_id = sp.bos_id()  # -1: the tokenizer has none
        pieces = [sp.id_to_piece(v) for v in range(n)]
        boundary = [sp.is_control(v) or sp.is_unknown(v) or sp.is_unused(v) for v in range(n)]
        spaced = [v for v in range(n) if pieces[v].startswith("▁") and not boundary[v] and not sp.is_byte(v)]
        # ask the decoder itself whether it drops a leading "▁" at the start of the text
        drops = bool(spaced) and not sp.decode([spaced[0]]).startswith(" ")
        has_space = [False] * n
        for v in spaced:
            has_space[v] = drops
        base = [0 if boundary[v] else 1 if sp.is_byte(v) else len(pieces[v].replace("▁", " ").encode()) - has_space[v]
                for v in range(n)]
        self.base_bytes = torch.tensor(base, dtype=torch.int64)
        self.has_space = torch.tensor(has_space, dtype=torch.bool)
        self.is_boundary = torch.tensor(boundary, dtype=torch.bool)

    def to(self, device):
        self.base_bytes, self.has_space, self.is_boundary = (
            t.to(device) for t in (self.base_bytes, self.has_space, self.is_boundary))
        return self

    def target_bytes(self, x, y):
        """x, y: int64 [B, T] inputs and next-token targets -> int64 [B, T] bytes of each target."""
        if self.base_bytes.device != y.device:
            self.to(y.device)
        return self.base_bytes[y] + (self.has_space[y] & ~self.is_boundary[x])


# -----------------------------------------------------------------------------
# prepare

def _progress(label, done, total):
    filled = 30 * done // total
    end = "\n" if done == total else ""
    print(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} docs", end=end, file=sys.stderr, flush=True)


def _encode_split(sp, docs, out_dir, split, progress, keep=False):
    """Tokenizes docs (BOS before each) into out_dir's shards of the split; returns the token
    count and, with keep, each document's tokens."""
    bos, buf, n_buf, n_total, n_shards, kept = sp.bos_id(), [], 0, 0, 0, []

    def flush(final):
        nonlocal buf, n_buf, n_shards
        flat = np.concatenate(buf)
        while len(flat) >= SHARD_TOKENS or (final and len(flat)):
            write_shard(out_dir / f"fineweb_{split}_{n_shards:06d}.bin", flat[:SHARD_TOKENS])
            flat, n_shards = flat[SHARD_TOKENS:], n_shards + 1
        buf, n_buf = [flat], len(flat)

    step = 64
    for i in range(0, len(docs), step):
        for ids in sp.encode([text for _, text in docs[i:i + step]], num_threads=os.cpu_count()):
            tokens = np.array([bos, *ids], dtype=np.uint16)
            buf.append(tokens)
            n_buf += len(tokens)
            n_total += len(tokens)
            if keep:
                kept.append(tokens)
        if n_buf >= SHARD_TOKENS:
            flush(final=False)
        if progress:
            _progress(f"tokenize {split}", min(i + step, len(docs)), len(docs))
    flush(final=True)
    return n_total, kept


def _load_tokenizer(path, vocab_size):
    if not Path(path).is_file():
        raise DataError(f"{path}: no such tokenizer file, expected a sentencepiece .model")
    sp = sentencepiece_model(path)
    if sp.vocab_size() != vocab_size:
        raise DataError(f"{path}: tokenizer has {sp.vocab_size()} tokens, expected vocab_size {vocab_size}")
    if sp.bos_id() < 0:
        raise DataError(f"{path}: tokenizer has no BOS token, expected one to mark document starts")
    return sp


def prepare(documents, out_dir, vocab_size, val_fraction, tokenizer=None, progress=True):
    """Documents (name, text) -> out_dir/{tokenizer.model, fineweb_{train,val}_NNNNNN.bin,
    meta.json}. Returns the meta dict."""
    out_dir = Path(out_dir)
    if not 0 < vocab_size <= 2**16:
        raise DataError(f"vocab_size {vocab_size}: shards store uint16 tokens, expected 1..65536")
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction}: expected a fraction in (0, 1)")
    docs = [(name, text) for name, text in documents if text]
    if not docs:
        raise DataError(f"empty corpus for {out_dir}: {len(documents)} documents, none with text")
    val = [d for d in docs if is_val(d[0], val_fraction)]
    train = sorted((d for d in docs if not is_val(d[0], val_fraction)), key=lambda d: order_key(d[0]))
    if not train or not val:
        raise DataError(f"empty {'train' if not train else 'val'} split for {out_dir}: {len(docs)} documents, "
                        f"val_fraction {val_fraction} put {len(val)} in val; expected both splits non-empty "
                        f"(use more documents or another val_fraction)")

    if tokenizer is not None:
        _load_tokenizer(tokenizer, vocab_size)  # fail before touching out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [out_dir / "meta.json", *out_dir.glob("fineweb_*_*.bin")]:  # never mix with an older run
        stale.unlink(missing_ok=True)
    model = out_dir / "tokenizer.model"
    if tokenizer is None:
        if progress:
            print(f"training tokenizer: bpe vocab_size {vocab_size} on {len(train)} documents", file=sys.stderr)
        train_tokenizer([text for _, text in train], model, vocab_size)
    elif Path(tokenizer).resolve() != model.resolve():
        shutil.copyfile(tokenizer, model)  # the data folder carries its own tokenizer
    sp = _load_tokenizer(model, vocab_size)

    train_tokens, _ = _encode_split(sp, train, out_dir, "train", progress)
    val_tokens, val_docs = _encode_split(sp, val, out_dir, "val", progress, keep=True)
    table = ByteTable(model)
    stream = torch.from_numpy(np.concatenate(val_docs).astype(np.int64))
    val_bytes = int(table.target_bytes(stream[:-1], stream[1:]).sum())  # stream[0] is BOS: 0 bytes
    decoded_bytes = sum(len(sp.decode(d[1:].tolist()).encode()) for d in val_docs)
    if val_bytes != decoded_bytes:
        raise DataError(f"{tokenizer or model}: byte table counts {val_bytes} val bytes but the tokenizer decodes "
                        f"{decoded_bytes}; expected equal (unsupported piece types?)")
    meta = dict(tokenizer=str(model.resolve()), vocab_size=vocab_size, train_tokens=train_tokens,
                val_tokens=val_tokens, val_bytes=val_bytes, corpus_sha256=corpus_sha256(documents),
                val_fraction=val_fraction, n_train_docs=len(train), n_val_docs=len(val),
                prepare_version=PREPARE_VERSION)
    tmp = out_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / "meta.json")  # written last: its presence means the folder is complete
    return meta


def prepare_builtin(out_dir, vocab_size, val_fraction, progress=True):
    """prepare() on the built-in corpus, skipped when out_dir already holds it."""
    documents = builtin_documents()
    meta_path = Path(out_dir) / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if (meta.get("corpus_sha256"), meta.get("vocab_size"), meta.get("val_fraction"), meta.get("prepare_version")) == (
                corpus_sha256(documents), vocab_size, val_fraction, PREPARE_VERSION):
            return {**meta, "tokenizer": str((Path(out_dir) / "tokenizer.model").resolve())}  # folder may have moved
    return prepare(documents, out_dir, vocab_size, val_fraction, progress=progress)


def open_data(source, path, tokenizer, vocab_size, val_fraction):
    """A run's data (keys data.*): the built-in corpus (prepared on first use, in path/sp<vocab_size>) or
    shards as they are -> (train files, val files, tokenizer path, corpus fingerprint)."""
    if source == "builtin":
        root = Path(path) / f"sp{vocab_size}"
        meta = prepare_builtin(root, vocab_size, val_fraction)
        tokenizer, fingerprint = meta["tokenizer"], f"{meta['corpus_sha256'][:12]}-v{meta['prepare_version']}"
    else:
        root = Path(path)
        if not Path(tokenizer).is_file():
            raise DataError(f"data.tokenizer={tokenizer}: no such file, expected the shards' sentencepiece .model")
    train_files, val_files = split_files(root, "train"), split_files(root, "val")
    if not train_files or not val_files:
        raise DataError(f"{root}: expected fineweb_train_*.bin and fineweb_val_*.bin shards, found "
                        f"{len(train_files)} train and {len(val_files)} val")
    if source == "shards":  # hashing gigabytes of shards would delay every run: names, sizes, tokenizer
        h = hashlib.sha256(Path(tokenizer).read_bytes())
        for f in train_files + val_files:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        fingerprint = h.hexdigest()[:12]
    return train_files, val_files, tokenizer, fingerprint


# -----------------------------------------------------------------------------
# loaders

ORDERS = ("contiguous", "shuffle")


class TrainLoader:
    """Training batches from memory-mapped shards, in one of two orders (`order`):

    - contiguous: each step the world reads the next world_size * batch_size * seq_len tokens (+1
      for the shifted target) of the stream; rank r takes the r-th slice. A step that does not fit
      in the rest of a shard starts the next shard; after the last shard comes the first again.
      A batch is one stretch of text (often one or two documents): its rows are correlated.
    - shuffle: every shard is cut into windows of seq_len + 1 tokens (seq_len apart, from an
      offset drawn per epoch, so no window straddles a shard's end), and each epoch visits all of
      them once in a random permutation; a step takes the next world_size * batch_size windows
      and rank r the r-th batch_size of them. Rows come from all over the corpus, every token is
      read once per epoch (sampling with replacement would repeat some windows and miss others),
      and the order is a function of (seed, epoch) alone, so it is deterministic and resumable.

    Either way ranks are disjoint, and the position (`state_dict`) counts tokens, so a loader with
    another batch shape (an annealing stage) carries on from the same place in the epoch.
    A background thread reads `prefetch` batches ahead (0: read in next_batch)."""

    def __init__(self, files, batch_size, seq_len, vocab_size, rank=0, world_size=1, prefetch=2,
                 order="contiguous", seed=0):
        if not files:
            raise DataError("TrainLoader: no shard files given, expected fineweb_train_*.bin paths")
        if order not in ORDERS:
            raise DataError(f"TrainLoader: order {order!r}, expected one of {', '.join(ORDERS)}")
        self.files = [str(f) for f in files]
        self.shards = [load_shard(f, vocab_size) for f in self.files]
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.order, self.seed, self.prefetch, self.wait_s = order, seed, prefetch, 0.0
        self._windows = None  # shuffle: (epoch, shard of each window, start of each window) in visiting order
        if order == "contiguous":
            step_tokens = world_size * batch_size * seq_len + 1
            for f, shard in zip(self.files, self.shards):
                if len(shard) < step_tokens:
                    raise DataError(f"{f}: {len(shard)} tokens, expected at least {step_tokens} "
                                    f"(world_size {world_size} x batch_size {batch_size} x seq_len {seq_len} + 1)")
        elif (fewest := sum((len(s) - seq_len) // seq_len for s in self.shards)) < world_size * batch_size:
            raise DataError(f"{', '.join(self.files)}: {fewest} windows of seq_len {seq_len} + 1 tokens, expected at "
                            f"least world_size {world_size} x batch_size {batch_size} for one step")
        self._thread = None
        self.load_state_dict({"shard": 0, "pos": 0, "epoch": 0, "order": order})

    @property
    def epoch(self):
        return self._state["epoch"]

    def _read(self):
        """The batch at the read cursor; returns it with the cursor after it."""
        return self._read_shuffled() if self.order == "shuffle" else self._read_contiguous()

    def _read_contiguous(self):
        shard, pos, epoch = self._cursor
        rank_tokens = self.batch_size * self.seq_len
        if pos + self.world_size * rank_tokens + 1 > len(self.shards[shard]):
            shard, pos = (shard + 1) % len(self.shards), 0
            epoch += shard == 0
        start = pos + self.rank * rank_tokens
        buf = torch.from_numpy(self.shards[shard][start:start + rank_tokens + 1].astype(np.int64))
        self._cursor = (shard, pos + self.world_size * rank_tokens, epoch)
        x, y = buf[:-1].view(self.batch_size, self.seq_len), buf[1:].view(self.batch_size, self.seq_len)
        return x, y, dict(shard=shard, pos=self._cursor[1], epoch=epoch)

    def _epoch_windows(self, epoch):
        """(shard index, start token) of every window of the epoch, in the epoch's random order."""
        if self._windows is None or self._windows[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_len))  # a new cut each epoch
            counts = [(len(s) - 1 - offset) // self.seq_len for s in self.shards]
            shard = np.repeat(np.arange(len(self.shards)), counts)
            start = offset + self.seq_len * np.concatenate([np.arange(n) for n in counts])
            order = rng.permutation(len(shard))
            self._windows = (epoch, shard[order], start[order])
        return self._windows[1:]

    def _read_shuffled(self):
        _, pos, epoch = self._cursor
        first, step_windows = pos // self.seq_len, self.world_size * self.batch_size
        shard, start = self._epoch_windows(epoch)
        if first + step_windows > len(shard):  # the epoch's last windows do not fill a step
            epoch, first = epoch + 1, 0
            shard, start = self._epoch_windows(epoch)
        mine = slice(first + self.rank * self.batch_size, first + (self.rank + 1) * self.batch_size)
        span = np.arange(self.seq_len + 1)
        buf = torch.from_numpy(np.stack([self.shards[i][s + span] for i, s in zip(shard[mine], start[mine])])
                               .astype(np.int64))
        self._cursor = (0, (first + step_windows) * self.seq_len, epoch)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous(), dict(shard=0, pos=self._cursor[1], epoch=epoch)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                return self._queue.put(item, timeout=0.1)
            except queue.Full:
                pass

    def _work(self):
        try:
            while not self._stop.is_set():
                self._put(self._read())
        except Exception as e:  # handed to next_batch, which raises it in the training thread
            self._put(e)

    def next_batch(self):
        """-> x, y int64 [batch_size, seq_len] on the CPU; y is x shifted by one token."""
        t0 = time.perf_counter()
        item = self._queue.get() if self._thread else self._read()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, Exception):
            raise item
        x, y, self._state = item
        return x, y

    def state_dict(self):
        """Position of the next batch next_batch returns (not of the read-ahead), in tokens."""
        return dict(self._state, order=self.order)

    def load_state_dict(self, state):
        order = state.get("order", "contiguous")  # checkpoints from before data.order were contiguous
        if order != self.order:  # a position means something else in the other order
            raise DataError(f"loader state is of data.order {order!r}, this loader reads {self.order!r}")
        state = {k: v for k, v in state.items() if k != "order"}
        if not 0 <= state["shard"] < len(self.shards):
            raise DataError(f"loader state names shard {state['shard']}, expected < {len(self.shards)} shards")
        self._state = dict(state)
        self.close()
        if self.prefetch:
            self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
            self._thread = threading.Thread(target=self._work, daemon=True, name="TrainLoader")
            self._thread.start()

    def close(self):
        """Stops the read-ahead thread; next_batch then reads synchronously from the same position."""
        if self._thread:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._cursor = (self._state["shard"], self._state["pos"], self._state["epoch"])


def val_batches(files, seq_len, batch_size, vocab_size, max_tokens=0, rank=0, world_size=1):
    """(x, y) int64 [<= batch_size, seq_len] over non-overlapping windows of the validation tokens
    (files concatenated): window i holds tokens [i*seq_len, (i+1)*seq_len], so every token but the
    first is a target exactly once. A partial last window is dropped (fewer than seq_len targets;
    a static eval shape matters more than those tokens). max_tokens > 0 keeps the first
    max_tokens targets, in whole windows. Windows go to ranks round-robin."""
    tokens = np.concatenate([load_shard(f, vocab_size) for f in files]) if files else np.zeros(0, np.uint16)
    n_windows = max(len(tokens) - 1, 0) // seq_len
    if max_tokens > 0:
        n_windows = min(n_windows, max_tokens // seq_len)
    if n_windows == 0:
        raise DataError(f"{', '.join(map(str, files)) or 'no val files'}: {len(tokens)} tokens, "
                        f"max_tokens {max_tokens}: expected at least one window of seq_len {seq_len} + 1 tokens")
    mine = np.arange(rank, n_windows, world_size)
    for i in range(0, len(mine), batch_size):
        starts = mine[i:i + batch_size, None] * seq_len
        buf = torch.from_numpy(tokens[starts + np.arange(seq_len + 1)].astype(np.int64))
        yield buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # callers .view() them


def unigram_bpb(data_dir, vocab_size):
    """The order-0 floor: bits per byte of the val targets under the train split's token
    frequencies (add-one smoothed), over the same targets and bytes as val_bpb."""
    data_dir = Path(data_dir)
    counts = np.ones(vocab_size, dtype=np.float64)
    for f in split_files(data_dir, "train"):
        counts += np.bincount(load_shard(f, vocab_size), minlength=vocab_size)
    val = np.concatenate([load_shard(f, vocab_size) for f in split_files(data_dir, "val")])
    stream = torch.from_numpy(val.astype(np.int64))
    n_bytes = int(ByteTable(data_dir / "tokenizer.model").target_bytes(stream[:-1], stream[1:]).sum())
    bits = -np.log2(counts / counts.sum())[val[1:]].sum()
    return dict(unigram_bpb=bits / n_bytes, val_targets=len(val) - 1, val_bytes=n_bytes)


# -----------------------------------------------------------------------------
# CLI

def _base_defaults():
    """--vocab-size and --val-fraction default to configs/base.yaml, where every default lives."""
    path = Path(__file__).resolve().parent / "configs" / "base.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    return cfg.get("model", {}).get("vocab_size"), cfg.get("data", {}).get("val_fraction")


def main(argv=None):
    vocab_size, val_fraction = _base_defaults()
    parser = argparse.ArgumentParser(description="AION data: text -> sentencepiece -> token shards")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into FineWeb-format shards and meta.json")
    p.add_argument("--input", nargs="+", help="files, folders, .jsonl files; omitted: the built-in corpus")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--vocab-size", type=int, default=vocab_size, required=vocab_size is None)
    p.add_argument("--val-fraction", type=float, default=val_fraction, required=val_fraction is None)
    p.add_argument("--tokenizer", help="an existing sentencepiece .model instead of training one")
    u = sub.add_parser("unigram", help="bpb of the val split under the train split's token frequencies")
    u.add_argument("--data", required=True, help="a prepared folder (shards, tokenizer.model)")
    u.add_argument("--vocab-size", type=int, default=vocab_size, required=vocab_size is None)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.command == "unigram":
            meta = unigram_bpb(args.data, args.vocab_size)
        elif args.input:
            meta = prepare(read_documents(args.input), args.out, args.vocab_size, args.val_fraction, args.tokenizer)
        elif args.tokenizer:
            meta = prepare(builtin_documents(), args.out, args.vocab_size, args.val_fraction, args.tokenizer)
        else:
            meta = prepare_builtin(args.out, args.vocab_size, args.val_fraction)
    except DataError as e:
        sys.exit(f"error: {e}")
    summary = {**vars(args), **meta, "seconds": f"{time.perf_counter() - t0:.1f}"}
    print(" ".join(f"{k}:{v}" for k, v in summary.items()))
    return meta


if __name__ == "__main__":
    main()
