"""The competition kit's data kind in data.py: tiktoken tokenizers (tokenizer.pkl, token_bytes.pt)
behind a restricted unpickler, their byte tables, parquet text tokenized once into AION's shards,
the packed (BOS-aligned best-fit) loader order and the kit's packed validation rows.
Tiny corpora made here, small vocabularies, no downloads; every loop stops by a count."""
import io
import itertools
import json
import os
import pickle
import random
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch

import data
from data import DataError

VOCAB = 384


def error_of(fn, *args, **kwargs):
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def corpus(n=240, seed=0):
    """Prose- and code-like documents with multi-byte UTF-8 (2-, 3- and 4-byte characters)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ré", "ü", "th", "e", "an", "or", "st", "ß", "ja", "中", "文", "字", "ω", "ж", "é"]
    words = ["the", "value", "return", "self", "café", "naïve", "中文", "字符", "🙂", "🚀", "x", "1234", "in",
             "données", "Ωmega", "über", "日本語", "def", "for", "42", "𝔘", "\U0001F9EA"]
    words += ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(400)]
    docs = []
    for i in range(n):
        lines = [rng.choice(["", "  ", "    ", "\t"]) + " ".join(rng.choices(words, k=rng.randint(1, 10)))
                 for _ in range(rng.randint(1, 12))]
        docs.append((f"doc{i}", "\n".join(lines) + rng.choice(["", "\n"])))
    return docs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tokenizer of the kit's kind trained on corpus(), vocab 384."""
    folder = tmp_path_factory.mktemp("tok")
    data.train_tiktoken([text for _, text in corpus()], folder, VOCAB)
    return folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    return out, data.prepare(corpus(), out, VOCAB, 0.3, progress=False, kind="tiktoken")


def folder_with(tmp_path, pkl_bytes, tok=None, token_bytes=None):
    folder = tmp_path / "bad"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.pkl").write_bytes(pkl_bytes)
    if token_bytes is not None:
        torch.save(token_bytes, folder / "token_bytes.pt")
    else:
        (folder / "token_bytes.pt").write_bytes((tok / "token_bytes.pt").read_bytes())
    return folder


# -----------------------------------------------------------------------------
# the restricted unpickler and the tokenizer checks


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling would call os.system(...): pickling it runs nothing
        return os.system, (f"touch {self.marker}",)


# an Encoding pickled by name, as tiktoken pickles its registered encodings: tiktoken would look the
# name up in its registry (a download); written opcode by opcode (protocol 2: GLOBAL, NEWOBJ, BUILD)
BY_NAME = b"\x80\x02ctiktoken.core\nEncoding\n)\x81X\x0b\x00\x00\x00cl100k_baseb."


def test_unpickler_refuses_code(tmp_path, tok):
    marker = tmp_path / "ran"
    folder = folder_with(tmp_path, pickle.dumps(RunsCode(marker)), tok)
    message = error_of(data.load_tiktoken, folder, VOCAB)
    assert f"{folder / 'tokenizer.pkl'}: refuses to load {os.system.__module__}.system" in message
    assert "not a tiktoken tokenizer" in message and not marker.exists()
    assert "refuses to load" in error_of(data.ByteTable, folder)  # every reader goes through it


def test_unpickler_refuses_what_is_not_an_encoding(tmp_path, tok):
    folder = folder_with(tmp_path, pickle.dumps([1, 2, 3]), tok)
    message = error_of(data.load_tiktoken, folder, VOCAB)
    assert str(folder / "tokenizer.pkl") in message and "builtins.list" in message and "not a tiktoken tokenizer" in message
    assert "pickled by name" in error_of(data.load_tiktoken, folder_with(tmp_path, BY_NAME, tok))
    assert "not a pickled tiktoken Encoding" in error_of(data.load_tiktoken, folder_with(tmp_path, b"garbage", tok))


