"""Data for AION: text corpora -> sentencepiece tokenizer -> FineWeb-format token shards,
plus the loaders train.py reads them with and the per-token byte table behind val_bpb.

A second tokenizer kind is the competition kit's (karpathy/autoresearch's prepare.py): a byte-level
BPE trained with rustbpe and saved as a pickled tiktoken.Encoding (tokenizer.pkl, loaded only by a
restricted unpickler) beside token_bytes.pt. The kit's parquet text (shard_*.parquet, a text
column) is tokenized once into the same shards, and its BOS-aligned best-fit packing is a loader
order ("packed") beside the others, with packed_val_batches for the kit's validation rows.

Shard format (modded-nanogpt / parameter-golf FineWeb shards): a header of 256 little-endian
int32 (magic, version, token count, zeros), then the tokens as little-endian uint16.

    python data.py prepare --input notes/ extra.jsonl --out data/mine      # your text
    python data.py prepare --out data/builtin/sp1024                       # built-in corpus
    python data.py unigram --data data/builtin/sp1024                      # the order-0 bpb floor
    python data.py prepare --tokenizer-kind tiktoken --vocab-size 8192 --out data/builtin/tiktoken8192
    python data.py prepare --parquet ~/climbmix --tokenizer ~/kit/tokenizer --vocab-size 8192
"""
import argparse
import bisect
import hashlib
import io
import json
import os
import pickle
import queue
import random
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
TOKENIZER_KINDS = ("sentencepiece", "tiktoken")

# Facts of the competition kit (autoresearch's prepare.py): its tokenizer's split pattern (GPT-4's,
# with \p{N}{1,2} instead of {1,3}), its 4 special tokens appended after the mergeable ranks, BOS.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = tuple(f"<|reserved_{i}|>" for i in range(4))
BOS_TOKEN = "<|reserved_0|>"
TIKTOKEN_DOC_CHARS = 10_000  # the kit trains its tokenizer on each document's first 10,000 characters
PACK_BUFFER_DOCS = 1000  # documents the packer chooses among (the kit's buffer_size)
PACK_REFILL_DOCS = 128  # the kit tops its buffer up in batches of this many documents
FINGERPRINT_BLOCK = 1 << 20  # bytes of each end of a parquet file its cache's fingerprint reads


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


# -----------------------------------------------------------------------------
# tiktoken tokenizers of the kit's kind: tokenizer.pkl (a pickled tiktoken.Encoding) + token_bytes.pt

# The globals a pickled tiktoken.Encoding names, found by pickling one with every protocol: 3-5
# (the default) name only tiktoken.core.Encoding (its state is a dict of str, bytes and int); 2 adds
# _codecs.encode for the bytes; 0-1 add copyreg._reconstructor and builtins.object to build the
# object. Python 2 spellings (copy_reg, __builtin__) are what the unpickler asks for under 0-2.
PICKLE_GLOBALS = frozenset({("tiktoken.core", "Encoding"), ("_codecs", "encode"), ("copyreg", "_reconstructor"),
                            ("copy_reg", "_reconstructor"), ("builtins", "object"), ("__builtin__", "object")})
_ENCODING_STATE = {"name", "pat_str", "mergeable_ranks", "special_tokens"}
_encoding_classes = []


def _checked_encoding_class():
    """A tiktoken.Encoding subclass whose __setstate__ accepts only the dict of an unregistered
    encoding: tiktoken's own would look a name up in its registry, which may download."""
    if not _encoding_classes:
        import tiktoken

        class PickledEncoding(tiktoken.Encoding):
            def __setstate__(self, value):
                if not isinstance(value, dict) or not _ENCODING_STATE <= set(value):
                    raise pickle.UnpicklingError(
                        f"an Encoding with state {type(value).__name__} "
                        f"{sorted(value) if isinstance(value, dict) else repr(value)[:60]}, expected a dict of "
                        f"{', '.join(sorted(_ENCODING_STATE))} (an encoding pickled by name is not loaded)")
                # tiktoken's own __setstate__ does just this with a dict (other keys: Encoding's other arguments)
                tiktoken.Encoding.__init__(self, **value)

        _encoding_classes.append((tiktoken.Encoding, PickledEncoding))
    return _encoding_classes[0]


class _EncodingUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in PICKLE_GLOBALS:
            raise _RefusedGlobal(f"{module}.{name}")
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _checked_encoding_class()[1]
        return super().find_class(module, name)


class _RefusedGlobal(pickle.UnpicklingError):
    pass


def _tiktoken_folder(path):
    """A tokenizer folder from the folder itself or its tokenizer.pkl."""
    path = Path(path)
    return path.parent if path.name == "tokenizer.pkl" else path


def is_tiktoken(path):
    """Whether a tokenizer path is of the kit's kind (a folder, or its tokenizer.pkl)."""
    path = Path(path)
    return path.is_dir() or path.suffix == ".pkl"


def _unpickle_encoding(pkl):
    encoding, checked = _checked_encoding_class()
    try:
        with open(pkl, "rb") as f:
            enc = _EncodingUnpickler(f).load()
    except _RefusedGlobal as e:
        raise DataError(f"{pkl}: refuses to load {e} (only tiktoken's Encoding and builtins); "
                        f"not a tiktoken tokenizer") from None
    except DataError:
        raise
    except Exception as e:  # a garbled pickle raises nearly anything
        raise DataError(f"{pkl}: not a pickled tiktoken Encoding ({type(e).__name__}: {e})") from None
    if type(enc) is not checked:
        raise DataError(f"{pkl}: holds a {type(enc).__module__}.{type(enc).__qualname__}, "
                        f"expected a pickled tiktoken Encoding; not a tiktoken tokenizer")
    if not vars(enc):  # made (copyreg._reconstructor, NEWOBJ) but never given a state: __setstate__ never ran
        raise DataError(f"{pkl}: an Encoding pickled without its state, expected one with a dict of "
                        f"{', '.join(sorted(_ENCODING_STATE))}; not a tiktoken tokenizer")
    enc.__class__ = encoding  # the plain class again: same layout, re-pickles as tiktoken.core.Encoding
    return enc


def _check_token_bytes(path, n_vocab):
    try:
        table = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(f"{path}: not a tensor file ({type(e).__name__}: {e}), expected the kit's token_bytes.pt") from None
    if not isinstance(table, torch.Tensor) or table.dim() != 1 or table.dtype.is_floating_point \
            or table.dtype.is_complex or table.dtype == torch.bool:
        shape = f"{table.dtype} tensor of shape {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise DataError(f"{path}: a {shape}, expected a 1-D integer tensor of {n_vocab} byte counts")
    if len(table) != n_vocab:
        raise DataError(f"{path}: {len(table)} byte counts, expected {n_vocab} (one per token of tokenizer.pkl)")
    return table