# an Encoding its pickle makes and never gives a state (no BUILD): protocol 0's copyreg._reconstructor(Encoding,
# object, None), and protocol 2's NEWOBJ; written opcode by opcode
NO_STATE = [b"ccopy_reg\n_reconstructor\n(ctiktoken.core\nEncoding\nc__builtin__\nobject\nNtR.",
            b"\x80\x02ctiktoken.core\nEncoding\n)\x81."]


@pytest.mark.parametrize("pkl", NO_STATE, ids=["reconstructor", "newobj"])
def test_an_encoding_pickled_without_its_state_is_refused(tmp_path, tok, pkl):
    folder = folder_with(tmp_path, pkl, tok)
    message = error_of(data.load_tiktoken, folder, VOCAB)
    assert f"{folder / 'tokenizer.pkl'}: an Encoding pickled without its state, expected one with a dict of" in message
    assert "without its state" in error_of(data.ByteTable, folder)


def test_every_pickle_protocol_of_an_encoding_loads(tmp_path, tok):
    enc = data.load_tiktoken(tok, VOCAB)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        folder = folder_with(tmp_path, pickle.dumps(enc, protocol=protocol), tok)
        again = data.load_tiktoken(folder, VOCAB)
        assert type(again) is tiktoken.Encoding and again.encode_ordinary("café 🙂 x") == enc.encode_ordinary("café 🙂 x")
        assert pickle.loads(pickle.dumps(again)).n_vocab == VOCAB  # a plain Encoding again


def test_tokenizer_checks_name_the_problem(tmp_path, tok):
    assert f"{tok / 'tokenizer.pkl'}: tokenizer has {VOCAB} tokens, expected vocab_size 512" in \
        error_of(data.load_tiktoken, tok, 512)
    enc = data.load_tiktoken(tok / "tokenizer.pkl", VOCAB)  # the folder or its tokenizer.pkl
    short = folder_with(tmp_path, (tok / "tokenizer.pkl").read_bytes(), token_bytes=torch.zeros(10, dtype=torch.int32))
    message = error_of(data.load_tiktoken, short, VOCAB)
    assert str(short / "token_bytes.pt") in message and f"10 byte counts, expected {VOCAB}" in message
    floats = folder_with(tmp_path, (tok / "tokenizer.pkl").read_bytes(), token_bytes=torch.zeros(VOCAB))
    assert "expected a 1-D integer tensor" in error_of(data.load_tiktoken, floats, VOCAB)
    (tmp_path / "empty").mkdir()
    message = error_of(data.load_tiktoken, tmp_path / "empty", VOCAB)
    assert str(tmp_path / "empty") in message and "tokenizer.pkl" in message and "token_bytes.pt" in message
    no_bos = tiktoken.Encoding(name="x", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                               special_tokens={"<|endoftext|>": VOCAB - 4})
    folder = folder_with(tmp_path, pickle.dumps(no_bos), token_bytes=torch.zeros(VOCAB - 3, dtype=torch.int32))
    assert "no <|reserved_0|> special token" in error_of(data.load_tiktoken, folder, VOCAB - 3)


# -----------------------------------------------------------------------------
# training, bytes


def test_train_tiktoken_round_trip_bos_and_determinism(tmp_path, tok):
    enc = data.load_tiktoken(tok, VOCAB)
    assert enc.n_vocab == VOCAB and enc.name == "rustbpe" and enc._pat_str == data.SPLIT_PATTERN
    assert data.tiktoken_bos(enc) == VOCAB - 4 == data.ByteTable(tok).bos_id
    assert [enc.encode_single_token(name) for name in data.SPECIAL_TOKENS] == list(range(VOCAB - 4, VOCAB))
    for text in [t for _, t in corpus(40, seed=9)] + ["unseen: Ж ∑ 𝔘 \U0001F9EA\r\n\t x=1234567", ""]:
        assert enc.decode(enc.encode_ordinary(text)) == text
    data.train_tiktoken([text for _, text in corpus()], tmp_path, VOCAB)
    for name in ("tokenizer.pkl", "token_bytes.pt"):
        assert (tmp_path / name).read_bytes() == (tok / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token_bytes.pt", "tokenizer.pkl"]  # no temp files
    assert "expected 260..65536" in error_of(data.train_tiktoken, ["abc"], tmp_path / "x", 200)
    assert "too little text" in error_of(data.train_tiktoken, ["abc"], tmp_path / "x", 600)


def test_tiktoken_bytes_exact(prepared):
    out, meta = prepared
    assert meta["tokenizer_kind"] == "tiktoken" and meta["tokenizer"] == str(out.resolve())
    assert json.loads((out / "meta.json").read_text()) == meta
    enc, table = data.load_tiktoken(out, VOCAB), data.ByteTable(out)
    assert table.vocab_size == VOCAB and not table.has_space.any()
    assert table.is_boundary.nonzero().flatten().tolist() == list(range(VOCAB - 4, VOCAB))
    stream = np.concatenate([data.load_shard(f, VOCAB) for f in data.split_files(out, "val")])
    shard_docs = np.split(stream, np.flatnonzero(stream == table.bos_id)[1:])
    val = [text for name, text in corpus() if text and data.is_val(name, 0.3)]
    assert len(shard_docs) == len(val) == meta["n_val_docs"]
    for doc, text in zip(shard_docs, val):
        x = torch.from_numpy(doc.astype(np.int64))[None]
        assert int(table.target_bytes(x[:, :-1], x[:, 1:]).sum()) == len(text.encode("utf-8"))
        assert enc.decode(doc[1:].tolist()) == text
    assert meta["val_bytes"] == sum(len(text.encode()) for text in val)
    assert data.unigram_bpb(out, VOCAB)["val_bytes"] == meta["val_bytes"]  # the same denominator


def test_kit_table_differs_exactly_on_partial_characters(tok):
    enc, kit, exact = data.load_tiktoken(tok), data.kit_token_bytes(tok), data.ByteTable(tok).base_bytes
    assert kit.dtype == torch.int64 and len(kit) == VOCAB and kit[VOCAB - 4:].tolist() == [0] * 4
    partial, differs = set(), set()
    for v in range(VOCAB - 4):
        raw = enc.decode_single_token_bytes(v)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            partial.add(v)
            if len(raw.decode("utf-8", "replace").encode()) != len(raw):
                differs.add(v)
    ids, kit_bytes, exact_bytes = data.kit_table_differences(tok)
    assert set(ids.tolist()) == differs and differs <= partial
    assert len(differs) >= 128  # at least the 128 lone bytes 0x80-0xff, each one U+FFFD (3 bytes) in the kit's table
    assert all(kit[v] == 3 and exact[v] == 1 for v in range(VOCAB - 4) if len(enc.decode_single_token_bytes(v)) == 1
               and enc.decode_single_token_bytes(v)[0] >= 0x80)
    assert torch.equal(kit_bytes, kit[ids]) and torch.equal(exact_bytes, exact[ids])
    print(f"vocab {VOCAB}: {len(partial)} partial-UTF-8 ids, {len(differs)} where the kit's table differs")


def test_prepare_with_a_given_tokenizer_and_the_cli(tmp_path, tok, capsys):
    meta = data.prepare(corpus(), tmp_path / "a", VOCAB, 0.3, tokenizer=tok, progress=False, kind="tiktoken")
    assert (tmp_path / "a" / "tokenizer.pkl").read_bytes() == (tok / "tokenizer.pkl").read_bytes()
    assert str(tok) in error_of(data.prepare, corpus(), tmp_path / "b", 512, 0.3, tokenizer=tok, kind="tiktoken")
    assert "kind 'bpe'" in error_of(data.prepare, corpus(), tmp_path / "b", 512, 0.3, kind="bpe")
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": text}) + "\n" for _, text in corpus()))
    args = ["prepare", "--tokenizer-kind", "tiktoken", "--vocab-size", str(VOCAB), "--val-fraction", "0.3",
            "--input", str(src), "--out", str(tmp_path / "cli")]
    first = data.main(args)
    assert first["tokenizer_kind"] == "tiktoken" and first["val_tokens"] > 0
    assert data.main([*args, "--tokenizer", str(tmp_path / "cli")]) == first  # the given tokenizer: the same shards
    assert meta["train_tokens"] > 0 and "tokenizer_kind:tiktoken" in capsys.readouterr().out


def test_builtin_tiktoken_folder_and_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "builtin_documents", lambda: corpus())
    train, val, tokenizer, fingerprint = data.open_data("builtin", tmp_path, "", VOCAB, 0.3, kind="tiktoken")
    assert tokenizer == str((tmp_path / f"tiktoken{VOCAB}").resolve()) and fingerprint.endswith("-tiktoken")
    assert train and val and data.ByteTable(tokenizer).vocab_size == VOCAB
    mtime = train[0].stat().st_mtime_ns
    assert data.open_data("builtin", tmp_path, "", VOCAB, 0.3, kind="tiktoken")[3] == fingerprint
    assert train[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    shards = data.open_data("shards", tmp_path / f"tiktoken{VOCAB}", tokenizer, VOCAB, 0.3, kind="tiktoken")
    assert shards[0] == train and len(shards[3]) == 12


# -----------------------------------------------------------------------------
# parquet


def write_parquet(folder, texts_per_file, row_group_size=7, **kwargs):
    folder.mkdir(parents=True, exist_ok=True)
    for i, texts in enumerate(texts_per_file):
        pq.write_table(pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.string())}),
                       folder / f"shard_{i:05d}.parquet", row_group_size=row_group_size, **kwargs)
    return sorted(folder.glob("shard_*.parquet"))