def load_tiktoken(folder, vocab_size=None):
    """The kit's tokenizer from folder (or its tokenizer.pkl): a tiktoken.Encoding, loaded by an
    unpickler that admits tiktoken's Encoding class only, after checking that it has vocab_size
    tokens (None: any) with BOS <|reserved_0|>, and that token_bytes.pt has one count per token."""
    folder = _tiktoken_folder(folder)
    pkl, token_bytes = folder / "tokenizer.pkl", folder / "token_bytes.pt"
    missing = [p.name for p in (pkl, token_bytes) if not p.is_file()]
    if missing:
        raise DataError(f"{folder}: no {' and no '.join(missing)}, expected a tiktoken tokenizer folder "
                        f"(tokenizer.pkl and token_bytes.pt)")
    enc = _unpickle_encoding(pkl)
    if vocab_size is not None and enc.n_vocab != vocab_size:
        raise DataError(f"{pkl}: tokenizer has {enc.n_vocab} tokens, expected vocab_size {vocab_size}")
    if BOS_TOKEN not in enc.special_tokens_set:
        raise DataError(f"{pkl}: no {BOS_TOKEN} special token, expected it as BOS to mark document starts")
    _check_token_bytes(token_bytes, enc.n_vocab)
    return enc


def tiktoken_bos(enc):
    return enc.encode_single_token(BOS_TOKEN)


def _special_ids(enc):
    return {enc.encode_single_token(name) for name in enc.special_tokens_set}


def train_tiktoken(texts, folder, vocab_size):
    """The kit's tokenizer trained on texts (strings; each capped at TIKTOKEN_DOC_CHARS, as the kit
    does): rustbpe byte-level BPE of vocab_size - 4 ranks with SPLIT_PATTERN, the 4 specials after
    them -> folder/tokenizer.pkl (a pickled tiktoken.Encoding) and folder/token_bytes.pt (the kit's
    table: int32 UTF-8 length of each id's decoded string, 0 for the specials), each written
    atomically. Deterministic: the same texts give the same files. Returns the Encoding."""
    import rustbpe
    import tiktoken
    n_ranks = vocab_size - len(SPECIAL_TOKENS)
    if not 256 <= n_ranks or vocab_size > 2**16:
        raise DataError(f"vocab_size {vocab_size}: a byte-level BPE needs 256 byte tokens + {len(SPECIAL_TOKENS)} "
                        f"specials and shards store uint16 tokens, expected {256 + len(SPECIAL_TOKENS)}..65536")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator((text[:TIKTOKEN_DOC_CHARS] for text in texts), n_ranks, pattern=SPLIT_PATTERN)
    ranks = {bytes(piece): rank for piece, rank in bpe.get_mergeable_ranks()}
    if len(ranks) != n_ranks:
        raise DataError(f"{folder}: the training text gave {len(ranks)} BPE ranks, expected {n_ranks} for vocab_size "
                        f"{vocab_size} (too little text for so many merges)")
    enc = tiktoken.Encoding(name="rustbpe", pat_str=bpe.get_pattern(), mergeable_ranks=ranks,
                            special_tokens={name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)})
    specials = _special_ids(enc)
    kit_table = torch.tensor([0 if v in specials else len(enc.decode([v]).encode("utf-8")) for v in range(enc.n_vocab)],
                             dtype=torch.int32)
    tmp = folder / "tokenizer.pkl.tmp"
    tmp.write_bytes(pickle.dumps(enc))
    os.replace(tmp, folder / "tokenizer.pkl")
    tmp = folder / "token_bytes.pt.tmp"
    torch.save(kit_table, tmp)
    os.replace(tmp, folder / "token_bytes.pt")
    return enc


def kit_token_bytes(folder):
    """The kit's byte table (token_bytes.pt) as int64: len(enc.decode([id]).encode()) per id, 0 for
    specials. It differs from ByteTable's exact bytes (len(decode_single_token_bytes(id))) on ids
    whose bytes are not valid UTF-8 alone (parts of a character): decode() replaces each invalid
    piece with U+FFFD (3 bytes). See kit_table_differences."""
    enc = load_tiktoken(folder)
    return _check_token_bytes(_tiktoken_folder(folder) / "token_bytes.pt", enc.n_vocab).to(torch.int64)


def kit_table_differences(folder):
    """-> (ids, kit bytes, exact bytes): the ids where the kit's token_bytes.pt differs from the
    exact bytes ByteTable counts. For a token_bytes.pt made as the kit makes it, these are the ids
    whose bytes are not valid UTF-8 alone and whose U+FFFD replacement has another length (a
    3-byte prefix of a 4-byte character decodes to one U+FFFD: 3 bytes either way)."""
    kit, exact = kit_token_bytes(folder), ByteTable(folder).base_bytes
    ids = torch.nonzero(kit != exact).flatten()
    return ids, kit[ids], exact[ids]


class ByteTable:
    """UTF-8 bytes each target token decodes to, so val_bpb's denominator is computed on the
    device from (x, y) alone: bytes(y[t]) = base_bytes[y] + (has_space[y] & ~is_boundary[x]).

    ByteTable(path) reads a sentencepiece .model file or a tiktoken tokenizer folder (or its
    tokenizer.pkl). tiktoken (byte-level BPE): base_bytes = len(decode_single_token_bytes(id)),
    the id's exact bytes (tokens concatenate to the text's bytes, so a document's targets sum to
    len(text.encode("utf-8")) exactly); specials 0 and boundaries; has_space all False.

    Sentencepiece:

    base_bytes: the piece's bytes ("▁" = one space byte) without a leading "▁" that the decoder
    drops; byte-fallback pieces 1; control/unknown/unused 0. has_space: the piece starts with a
    "▁" the decoder drops at the start of a document, i.e. after a boundary token (BOS).
    Sentencepiece drops it only for models that add a dummy prefix (the FineWeb sp1024 models);
    our tokenizers (no dummy prefix) keep every "▁", so has_space is all False for them."""

    def __init__(self, tokenizer_path):
        if is_tiktoken(tokenizer_path):
            return self._init_tiktoken(tokenizer_path)
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

    def _init_tiktoken(self, path):
        enc = load_tiktoken(path)
        self.vocab_size = n = enc.n_vocab
        self.bos_id = tiktoken_bos(enc)
        specials = _special_ids(enc)
        base, boundary = [], []
        for v in range(n):
            try:
                base.append(0 if v in specials else len(enc.decode_single_token_bytes(v)))
                boundary.append(v in specials)
            except KeyError:  # an id with no token (a gap below n_vocab): decodes to nothing
                base.append(0)
                boundary.append(True)
        self.base_bytes = torch.tensor(base, dtype=torch.int64)
        self.has_space = torch.zeros(n, dtype=torch.bool)
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

def _progress(label, done, total, unit="docs"):
    filled = 30 * done // total
    end = "\n" if done == total else ""
    print(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {unit}", end=end, file=sys.stderr, flush=True)


class _Encoder:
    """One tokenizer of either kind: bos, encode(texts) -> id lists (no BOS), n_bytes(ids)."""

    def __init__(self, kind, path, vocab_size=None):
        self.kind = kind
        if kind == "tiktoken":
            self.enc = load_tiktoken(path, vocab_size)
            self.bos = tiktoken_bos(self.enc)
        else:
            self.sp = _load_tokenizer(path, vocab_size)
            self.bos = self.sp.bos_id()

    def encode(self, texts):
        if self.kind == "tiktoken":
            return self.enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
        return self.sp.encode(texts, num_threads=os.cpu_count())

    def n_bytes(self, ids):
        """Bytes the tokens decode to."""
        if self.kind == "tiktoken":
            return len(self.enc.decode_bytes(ids))
        return len(self.sp.decode(ids).encode())


class _ShardWriter:
    """Documents (BOS + ids) -> out_dir/fineweb_<split>_NNNNNN.bin, SHARD_TOKENS tokens a shard."""

    def __init__(self, out_dir, split, bos, keep=False):
        self.out_dir, self.split, self.bos, self.keep = Path(out_dir), split, bos, keep
        self.buf, self.n_buf, self.n_total, self.n_docs, self.n_shards, self.kept = [], 0, 0, 0, 0, []

    def add(self, docs_ids):
        for ids in docs_ids:
            tokens = np.array([self.bos, *ids], dtype=np.uint16)
            self.buf.append(tokens)
            self.n_buf += len(tokens)
            self.n_total += len(tokens)
            self.n_docs += 1
            if self.keep:
                self.kept.append(tokens)
        if self.n_buf >= SHARD_TOKENS:
            self._flush(final=False)

    def _flush(self, final):
        flat = np.concatenate(self.buf) if self.buf else np.zeros(0, np.uint16)
        while len(flat) >= SHARD_TOKENS or (final and len(flat)):
            write_shard(self.out_dir / f"fineweb_{self.split}_{self.n_shards:06d}.bin", flat[:SHARD_TOKENS])
            flat, self.n_shards = flat[SHARD_TOKENS:], self.n_shards + 1
        self.buf, self.n_buf = [flat], len(flat)

    def close(self):
        self._flush(final=True)
        return self.n_total


def _encode_split(encoder, docs, out_dir, split, progress, keep=False):
    """Tokenizes docs (BOS before each) into out_dir's shards of the split; returns the token
    count and, with keep, each document's tokens."""
    writer, step = _ShardWriter(out_dir, split, encoder.bos, keep), 64
    for i in range(0, len(docs), step):
        writer.add(encoder.encode([text for _, text in docs[i:i + step]]))
        if progress:
            _progress(f"tokenize {split}", min(i + step, len(docs)), len(docs))
    return writer.close(), writer.kept


def _load_tokenizer(path, vocab_size):
    if not Path(path).is_file():
        raise DataError(f"{path}: no such tokenizer file, expected a sentencepiece .model")
    sp = sentencepiece_model(path)
    if vocab_size is not None and sp.vocab_size() != vocab_size:
        raise DataError(f"{path}: tokenizer has {sp.vocab_size()} tokens, expected vocab_size {vocab_size}")
    if sp.bos_id() < 0:
        raise DataError(f"{path}: tokenizer has no BOS token, expected one to mark document starts")
    return sp


def _check_kind(kind):
    if kind not in TOKENIZER_KINDS:
        raise DataError(f"tokenizer kind {kind!r}, expected one of {', '.join(TOKENIZER_KINDS)}")


def _copy_tiktoken(source, folder):
    """Copies a tokenizer folder's tokenizer.pkl and token_bytes.pt into folder (atomically)."""
    source = _tiktoken_folder(source)
    if source.resolve() == Path(folder).resolve():
        return
    for name in ("tokenizer.pkl", "token_bytes.pt"):
        tmp = Path(folder) / f"{name}.tmp"
        shutil.copyfile(source / name, tmp)
        os.replace(tmp, Path(folder) / name)


def _tokenizer_path(out_dir, kind):
    """Where a prepared folder keeps its tokenizer: tokenizer.model, or the folder itself (tiktoken)."""
    out_dir = Path(out_dir).resolve()
    return str(out_dir if kind == "tiktoken" else out_dir / "tokenizer.model")


class _Lock:
    """An exclusive lock on folder/.lock while a folder is prepared: the ranks of a run all call
    open_data; the first prepares, the others wait and then find the folder complete."""

    def __init__(self, folder):
        self.path = Path(folder) / ".lock"

    def __enter__(self):
        import fcntl
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.file = open(self.path, "a")
        except OSError:  # a read-only folder: nobody can be preparing it
            self.file = None
            return self
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.file:
            self.file.close()  # releases the lock


def _read_meta(path):
    """A prepared folder's meta.json, or {} where it is missing or unreadable (damaged: prepared again)."""
    try:
        meta = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def prepare(documents, out_dir, vocab_size, val_fraction, tokenizer=None, progress=True, kind="sentencepiece"):
    """Documents (name, text) -> out_dir/{tokenizer, fineweb_{train,val}_NNNNNN.bin, meta.json}.
    The tokenizer (trained on the train split unless tokenizer names one to copy) is kind
    "sentencepiece" (tokenizer.model) or "tiktoken" (the kit's kind: tokenizer.pkl, token_bytes.pt).
    Returns the meta dict."""
    out_dir = Path(out_dir)
    _check_kind(kind)
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

    if tokenizer is not None:  # fail before touching out_dir
        load_tiktoken(tokenizer, vocab_size) if kind == "tiktoken" else _load_tokenizer(tokenizer, vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [out_dir / "meta.json", *out_dir.glob("fineweb_*_*.bin")]:  # never mix with an older run
        stale.unlink(missing_ok=True)
    model = Path(_tokenizer_path(out_dir, kind))
    if tokenizer is None:
        if progress:
            print(f"training tokenizer: {kind} bpe vocab_size {vocab_size} on {len(train)} documents", file=sys.stderr)
        if kind == "tiktoken":
            train_tiktoken([text for _, text in train], out_dir, vocab_size)
        else:
            train_tokenizer([text for _, text in train], model, vocab_size)
    elif kind == "tiktoken":
        _copy_tiktoken(tokenizer, out_dir)
    elif Path(tokenizer).resolve() != model.resolve():
        shutil.copyfile(tokenizer, model)  # the data folder carries its own tokenizer
    encoder = _Encoder(kind, model, vocab_size)

    train_tokens, _ = _encode_split(encoder, train, out_dir, "train", progress)
    val_tokens, val_docs = _encode_split(encoder, val, out_dir, "val", progress, keep=True)
    table = ByteTable(model)
    stream = torch.from_numpy(np.concatenate(val_docs).astype(np.int64))
    val_bytes = int(table.target_bytes(stream[:-1], stream[1:]).sum())  # stream[0] is BOS: 0 bytes
    decoded_bytes = sum(encoder.n_bytes(d[1:].tolist()) for d in val_docs)
    if val_bytes != decoded_bytes:
        raise DataError(f"{tokenizer or model}: byte table counts {val_bytes} val bytes but the tokenizer decodes "
                        f"{decoded_bytes}; expected equal (unsupported piece types?)")
    meta = dict(tokenizer=str(model.resolve()), vocab_size=vocab_size, train_tokens=train_tokens,
                val_tokens=val_tokens, val_bytes=val_bytes, corpus_sha256=corpus_sha256(documents),
                val_fraction=val_fraction, n_train_docs=len(train), n_val_docs=len(val),
                prepare_version=PREPARE_VERSION, tokenizer_kind=kind)
    tmp = out_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / "meta.json")  # written last: its presence means the folder is complete
    return meta


def prepare_builtin(out_dir, vocab_size, val_fraction, progress=True, kind="sentencepiece"):
    """prepare() on the built-in corpus, skipped when out_dir already holds it (of the same kind)."""
    _check_kind(kind)
    documents = builtin_documents()
    meta_path = Path(out_dir) / "meta.json"
    with _Lock(out_dir):
        meta = _read_meta(meta_path)
        if (meta.get("corpus_sha256"), meta.get("vocab_size"), meta.get("val_fraction"), meta.get("prepare_version"),
                meta.get("tokenizer_kind", "sentencepiece")) == (
                corpus_sha256(documents), vocab_size, val_fraction, PREPARE_VERSION, kind):
            return {**meta, "tokenizer": _tokenizer_path(out_dir, kind)}  # folder may have moved
        return prepare(documents, out_dir, vocab_size, val_fraction, progress=progress, kind=kind)


# -----------------------------------------------------------------------------
# the kit's parquet text: shard_*.parquet with a text column, the last (or a named) one for val

def parquet_files(folder, val_shard=""):
    """-> (train files in name order, val file) of a folder of the kit's shard_*.parquet files."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder, expected one holding the kit's shard_*.parquet files")
    files = sorted(folder.glob("shard_*.parquet"))
    if not files:
        raise DataError(f"{folder}: no shard_*.parquet files, expected the kit's parquet shards (a text column each)")
    if len(files) < 2:
        raise DataError(f"{folder}: 1 shard_*.parquet file ({files[0].name}), expected at least 2: "
                        f"one for train and one for val")
    val = files[-1]
    if val_shard:
        val = folder / val_shard
        if val not in files:
            raise DataError(f"data.val_shard={val_shard}: no such shard_*.parquet file in {folder}, expected one of "
                            f"its {len(files)} shards ({files[0].name} .. {files[-1].name})")
    return [f for f in files if f != val], val


def _open_parquet(path):
    """A ParquetFile after checking that it has a string text column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: not a parquet file ({e}), expected the kit's parquet shard") from None
    schema = pf.schema_arrow
    if "text" not in schema.names:
        raise DataError(f"{path}: no text column (columns: {', '.join(schema.names) or 'none'}), "
                        f"expected a string column named text")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda t: False)(kind)):
        raise DataError(f"{path}: text column of type {kind}, expected strings")
    return pf