def parquet_texts(n_files=3, per_file=40):
    texts = [text for _, text in corpus(n_files * per_file, seed=5)]
    return [texts[i * per_file:(i + 1) * per_file] for i in range(n_files)]


def test_parquet_tokenized_once_in_file_and_row_order(tmp_path, tok):
    texts = parquet_texts()
    texts[1][3] = ""  # an empty document stays: a lone BOS
    write_parquet(tmp_path / "pq", texts)
    train, val, tokenizer, fingerprint = data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)
    cache = tmp_path / "pq" / "aion_tokens" / fingerprint
    assert train == data.split_files(cache, "train") and val == data.split_files(cache, "val")
    assert tokenizer == str(cache.resolve()) and (cache / "tokenizer.pkl").read_bytes() == (tok / "tokenizer.pkl").read_bytes()
    enc = data.load_tiktoken(tok, VOCAB)
    bos = data.tiktoken_bos(enc)

    def expected(docs):
        return [t for text in docs for t in [bos, *enc.encode_ordinary(text)]]
    stream = lambda files: np.concatenate([data.load_shard(f, VOCAB) for f in files]).tolist()
    assert stream(train) == expected(texts[0] + texts[1]) and stream(val) == expected(texts[2])
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["val_shard"] == "shard_00002.parquet" and meta["n_train_docs"] == 80 and meta["n_val_docs"] == 40
    assert meta["val_bytes"] == sum(len(t.encode()) for t in texts[2]) and meta["fingerprint"] == fingerprint

    # unchanged: the same folder, nothing rewritten
    mtimes = {f: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)[3] == fingerprint
    assert {f: f.stat().st_mtime_ns for f in cache.iterdir()} == mtimes

    # a named val shard, another tokenizer, a touched file: each its own cache
    named = data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3, val_shard="shard_00000.parquet")
    assert named[3] != fingerprint and stream(named[1]) == expected(texts[0])
    other = tmp_path / "tok2"
    data.train_tiktoken([text for _, text in corpus(seed=3)], other, VOCAB)
    rebuilt = data.open_data("parquet", tmp_path / "pq", str(other), VOCAB, 0.3)
    assert rebuilt[3] != fingerprint and (tmp_path / "pq" / "aion_tokens" / rebuilt[3] / "meta.json").exists()
    os.utime(tmp_path / "pq" / "shard_00001.parquet", ns=(1, 1))
    assert data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)[3] not in (fingerprint, rebuilt[3])


def test_a_parquet_shard_edited_in_place_is_tokenized_again(tmp_path, tok):
    """Same size, its mtime restored (as cp -p, rsync -t or tar x leave it): the fingerprint reads the file's ends."""
    texts = parquet_texts()
    files = write_parquet(tmp_path / "pq", texts, compression="none")
    first = data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)
    stat = files[1].stat()
    texts[1][5] = texts[1][5].replace("a", "o", 1)  # one byte for another: the same size, uncompressed
    assert texts[1][5] != parquet_texts()[1][5]
    files[1].write_bytes(write_parquet(tmp_path / "edited", texts, compression="none")[1].read_bytes())
    os.utime(files[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files[1].stat().st_size == stat.st_size and files[1].stat().st_mtime_ns == stat.st_mtime_ns
    again = data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)
    enc = data.load_tiktoken(tok, VOCAB)
    stream = np.concatenate([data.load_shard(f, VOCAB) for f in again[0]]).tolist()
    assert again[3] != first[3] and stream == [t for text in texts[0] + texts[1]
                                               for t in [data.tiktoken_bos(enc), *enc.encode_ordinary(text)]]


def test_the_fingerprint_reads_a_parquet_footer_longer_than_its_block(tmp_path, tok, monkeypatch):
    """Two files alike but for their footers' metadata (same size): seen though the last block holds none of it."""
    a, b = tmp_path / "a" / "shard_00000.parquet", tmp_path / "b" / "shard_00000.parquet"
    for path, value in ((a, b"1"), (b, b"2")):
        path.parent.mkdir()
        table = pa.table({"text": ["x"] * 5}).replace_schema_metadata({b"source": value})
        pq.write_table(table, path, compression="none")
        os.utime(path, ns=(10**18, 10**18))  # the same time
    block = 16
    assert a.stat().st_size == b.stat().st_size and a.read_bytes()[:block] == b.read_bytes()[:block]
    assert a.read_bytes()[-block:] == b.read_bytes()[-block:] and a.read_bytes() != b.read_bytes()
    monkeypatch.setattr(data, "FINGERPRINT_BLOCK", block)
    assert data.parquet_fingerprint([a], a, tok) != data.parquet_fingerprint([b], b, tok)


@pytest.mark.parametrize("empty, message", [
    ("val rows", "{val}: the validation shard has 0 rows; expected the validation text"),
    ("train rows", "the 2 training shards (shard_00000.parquet .. shard_00001.parquet) have 0 rows; expected"),
    ("val text", "{val}: the validation shard's 3 rows hold no text (0 bytes); expected the validation text"),
])
def test_an_empty_split_is_named_and_leaves_no_metadata(tmp_path, tok, empty, message):
    texts = parquet_texts()
    if empty == "train rows":
        texts[0] = texts[1] = []
    else:
        texts[2] = [] if empty == "val rows" else ["", "", ""]
    files = write_parquet(tmp_path / "pq", texts)
    assert message.format(val=files[2]) in error_of(data.open_data, "parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)
    assert not list((tmp_path / "pq").rglob("meta.json"))


def test_a_damaged_cache_meta_is_prepared_again(tmp_path, tok):
    write_parquet(tmp_path / "pq", parquet_texts(2))
    fingerprint = data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)[3]
    meta = tmp_path / "pq" / "aion_tokens" / fingerprint / "meta.json"
    whole = meta.read_text()
    meta.write_text(whole[:len(whole) // 2])  # cut short
    assert data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)[3] == fingerprint
    assert json.loads(meta.read_text())["fingerprint"] == fingerprint


def test_parquet_ranks_tokenize_once_together(tmp_path, tok):
    """Every rank of a run calls open_data at once: one tokenizes, the others wait and reuse it."""
    write_parquet(tmp_path / "pq", parquet_texts(2))
    results = [None] * 3

    def rank(i):
        results[i] = data.open_data("parquet", tmp_path / "pq", str(tok), VOCAB, 0.3)
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and r[3] == results[0][3] and r[0] == results[0][0] for r in results)
    assert [len(data.load_shard(f, VOCAB)) for f in results[0][0]] == \
        [json.loads((results[0][0][0].parent / "meta.json").read_text())["train_tokens"]]


def test_parquet_errors_name_the_file(tmp_path, tok):
    def err(folder, val_shard=""):
        return error_of(data.prepare_parquet, folder, tok, VOCAB, val_shard, progress=False)
    (tmp_path / "none").mkdir()
    assert f"{tmp_path / 'none'}: no shard_*.parquet files" in err(tmp_path / "none")
    write_parquet(tmp_path / "one", parquet_texts(1))
    assert "expected at least 2: one for train and one for val" in err(tmp_path / "one")
    write_parquet(tmp_path / "two", parquet_texts(2))
    message = err(tmp_path / "two", "shard_00009.parquet")
    assert "data.val_shard=shard_00009.parquet: no such" in message and str(tmp_path / "two") in message

    files = write_parquet(tmp_path / "cols", parquet_texts(2))
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), files[0])
    assert f"{files[0]}: no text column (columns: content, id)" in err(tmp_path / "cols")
    pq.write_table(pa.table({"text": [1, 2]}), files[0])
    assert f"{files[0]}: text column of type int64, expected strings" in err(tmp_path / "cols")
    pq.write_table(pa.table({"text": ["a", "b", None]}), files[0], row_group_size=2)
    assert f"{files[0]}: row 2 has no text (null)" in err(tmp_path / "cols")
    files[0].write_text("not parquet")
    assert f"{files[0]}: not a parquet file" in err(tmp_path / "cols")
    assert "needs data.tokenizer" in error_of(data.open_data, "parquet", tmp_path / "cols", "", VOCAB, 0.3)