def _parquet_texts(pf, path, rg):
    column = pf.read_row_group(rg, columns=["text"]).column("text")
    texts = column.to_pylist()
    if column.null_count:
        row = sum(pf.metadata.row_group(i).num_rows for i in range(rg)) + texts.index(None)
        raise DataError(f"{path}: row {row} has no text (null), expected a string in every row")
    return texts


def _parquet_ends(path, size):
    """A parquet file's first FINGERPRINT_BLOCK bytes and its last ones, or its whole footer where
    that is longer (the footer: every row group's row count, offsets, sizes and statistics)."""
    with open(path, "rb") as f:
        head = f.read(FINGERPRINT_BLOCK)
        f.seek(max(size - 8, 0))
        trailer = f.read()  # the footer's length (4 bytes, little-endian) and PAR1
        footer = int.from_bytes(trailer[:4], "little") + 8 if trailer[4:] == b"PAR1" else 0
        f.seek(max(size - max(footer, FINGERPRINT_BLOCK), 0))
        return head + f.read()


def parquet_fingerprint(files, val, tokenizer):
    """sha256 prefix over each parquet file's name, size, mtime and ends (_parquet_ends), the val
    shard's name, the tokenizer's bytes and PREPARE_VERSION: the tokenized cache is reused while it
    is unchanged. A few MiB read a file, not all of it: an edit that keeps a file's size, its ends and
    footer byte for byte (every page's compressed size, the row groups' statistics) and its mtime
    goes unseen."""
    folder = _tiktoken_folder(tokenizer)
    h = hashlib.sha256(f"aion-parquet:v{PREPARE_VERSION}\0".encode())
    for f in sorted(files):
        st = Path(f).stat()
        h.update(f"{Path(f).name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
        h.update(hashlib.sha256(_parquet_ends(f, st.st_size)).digest())
    h.update(f"val:{Path(val).name}\0".encode())
    for name in ("tokenizer.pkl", "token_bytes.pt"):
        h.update((folder / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def prepare_parquet(path, tokenizer, vocab_size, val_shard="", out_dir=None, progress=True):
    """The kit's parquet text (path/shard_*.parquet, a string text column; val: the last shard by
    name, or val_shard) tokenized with its tiktoken tokenizer (folder with tokenizer.pkl and
    token_bytes.pt) into AION's shards: BOS before each document, documents in file and row order.
    The shards land in out_dir, default path/aion_tokens/<fingerprint>/, with a copy of the
    tokenizer and meta.json (written last); a folder whose meta.json has the same fingerprint is
    reused as it is. Returns the meta dict (its "folder": where the shards are)."""
    train_files, val = parquet_files(path, val_shard)
    encoder = _Encoder("tiktoken", tokenizer, vocab_size)
    fingerprint = parquet_fingerprint([*train_files, val], val, tokenizer)
    out_dir = Path(out_dir) if out_dir else Path(path) / "aion_tokens" / fingerprint
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{out_dir}: cannot create the tokenized cache ({e.strerror}); expected a writable folder "
                        f"beside the parquet data") from None
    meta_path = out_dir / "meta.json"
    with _Lock(out_dir):
        meta = _read_meta(meta_path)
        if meta.get("fingerprint") == fingerprint:
            return {**meta, "tokenizer": _tokenizer_path(out_dir, "tiktoken"), "folder": str(out_dir.resolve())}
        opened = {f: _open_parquet(f) for f in [*train_files, val]}  # every file checked before any work
        if not opened[val].metadata.num_rows:
            raise DataError(f"{val}: the validation shard has 0 rows; expected the validation text (a row per document)")
        if not sum(opened[f].metadata.num_rows for f in train_files):
            raise DataError(f"{path}: the {len(train_files)} training shards ({train_files[0].name} .. "
                            f"{train_files[-1].name}) have 0 rows; expected the training text (a row per document)")
        for stale in [meta_path, *out_dir.glob("fineweb_*_*.bin")]:
            stale.unlink(missing_ok=True)
        _copy_tiktoken(tokenizer, out_dir)
        table = ByteTable(out_dir).base_bytes.numpy()
        counts = {}
        for split, files in (("train", train_files), ("val", [val])):
            writer, text_bytes, token_bytes = _ShardWriter(out_dir, split, encoder.bos), 0, 0
            for f in files:
                pf = opened[f]
                for rg in range(pf.num_row_groups):
                    texts = _parquet_texts(pf, f, rg)
                    docs = encoder.encode(texts)
                    writer.add(docs)
                    if split == "val":
                        text_bytes += sum(len(text.encode("utf-8")) for text in texts)
                        token_bytes += sum(int(table[np.asarray(ids, dtype=np.int64)].sum()) for ids in docs)
                    if progress:
                        _progress(f"tokenize {split} {f.name}", rg + 1, pf.num_row_groups, "row groups")
            counts[split] = writer.close(), writer.n_docs
            if split == "val" and not text_bytes:
                raise DataError(f"{val}: the validation shard's {writer.n_docs} rows hold no text (0 bytes); expected "
                                f"the validation text")
            if split == "val" and text_bytes != token_bytes:
                raise DataError(f"{val}: the byte table counts {token_bytes} val bytes but the text has {text_bytes}; "
                                f"expected equal")
        meta = dict(tokenizer=_tokenizer_path(out_dir, "tiktoken"), vocab_size=vocab_size, train_tokens=counts["train"][0],
                    val_tokens=counts["val"][0], val_bytes=token_bytes, fingerprint=fingerprint, source="parquet",
                    parquet=str(Path(path).resolve()), train_files=[f.name for f in train_files], val_shard=val.name,
                    n_train_docs=counts["train"][1], n_val_docs=counts["val"][1], prepare_version=PREPARE_VERSION,
                    tokenizer_kind="tiktoken")
        tmp = out_dir / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, meta_path)  # written last: its presence means the folder is complete
    return {**meta, "folder": str(out_dir.resolve())}


def open_data(source, path, tokenizer, vocab_size, val_fraction, kind="sentencepiece", val_shard=""):
    """A run's data (keys data.*) -> (train files, val files, tokenizer path, corpus fingerprint):
    - builtin: the built-in corpus, prepared on first use in path/sp<vocab_size> (kind sentencepiece)
      or path/tiktoken<vocab_size> (kind tiktoken: the tokenizer path is that folder);
    - parquet: the kit's shard_*.parquet text in path (val: the last shard, or val_shard) with the
      tiktoken tokenizer folder `tokenizer`, tokenized on first use into path/aion_tokens/<fingerprint>/;
    - shards: fineweb_{train,val}_*.bin in path as they are, with `tokenizer` (a sentencepiece
      .model, or a tiktoken folder for kind tiktoken)."""
    _check_kind(kind)
    if source == "builtin":
        root = Path(path) / f"{'tiktoken' if kind == 'tiktoken' else 'sp'}{vocab_size}"
        meta = prepare_builtin(root, vocab_size, val_fraction, kind=kind)
        tokenizer, fingerprint = meta["tokenizer"], f"{meta['corpus_sha256'][:12]}-v{meta['prepare_version']}"
        if kind == "tiktoken":
            fingerprint += "-tiktoken"
    elif source == "parquet":
        if not tokenizer:
            raise DataError("data.source=parquet needs data.tokenizer: the kit's tokenizer folder "
                            "(tokenizer.pkl, token_bytes.pt)")
        meta = prepare_parquet(path, tokenizer, vocab_size, val_shard)
        root, tokenizer, fingerprint = Path(meta["folder"]), meta["tokenizer"], meta["fingerprint"]
    else:
        root = Path(path)
        if kind == "tiktoken":
            load_tiktoken(tokenizer, vocab_size)
        elif not Path(tokenizer).is_file():
            raise DataError(f"data.tokenizer={tokenizer}: no such file, expected the shards' sentencepiece .model")
    train_files, val_files = split_files(root, "train"), split_files(root, "val")
    if not train_files or not val_files:
        raise DataError(f"{root}: expected fineweb_train_*.bin and fineweb_val_*.bin shards, found "
                        f"{len(train_files)} train and {len(val_files)} val")
    if source not in ("builtin", "parquet"):  # hashing gigabytes of shards would delay every run: names, sizes, tokenizer
        if kind == "tiktoken":
            folder = _tiktoken_folder(tokenizer)
            h = hashlib.sha256((folder / "tokenizer.pkl").read_bytes() + (folder / "token_bytes.pt").read_bytes())
        else:
            h = hashlib.sha256(Path(tokenizer).read_bytes())
        for f in train_files + val_files:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        fingerprint = h.hexdigest()[:12]
    return train_files, val_files, tokenizer, fingerprint


# -----------------------------------------------------------------------------
# loaders

class _Documents:
    """The BOS-delimited documents of shards' concatenated token stream: document i is
    stream[starts[i]:starts[i] + lengths[i]], from one BOS to the next (or the stream's end); a
    document may continue into the next shard. Tokens before the first BOS belong to none."""

    def __init__(self, files, shards, bos_id):
        self.shards = shards
        self.offsets = np.cumsum([0, *map(len, shards)]).tolist()
        starts = [np.flatnonzero(np.asarray(s) == bos_id) + off for s, off in zip(shards, self.offsets)]
        self.starts = np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, np.int64)
        if not len(self.starts):
            raise DataError(f"{', '.join(map(str, files))}: no BOS token (id {bos_id}) in {self.offsets[-1]} tokens, "
                            f"expected documents that each start with BOS")
        self.lengths = np.diff(np.append(self.starts, self.offsets[-1]))
        self.n = len(self.starts)

    def read(self, start, n, out):
        """Copies stream[start:start + n] into out."""
        shard = bisect.bisect_right(self.offsets, start) - 1
        done = 0
        while done < n:
            a = start + done - self.offsets[shard]
            take = min(n - done, len(self.shards[shard]) - a)
            out[done:done + take] = self.shards[shard][a:a + take]
            done, shard = done + take, shard + 1