def test_cli_tokenizes_parquet(tmp_path, tok, capsys):
    write_parquet(tmp_path / "pq", parquet_texts(2))
    meta = data.main(["prepare", "--parquet", str(tmp_path / "pq"), "--tokenizer", str(tok), "--vocab-size", str(VOCAB),
                      "--out", str(tmp_path / "out")])
    assert meta["val_shard"] == "shard_00001.parquet" and data.split_files(tmp_path / "out", "val")
    assert "fingerprint:" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# the packed loader


BOS = 0


def make_docs(n, rng, longest=100):
    """Documents [BOS, tokens...] whose tokens name the document: doc i's token j (j >= 1) is
    1 + (31 * i + j) % 65000, so a row's piece identifies its document and offset."""
    return [[BOS] + [1 + (31 * i + j) % 65000 for j in range(1, rng.randint(1, longest))] for i in range(n)]


def write_docs(folder, docs, split="train", cut=None):
    """docs as one token stream in shards (cut: where the first shard ends, mid-document)."""
    stream = np.array([t for d in docs for t in d], dtype=np.uint16)
    cut = len(stream) if cut is None else cut
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"fineweb_{split}_000000.bin"]
    data.write_shard(files[0], stream[:cut])
    if cut < len(stream):
        files.append(folder / f"fineweb_{split}_000001.bin")
        data.write_shard(files[1], stream[cut:])
    return files


def reference_rows(docs, n_rows, row_len, buffer_size, refill):
    """The kit's make_dataloader packing, as it is written there: linear scans of a list."""
    def chunks():
        while True:
            for i in range(0, len(docs), refill):
                yield docs[i:i + refill]
    stream, buffer, rows = chunks(), [], []
    for _ in range(n_rows):
        row = []
        while len(row) < row_len:
            while len(buffer) < buffer_size:
                buffer.extend(next(stream))
            remaining = row_len - len(row)
            best, best_len = -1, 0
            for i, doc in enumerate(buffer):
                if best_len < len(doc) <= remaining:
                    best, best_len = i, len(doc)
            if best >= 0:
                row += buffer.pop(best)
            else:
                row += buffer.pop(min(range(len(buffer)), key=lambda i: len(buffer[i])))[:remaining]
        rows.append(row)
    return rows


def packed(files, batch_size=4, seq_len=32, **kw):
    return data.TrainLoader(files, batch_size, seq_len, 65536, order="packed", bos_id=BOS, **kw)


def rows_of(loader, n):
    out = []
    for _ in range(n):
        x, y = loader.next_batch()
        assert x.shape == y.shape and torch.equal(x[:, 1:], y[:, :-1])
        out += torch.cat([x, y[:, -1:]], 1).tolist()
    return out


@pytest.fixture
def small_buffer(monkeypatch):
    monkeypatch.setattr(data, "PACK_BUFFER_DOCS", 40)
    monkeypatch.setattr(data, "PACK_REFILL_DOCS", 8)


def test_packed_rows_are_the_kits(tmp_path):
    docs = make_docs(1500, random.Random(0))
    files = write_docs(tmp_path, docs, cut=30011)  # a document continues into the second shard
    loader = packed(files, prefetch=0)
    assert rows_of(loader, 60) == reference_rows(docs, 240, 33, data.PACK_BUFFER_DOCS, data.PACK_REFILL_DOCS)
    loader.close()


def test_packed_rows_hold_whole_documents(tmp_path, small_buffer):
    docs = make_docs(300, random.Random(1))
    by_second = {d[1]: i for i, d in enumerate(docs) if len(d) > 1}
    files = write_docs(tmp_path, docs)
    loader = packed(files, batch_size=3, seq_len=47, prefetch=2)
    rows, seen, cropped = rows_of(loader, 40), [], 0
    assert loader.epoch == 0  # all of it in the first pass over the stream
    for row in rows:
        assert len(row) == 48 and row[0] == BOS
        starts = [i for i, t in enumerate(row) if t == BOS] + [len(row)]
        for k, (a, b) in enumerate(zip(starts, starts[1:])):
            piece, last = row[a:b], k == len(starts) - 2
            doc = docs[by_second[piece[1]]] if len(piece) > 1 else [BOS]  # or a one-token document
            assert piece == doc[:len(piece)]  # every token from a document, in order: no padding
            assert last or len(piece) == len(doc)  # only a row's last piece may be cropped
            cropped += len(piece) < len(doc)
            if len(piece) > 1:
                seen.append(by_second[piece[1]])
    assert len(seen) == len(set(seen))  # a document is used once in the epoch: a cropped one is never continued
    assert cropped  # some documents were longer than the room left
    loader.close()


def test_packed_is_seed_independent_and_resumes_exactly(tmp_path, small_buffer):
    docs = make_docs(100, random.Random(2))
    files = write_docs(tmp_path, docs, cut=1503)
    first = rows_of(packed(files, seed=1, prefetch=0), 30)
    assert first == rows_of(packed(files, seed=2, prefetch=3), 30)  # the stream order: the same for every seed
    assert first == reference_rows(docs, 120, 33, 40, 8)

    for prefetch in (0, 3):
        loader = packed(files, prefetch=prefetch)
        rows_of(loader, 17)
        state = loader.state_dict()
        assert state["order"] == "packed" and all(type(d) is int for d in state["buffer"])
        buf = io.BytesIO()
        torch.save(state, buf)  # a checkpoint loads with weights_only=True: plain ints and lists
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        expected = rows_of(loader, 13)
        assert expected == first[17 * 4:30 * 4] and loader.epoch >= 1  # past an epoch's end
        loader.close()
        resumed = packed(files, prefetch=2)
        resumed.next_batch()  # its read-ahead ran before the restore
        resumed.load_state_dict(state)
        assert rows_of(resumed, 13) == expected
        resumed.close()

    loader = packed(files, prefetch=0)
    used = {r[1] for r in rows_of(loader, 3)}
    state = loader.state_dict()
    reshaped = packed(files, batch_size=2, seq_len=64, prefetch=2)  # an annealing stage's shape
    reshaped.load_state_dict(state)  # carries on with the same buffer and stream position
    again = rows_of(reshaped, 2)
    assert all(len(r) == 65 and r[0] == BOS for r in again) and not {r[1] for r in again} & used
    assert again == [r for r in _from_state(files, state, 4, 65)]
    reshaped.close()

    with pytest.raises(DataError, match="data.order 'packed'"):
        data.TrainLoader(files, 4, 16, 65536).load_state_dict(state)
    with pytest.raises(DataError, match="data.order 'contiguous'"):
        packed(files).load_state_dict(data.TrainLoader(files, 4, 16, 65536, prefetch=0).state_dict())
    assert "stream of 100 documents, these shards hold 10" in error_of(
        packed(write_docs(tmp_path / "other", docs[:10]), prefetch=0).load_state_dict, state)
    assert "needs a tokenizer with a BOS token" in error_of(data.TrainLoader, files, 4, 16, 65536, order="packed")
    assert "no BOS token (id 7)" in error_of(data.TrainLoader, write_docs(tmp_path / "nobos", [[1, 2, 3]]), 1, 2, 65536,
                                             order="packed", bos_id=7)