_DOCUMENT_TABLES = {}  # (files' paths, sizes, mtimes, BOS id) -> _Documents, shared by a run's loaders


def _documents(files, shards, bos_id):
    key = (tuple((str(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files), bos_id)
    if key not in _DOCUMENT_TABLES:
        if len(_DOCUMENT_TABLES) >= 4:
            _DOCUMENT_TABLES.clear()
        _DOCUMENT_TABLES[key] = _Documents(files, shards, bos_id)
    return _DOCUMENT_TABLES[key]


class _Packer:
    """The kit's BOS-aligned best-fit packing over a document stream (autoresearch's
    make_dataloader): each row of row_len tokens is filled from a buffer of at least
    PACK_BUFFER_DOCS documents (topped up before every placement, PACK_REFILL_DOCS at a time,
    from the stream in order, which repeats in epochs) with the largest document that fits the
    rest of the row entirely (the earliest added among equals); when none fits, the shortest (the
    earliest among equals) is cropped to fill the row and the rest of it is discarded. No padding.

    The buffer is a list of (length, seq, document) kept sorted, so both choices are a bisect.
    Its state is plain ints: {"epoch", "doc" (next document of the stream), "buffer" (documents
    in the order they were added), "docs" (the stream's document count, to refuse a state of
    other data)}; seq numbers are renumbered from the buffer's order, which keeps every choice."""

    def __init__(self, docs, state):
        self.docs = docs
        n = docs.n
        if state.get("docs", n) != n:
            raise DataError(f"loader state is of a stream of {state['docs']} documents, these shards hold {n}")
        buffer = [int(d) for d in state["buffer"]]
        if not 0 <= state["doc"] < n or any(not 0 <= d < n for d in buffer):
            raise DataError(f"loader state names document {max([state['doc'], *buffer])}, expected < the {n} "
                            f"documents of these shards")
        self.epoch, self.next_doc, self.seq = int(state["epoch"]), int(state["doc"]), len(buffer)
        self.keys = sorted((int(docs.lengths[d]), i, d) for i, d in enumerate(buffer))

    def state(self):
        return dict(epoch=self.epoch, doc=self.next_doc, docs=self.docs.n,
                    buffer=[d for _, _, d in sorted(self.keys, key=lambda k: k[1])])

    def _refill(self):
        lengths, n = self.docs.lengths, self.docs.n
        while len(self.keys) < PACK_BUFFER_DOCS:
            stop = min(self.next_doc + PACK_REFILL_DOCS, n)  # a refill never crosses the epoch's end
            for d, length in zip(range(self.next_doc, stop), lengths[self.next_doc:stop].tolist()):
                bisect.insort(self.keys, (length, self.seq, d))
                self.seq += 1
            self.next_doc = stop
            if stop == n:
                self.epoch, self.next_doc = self.epoch + 1, 0

    def rows(self, n_rows, row_len, mine=None):
        """The next n_rows rows; returns those in range(*mine) (all: mine None) as uint16
        [len, row_len]. The others are packed (the same choices) but not read."""
        lo, hi = mine or (0, n_rows)
        out = np.empty((hi - lo, row_len), dtype=np.uint16)
        keys, starts, inf = self.keys, self.docs.starts, float("inf")
        for r in range(n_rows):
            row = out[r - lo] if lo <= r < hi else None
            pos = 0
            while pos < row_len:
                if len(keys) < PACK_BUFFER_DOCS:
                    self._refill()
                remaining = row_len - pos
                i = bisect.bisect_right(keys, (remaining, inf))
                if i:  # the largest that fits, the earliest added of that length
                    length, _, d = keys.pop(bisect.bisect_left(keys, (keys[i - 1][0],)))
                else:  # none fits: the shortest, cropped
                    (_, _, d), length = keys.pop(0), remaining
                if row is not None:
                    self.docs.read(int(starts[d]), length, row[pos:pos + length])
                pos += length
        return out


def packed_val_batches(files, seq_len, batch_size, vocab_size, bos_id, max_tokens, rank=0, world_size=1):
    """The kit's validation rows: (x, y) int64 [batch_size, seq_len] from rows of seq_len + 1
    tokens packed as the "packed" loader packs them (_Packer) from the validation split's
    documents in stream order, the stream repeating in epochs when max_tokens needs more than one
    pass (as the kit's endless val loader does). The world takes max_tokens // (batch_size *
    seq_len) batches in all; batch i goes to rank i % world_size (the others' rows are packed
    but not read), so the ranks' batches are disjoint and together the 1-rank sequence."""
    if bos_id is None or bos_id < 0:
        raise DataError("packed validation rows need a tokenizer with a BOS token")
    steps = max_tokens // (batch_size * seq_len)
    if steps == 0:
        raise DataError(f"eval max_tokens {max_tokens}: expected at least one batch of batch_size {batch_size} x "
                        f"seq_len {seq_len} = {batch_size * seq_len} tokens")
    shards = [load_shard(f, vocab_size) for f in files]
    packer = _Packer(_documents(files, shards, bos_id), dict(epoch=0, doc=0, buffer=[]))
    for i in range(steps):
        mine = i % world_size == rank
        rows = packer.rows(batch_size, seq_len + 1, None if mine else (0, 0))
        if mine:
            buf = torch.from_numpy(rows.astype(np.int64))
            yield buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class _RowPool:
    """The competition lineage's row pool (FrontierForge K82s4, recipes/K82s4/train.py,
    make_stream_dataloader with FF_ROW_SHUFFLE=256 and FF_ROW_SHUFFLE_FROM=96; github
    marker2601/trainium-simulator) over one rank's stream of micro-batches. The first `start`
    micro-batches pass in stream order. From then on each micro-batch's rows (its sequences of
    seq_len + 1 tokens) are drawn one by one, uniformly without replacement, from a buffer that is
    topped up from the stream to (size + 1) micro-batches of rows before each draw, so the rows of
    `size` stay after it: one micro-batch in, one out, never flushed. A draw swaps a uniformly
    chosen row with the last one and pops it. A row stays size + 1 draws on average
    (geometrically), so the rows of one document or stretch of text spread over that many
    micro-batches instead of sharing one. Measured (the lineage's docs/FINDINGS.md): -0.0023 bpb on
    chip, -0.0022 officially (K70a 0.9625 vs K63 0.9647) for 256 on its 8-row micro-batches; a
    pool of 1024 did as well, one of 64 less.

    The random numbers are a random.Random of its own, seeded as the lineage seeds it from the
    run's seed and the rank (seed * 7919 + rank + 7777 * 4, its shuffle salt 4): each rank has
    its own pool of its own rows. The state is the loader's: the stream's position after the last
    micro-batch read into the buffer, and `pool`: the buffer's rows in order (int32 tensors, a
    few MB at CPU scale), the generator's state (plain ints) and the micro-batches emitted, so a
    loader resumes to the bit without replaying the stream."""

    def __init__(self, size, start, seed, rank, state):
        pool = state.get("pool") or dict(rows=[], rng=None, emitted=0)
        self.size, self.start, self.emitted = size, start, int(pool["emitted"])
        self.stream = {k: v for k, v in state.items() if k != "pool"}
        self.rows = list(pool["rows"])
        self.rng = random.Random(seed * 7919 + rank + 7777 * 4)
        if pool["rng"] is not None:
            version, internal, gauss = pool["rng"]
            self.rng.setstate((version, tuple(internal), gauss))

    def state(self):
        """The position after the micro-batch just returned; the list is a copy (rows are never changed)."""
        return dict(self.stream, pool=dict(rows=list(self.rows), rng=self.rng.getstate(), emitted=self.emitted))

    def next(self, read, batch_size):
        """The next micro-batch (x, y, state); read() returns the stream's next (x, y, stream state)."""
        self.emitted += 1
        if self.emitted <= self.start:
            x, y, self.stream = read()
            return x, y, self.state()
        while len(self.rows) < (self.size + 1) * batch_size:
            x, y, self.stream = read()
            self.rows += [row.clone() for row in torch.cat([x, y[:, -1:]], 1).int()]  # one storage each
        drawn = []
        for _ in range(batch_size):
            j = self.rng.randrange(len(self.rows))
            self.rows[j], self.rows[-1] = self.rows[-1], self.rows[j]
            drawn.append(self.rows.pop())
        rows = torch.stack(drawn).long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), self.state()


ORDERS = ("contiguous", "shuffle", "packed", "replay")


class TrainLoader:
    """Training batches from memory-mapped shards, in one of three orders (`order`):

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
    - packed (the competition kit's loader, autoresearch's make_dataloader): documents are the
      BOS-delimited spans of the shards' stream (each starts with BOS; needs bos_id). Rows of
      seq_len + 1 tokens are packed best-fit from a buffer of PACK_BUFFER_DOCS documents (the
      largest that fits entirely, else the shortest cropped to fill the row; no padding; see
      _Packer); x = row[:-1], y = row[1:], so every row starts with BOS. Each step the world
      packs world_size * batch_size rows in one deterministic sequence and rank r takes rows
      [r * batch_size, (r + 1) * batch_size), so the global batch does not depend on world_size.
      The documents come in stream order, repeating in epochs, the same for every seed (the
      kit's order: the shards' order is the corpus's own). The position (`state_dict`) is the
      packer's: the stream position, its epoch and the buffer's documents as plain ints, so a
      loader resumes exactly, and one of another batch shape carries on with the same buffer.
    - replay: the one file's rows of seq_len + 1 tokens, back to back, in order (rows another program
      trained on, recorded): each step the world takes the next world_size * batch_size of them and rank
      r the r-th batch_size. A step that does not fit in the rows left starts again at the first (epoch
      + 1), as the stream orders do: the trainer reads a step ahead of the one it trains, so the recording
      must hold only the rows trained on; a run whose epoch passes 0 trained past the recording.

    Either way ranks are disjoint; for contiguous and shuffle the position (`state_dict`) counts
    tokens, so a loader with another batch shape (an annealing stage) carries on from the same
    place in the epoch. A background thread reads `prefetch` batches ahead (0: read in next_batch).

    row_pool > 0 (data.row_pool, for the ordered streams contiguous and packed) draws each
    micro-batch's rows at random from a pool of row_pool micro-batches' rows of this rank's
    stream, after the first row_pool_from micro-batches in stream order (_RowPool); the pool is
    part of the position. 0: the batches and positions are exactly those of the stream."""

    def __init__(self, files, batch_size, seq_len, vocab_size, rank=0, world_size=1, prefetch=2,
                 order="contiguous", seed=0, bos_id=None, row_pool=0, row_pool_from=0):
        if not files:
            raise DataError("TrainLoader: no shard files given, expected fineweb_train_*.bin paths")
        if order not in ORDERS:
            raise DataError(f"TrainLoader: order {order!r}, expected one of {', '.join(ORDERS)}")
        self.files = [str(f) for f in files]
        self.shards = [load_shard(f, vocab_size) for f in self.files]
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.order, self.seed, self.prefetch, self.wait_s = order, seed, prefetch, 0.0
        self.row_pool, self.row_pool_from, self._pool = row_pool, row_pool_from, None
        self._windows = None  # shuffle: (epoch, shard of each window, start of each window) in visiting order
        self._docs = None  # packed: the stream's documents
        if order == "packed":
            if bos_id is None or bos_id < 0:
                raise DataError("data.order=packed needs a tokenizer with a BOS token")
            if bos_id >= vocab_size:
                raise DataError(f"TrainLoader: bos_id {bos_id}, expected < vocab_size {vocab_size}")
            self._docs = _documents(self.files, self.shards, bos_id)
        elif order == "replay":
            if len(self.files) != 1 or len(self.shards[0]) % (seq_len + 1):
                raise DataError(f"{', '.join(self.files)}: {sum(map(len, self.shards))} tokens in {len(self.files)} "
                                f"file(s); expected one file of rows of seq_len + 1 = {seq_len + 1} tokens (data.replay)")
        elif order == "contiguous":
            step_tokens = world_size * batch_size * seq_len + 1
            for f, shard in zip(self.files, self.shards):
                if len(shard) < step_tokens:
                    raise DataError(f"{f}: {len(shard)} tokens, expected at least {step_tokens} "
                                    f"(world_size {world_size} x batch_size {batch_size} x seq_len {seq_len} + 1)")
        elif (fewest := sum((len(s) - seq_len) // seq_len for s in self.shards)) < world_size * batch_size:
            raise DataError(f"{', '.join(self.files)}: {fewest} windows of seq_len {seq_len} + 1 tokens, expected at "
                            f"least world_size {world_size} x batch_size {batch_size} for one step")
        self._thread = None
        self.load_state_dict({"epoch": 0, "doc": 0, "buffer": [], "order": order} if order == "packed" else
                             {"shard": 0, "pos": 0, "epoch": 0, "order": order})

    @property
    def epoch(self):
        return self._state["epoch"]

    def _read(self):
        """The batch at the read cursor; returns it with the cursor after it."""
        if self._pool is not None:
            return self._pool.next(self._read_stream, self.batch_size)
        return self._read_stream()

    def _read_stream(self):
        if self.order == "packed":
            return self._read_packed()
        if self.order == "replay":
            return self._read_replay()
        return self._read_shuffled() if self.order == "shuffle" else self._read_contiguous()

    def _read_packed(self):
        b = self.batch_size
        rows = self._cursor.rows(self.world_size * b, self.seq_len + 1, (self.rank * b, (self.rank + 1) * b))
        buf = torch.from_numpy(rows.astype(np.int64))
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous(), self._cursor.state()

    def _read_replay(self):
        _, pos, epoch = self._cursor
        row, rows = self.seq_len + 1, self.world_size * self.batch_size
        if pos + rows * row > len(self.shards[0]):
            pos, epoch = 0, epoch + 1
        start = pos + self.rank * self.batch_size * row
        buf = torch.from_numpy(self.shards[0][start:start + self.batch_size * row].astype(np.int64)).view(-1, row)
        self._cursor = (0, pos + rows * row, epoch)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous(), dict(shard=0, pos=self._cursor[1], epoch=epoch)

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
        """Position of the next batch next_batch returns (not of the read-ahead): in tokens, or
        for packed the packer's state (plain ints and lists: a weights_only checkpoint holds it);
        with a row pool also `pool`, its rows (tensors), generator state and count (_RowPool)."""
        return dict(self._state, order=self.order)

    def load_state_dict(self, state):
        order = state.get("order", "contiguous")  # checkpoints from before data.order were contiguous
        if order != self.order:  # a position means something else in the other order
            raise DataError(f"loader state is of data.order {order!r}, this loader reads {self.order!r}")
        state = {k: v for k, v in state.items() if k != "order"}
        rows = (state.get("pool") or {}).get("rows", [])
        if rows and not self.row_pool:  # the stream's position is past them: they would be lost
            raise DataError(f"loader state holds {len(rows)} rows in its row pool, this loader has none "
                            f"(data.row_pool=0); expected data.row_pool > 0")
        if (length := next((len(r) for r in rows if len(r) != self.seq_len + 1), None)) is not None:
            raise DataError(f"loader state's row pool holds rows of {length} tokens, this loader reads rows of "
                            f"seq_len + 1 = {self.seq_len + 1}")
        if not self.row_pool:
            state.pop("pool", None)
        if order == "packed":
            _Packer(self._docs, state)  # checks it before the read-ahead thread starts
        elif not 0 <= state["shard"] < len(self.shards):
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
        if self.order == "packed":  # the packer is the cursor, rebuilt from the returned batches' state
            self._cursor = _Packer(self._docs, self._state)
        else:
            self._cursor = (self._state["shard"], self._state["pos"], self._state["epoch"])
        if self.row_pool:
            self._pool = _RowPool(self.row_pool, self.row_pool_from, self.seed, self.rank, self._state)


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
    train_files, val_files = split_files(data_dir, "train"), split_files(data_dir, "val")
    if not train_files or not val_files:
        raise DataError(f"{data_dir}: {len(train_files)} train and {len(val_files)} val shards; expected "
                        f"fineweb_train_*.bin and fineweb_val_*.bin (a prepared folder)")
    counts = np.ones(vocab_size, dtype=np.float64)
    for f in train_files:
        counts += np.bincount(load_shard(f, vocab_size), minlength=vocab_size)
    val = np.concatenate([load_shard(f, vocab_size) for f in val_files])
    stream = torch.from_numpy(val.astype(np.int64))
    tokenizer = data_dir if (data_dir / "tokenizer.pkl").exists() else data_dir / "tokenizer.model"
    n_bytes = int(ByteTable(tokenizer).target_bytes(stream[:-1], stream[1:]).sum())
    bits = -np.log2(counts / counts.sum())[val[1:]].sum()
    return dict(unigram_bpb=bits / n_bytes, val_targets=len(val) - 1, val_bytes=n_bytes)


# -----------------------------------------------------------------------------
# CLI

def _base_defaults():
    """--vocab-size, --val-fraction and --tokenizer-kind default to configs/base.yaml, where every default lives."""
    path = Path(__file__).resolve().parent / "configs" / "base.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    return (cfg.get("model", {}).get("vocab_size"), cfg.get("data", {}).get("val_fraction"),
            cfg.get("data", {}).get("tokenizer_kind"))


def main(argv=None):
    vocab_size, val_fraction, kind = _base_defaults()
    parser = argparse.ArgumentParser(description="AION data: text -> tokenizer (sentencepiece or tiktoken) -> token shards")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into FineWeb-format shards and meta.json")
    p.add_argument("--input", nargs="+", help="files, folders, .jsonl files; omitted: the built-in corpus")
    p.add_argument("--out", help="output folder (with --parquet: default <parquet>/aion_tokens/<fingerprint>)")
    p.add_argument("--vocab-size", type=int, default=vocab_size, required=vocab_size is None)
    p.add_argument("--val-fraction", type=float, default=val_fraction, required=val_fraction is None)
    p.add_argument("--tokenizer", help="an existing tokenizer instead of training one: a sentencepiece .model, "
                   "or a tiktoken folder (tokenizer.pkl, token_bytes.pt)")
    p.add_argument("--tokenizer-kind", choices=TOKENIZER_KINDS, default=kind, required=kind is None,
                   help="sentencepiece (AION's) or tiktoken (the competition kit's byte-level BPE)")
    p.add_argument("--parquet", help="a folder of the kit's shard_*.parquet files to tokenize with --tokenizer")
    p.add_argument("--val-shard", default="", help="with --parquet: the validation shard's file name (default: the last)")
    u = sub.add_parser("unigram", help="bpb of the val split under the train split's token frequencies")
    u.add_argument("--data", required=True, help="a prepared folder (shards, tokenizer.model)")
    u.add_argument("--vocab-size", type=int, default=vocab_size, required=vocab_size is None)
    args = parser.parse_args(argv)
    if args.command == "prepare" and not args.out and not args.parquet:
        parser.error("prepare: --out is required (unless --parquet)")
    if args.command == "prepare" and args.parquet and not args.tokenizer:
        parser.error("prepare --parquet: --tokenizer is required (the kit's tokenizer folder)")
    t0 = time.perf_counter()
    try:
        if args.command == "unigram":
            meta = unigram_bpb(args.data, args.vocab_size)
        elif args.parquet:
            meta = prepare_parquet(args.parquet, args.tokenizer, args.vocab_size, args.val_shard, out_dir=args.out)
        elif args.input:
            meta = prepare(read_documents(args.input), args.out, args.vocab_size, args.val_fraction, args.tokenizer,
                           kind=args.tokenizer_kind)
        elif args.tokenizer:
            meta = prepare(builtin_documents(), args.out, args.vocab_size, args.val_fraction, args.tokenizer,
                           kind=args.tokenizer_kind)
        else:
            meta = prepare_builtin(args.out, args.vocab_size, args.val_fraction, kind=args.tokenizer_kind)
    except DataError as e:
        sys.exit(f"error: {e}")
    summary = {**vars(args), **meta, "seconds": f"{time.perf_counter() - t0:.1f}"}
    print(" ".join(f"{k}:{v}" for k, v in summary.items()))
    return meta


if __name__ == "__main__":
    main()