def _from_state(files, state, n_rows, row_len):
    shards = [data.load_shard(f) for f in files]
    packer = data._Packer(data._documents([str(f) for f in files], shards, BOS), state)
    return packer.rows(n_rows, row_len).astype(int).tolist()


def test_packed_ranks_split_the_global_batch(tmp_path, small_buffer):
    files = write_docs(tmp_path, make_docs(200, random.Random(3)))
    whole = rows_of(packed(files, batch_size=4, prefetch=0), 25)
    ranks = [rows_of(packed(files, batch_size=2, rank=r, world_size=2, prefetch=1), 25) for r in range(2)]
    for step in range(25):
        assert ranks[0][2 * step:2 * step + 2] + ranks[1][2 * step:2 * step + 2] == whole[4 * step:4 * step + 4]


def test_packed_val_batches(tmp_path, small_buffer):
    docs = make_docs(60, random.Random(4), longest=40)
    files = write_docs(tmp_path, docs, split="val")
    n_tokens = sum(map(len, docs))
    max_tokens = 3 * n_tokens  # more than one pass: the stream repeats
    batches = list(data.packed_val_batches(files, 16, 4, 65536, BOS, max_tokens))
    assert len(batches) == max_tokens // (4 * 16)
    rows = [torch.cat([x, y[:, -1:]], 1) for x, y in batches]
    assert all(x.dtype == torch.int64 and x.shape == (4, 16) and x.is_contiguous() for x, _ in batches)
    assert torch.cat(rows).tolist() == reference_rows(docs, 4 * len(batches), 17, 40, 8)
    firsts = [r[1] for r in torch.cat(rows).tolist()]
    assert max(firsts.count(t) for t in set(firsts)) > 1  # documents seen again in a later pass

    parts = [list(data.packed_val_batches(files, 16, 4, 65536, BOS, max_tokens, rank=r, world_size=3)) for r in range(3)]
    assert sum(map(len, parts)) == len(batches)
    for i, (x, y) in enumerate(batches):
        assert torch.equal(parts[i % 3][i // 3][0], x) and torch.equal(parts[i % 3][i // 3][1], y)
    assert "at least one batch" in error_of(lambda: list(data.packed_val_batches(files, 16, 4, 65536, BOS, 63)))
    assert "BOS" in error_of(lambda: list(data.packed_val_batches(files, 16, 4, 65536, None, 640)))


def test_packed_loader_on_prepared_tiktoken_shards(prepared):
    out, meta = prepared
    table = data.ByteTable(out)
    loader = data.TrainLoader(data.split_files(out, "train"), 2, 64, VOCAB, order="packed", bos_id=table.bos_id)
    for x, y in itertools.islice(iter(loader.next_batch, None), 10):
        assert (x[:, 0] == table.bos_id).all() and x.shape == (2, 64)
    loader.close()
