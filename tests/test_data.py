import importlib.util
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

import data
from data import DataError



def split_tokens(folder, split, vocab_size=None):
    return np.concatenate([data.load_shard(f, vocab_size) for f in data.split_files(folder, split)])


def crafted_documents(n=300, seed=0):
    """Code-like text with multi-byte UTF-8, indentation, tabs, runs of spaces and blank lines,
    plus documents that start with a space or hold characters the tokenizer never saw."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "café", "naïve", "中文", "字符", "🙂", "🚀", "x", "1234", "in"]
    indents = ["", "  ", "    ", "        ", "\t", "\t\t"]
    docs = []
    for i in range(n):
        lines = [rng.choice(indents) + rng.choice([" ", "  "]).join(rng.choices(words, k=rng.randint(1, 8)))
                 + rng.choice(["", " ", "   "]) for _ in range(rng.randint(3, 30))]
        docs.append((f"doc{i}", "\n".join(lines) + rng.choice(["", "\n", "\n\n"])))
    return docs + [("lead", " leading space\n  two spaces\n"), ("rare", "Ωmega ∑ ☃ ünïcödé 𝔘 \U0001F9EA"),
                   ("tabs", "\tx\t\ty\n\n\n  \t "), ("spaces", "   "), ("newline", "\n")]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A vocab-300 tokenizer and shards prepared from crafted_documents."""
    out = tmp_path_factory.mktemp("small")
    meta = data.prepare(crafted_documents(), out, 300, 0.3, progress=False)
    return out, meta


def error_of(fn, *args, **kwargs):
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def doc_bytes(table, ids):
    """Bytes of one document by the table: BOS, then the document's tokens as targets."""
    seq = torch.tensor([1, *ids])[None]
    return int(table.target_bytes(seq[:, :-1], seq[:, 1:]).sum())


# -----------------------------------------------------------------------------
# byte counts for val_bpb


def test_builtin_val_bytes_exact(builtin_1024):
    meta, folder = builtin_1024, Path(builtin_1024["tokenizer"]).parent
    sp = spm.SentencePieceProcessor(model_file=meta["tokenizer"])
    tokens = split_tokens(folder, "val", 1024)
    assert len(tokens) == meta["val_tokens"] and tokens[0] == sp.bos_id()
    stream = torch.from_numpy(tokens.astype(np.int64))[None]
    assert int(data.ByteTable(meta["tokenizer"]).target_bytes(stream[:, :-1], stream[:, 1:]).sum()) == meta["val_bytes"]

    val_docs = [(name, text) for name, text in data.builtin_documents()
                if text and data.is_val(name, meta["val_fraction"])]
    shard_docs = np.split(tokens, np.flatnonzero(tokens == sp.bos_id())[1:])
    assert len(shard_docs) == len(val_docs) == meta["n_val_docs"]
    decoded = [sp.decode(doc[1:].tolist()) for doc in shard_docs]
    assert sum(len(d.encode()) for d in decoded) == meta["val_bytes"]
    # every built-in document round-trips (identity normalization, byte fallback), so the
    # decoded bytes are the text's own bytes
    assert [d for d, (_, text) in zip(decoded, val_docs) if d != text] == []
    assert sum(len(text.encode()) for _, text in val_docs) == meta["val_bytes"]


def test_crafted_bytes_exact(small):
    _, meta = small
    sp = spm.SentencePieceProcessor(model_file=meta["tokenizer"])
    table = data.ByteTable(meta["tokenizer"])
    assert table.vocab_size == 300 and not table.has_space.any()  # no dummy prefix: every "▁" is a real space
    assert any(p.count("▁") > 1 for p in map(sp.id_to_piece, range(300)))  # whitespace runs are single pieces
    docs = crafted_documents()
    encoded = sp.encode([text for _, text in docs])
    assert any(sp.is_byte(i) for ids in encoded for i in ids)  # characters outside the vocab
    for (name, text), ids in zip(docs, encoded):
        assert sp.decode(ids) == text, name
        assert doc_bytes(table, ids) == len(text.encode()), name
    # the leading "▁" after BOS: sentencepiece keeps it when the model adds no dummy prefix
    lead = sp.encode(" x")
    assert sp.id_to_piece(lead[0]).startswith("▁") and sp.decode([sp.bos_id(), *lead]) == " x"


def test_dummy_prefix_bytes_exact(tmp_path):
    """FineWeb-style tokenizers add a dummy "▁" that the decoder drops after BOS; the table must too."""
    model = io.BytesIO()
    texts = [text for _, text in crafted_documents()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=300, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (tmp_path / "dummy.model").write_bytes(model.getvalue())
    table = data.ByteTable(tmp_path / "dummy.model")
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert table.has_space.any()
    for text in texts:
        ids = sp.encode(text)
        assert doc_bytes(table, ids) == len(sp.decode(ids).encode()), text


def test_target_bytes_moves_to_input_device(small):
    table = data.ByteTable(small[1]["tokenizer"])
    x = torch.tensor([[1, 50]], device="meta")  # stands in for an accelerator
    assert table.target_bytes(x, x).device == x.device and table.base_bytes.device == x.device


# -----------------------------------------------------------------------------
# shards and bad data


def test_shard_round_trip(tmp_path):
    tokens = np.array([0, 1, 65535, 7, 300], dtype=np.uint16)
    data.write_shard(tmp_path / "a.bin", tokens)
    raw = (tmp_path / "a.bin").read_bytes()
    assert np.frombuffer(raw[:12], "<i4").tolist() == [data.MAGIC, data.VERSION, 5] and len(raw) == 1024 + 10
    assert np.array_equal(data.load_shard(tmp_path / "a.bin"), tokens)
    assert list(tmp_path.iterdir()) == [tmp_path / "a.bin"]  # no temp file left behind


@pytest.mark.parametrize("corrupt, problem", [
    (lambda raw: raw[:100], "shorter than"),
    (lambda raw: np.int32(123).tobytes() + raw[4:], "magic 123"),
    (lambda raw: raw[:4] + np.int32(2).tobytes() + raw[8:], "version 2"),
    (lambda raw: raw[:-2], "truncated"),
    (lambda raw: raw + b"\0\0", "trailing bytes"),
    (lambda raw: raw, "token id 999 found, expected ids < vocab_size 500"),
])
def test_bad_shards(tmp_path, corrupt, problem):
    path = tmp_path / "bad.bin"
    data.write_shard(path, np.array([1, 2, 999], dtype=np.uint16))
    path.write_bytes(corrupt(path.read_bytes()))
    message = error_of(data.load_shard, path, 500)
    assert str(path) in message and problem in message


def test_bad_corpora(tmp_path, small):
    out = tmp_path / "out"
    assert str(out) in error_of(data.prepare, [], out, 300, 0.3)
    assert str(out) in error_of(data.prepare, [("a", ""), ("b", "")], out, 300, 0.3)
    assert "empty val split" in error_of(data.prepare, [("a", "text")], out, 300, 1e-9)
    assert "65536" in error_of(data.prepare, [("a", "text")], out, 70000, 0.3)
    tokenizer = small[1]["tokenizer"]
    message = error_of(data.prepare, crafted_documents(50), out, 512, 0.3, tokenizer=tokenizer, progress=False)
    assert tokenizer in message and "300" in message and "512" in message


def test_read_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / ".hidden").write_text("skipped")
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n\n{"text": "three", "id": 3}\n')
    assert data.read_documents([tmp_path]) == [("a.txt", "ay"), ("c.jsonl:1", "one"), ("c.jsonl:3", "three"),
                                               ("sub/b.txt", "bee")]
    assert data.read_documents([tmp_path / "a.txt"]) == [("a.txt", "ay")]
    for content, problem in [('{"text": "ok"}\n{"text": oops}\n', ":2: bad JSON"),
                             ('{"title": "x"}\n', ":1: expected")]:
        (tmp_path / "c.jsonl").write_text(content)
        assert f"{tmp_path / 'c.jsonl'}{problem}" in error_of(data.read_documents, [tmp_path])
    assert str(tmp_path / "missing") in error_of(data.read_documents, [tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    assert str(tmp_path / "empty") in error_of(data.read_documents, [tmp_path / "empty"])


def test_split_is_stable():
    names = [f"doc{i}" for i in range(2000)]
    val = [n for n in names if data.is_val(n, 0.1)]
    assert val == [n for n in names if data.is_val(n, 0.1)] and 120 < len(val) < 280
    assert set(val) <= {n for n in names if data.is_val(n, 0.2)}


def test_train_shards_hold_documents_in_shuffled_order(small):
    out, meta = small
    sp = spm.SentencePieceProcessor(model_file=meta["tokenizer"])
    tokens = split_tokens(out, "train").tolist()
    starts = [i for i, t in enumerate(tokens) if t == sp.bos_id()] + [len(tokens)]
    texts = [sp.decode(tokens[a + 1:b]) for a, b in zip(starts, starts[1:])]
    train = [d for d in crafted_documents() if d[1] and not data.is_val(d[0], 0.3)]
    assert texts == [text for _, text in sorted(train, key=lambda d: data.order_key(d[0]))]
    assert texts != [text for _, text in train]  # not the name order


# -----------------------------------------------------------------------------
# loaders


@pytest.fixture
def shards(tmp_path):
    """Two train shards whose tokens are their own positions, so windows are identifiable."""
    tokens = np.arange(8000, dtype=np.uint16)
    files = [tmp_path / "fineweb_train_000000.bin", tmp_path / "fineweb_train_000001.bin"]
    data.write_shard(files[0], tokens[:5000])
    data.write_shard(files[1], tokens[5000:])
    return files


def batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_loader_windows_and_epochs(shards):
    loader = data.TrainLoader(shards, 4, 16, 8000, prefetch=0)
    x, y = loader.next_batch()
    assert x.dtype == torch.int64 and x.shape == (4, 16) and x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x.flatten(), torch.arange(64)) and torch.equal(y.flatten(), torch.arange(1, 65))
    steps_per_epoch = (5000 - 1) // 64 + (3000 - 1) // 64
    rest = batches(loader, steps_per_epoch)
    assert rest[(5000 - 1) // 64 - 1][0][0, 0] == 5000  # the step that does not fit starts the next shard
    assert loader.epoch == 1 and torch.equal(rest[-1][0], x)
    loader.close()


def test_loader_resume(shards):
    with_prefetch = data.TrainLoader(shards, 4, 16, 8000, prefetch=3)
    synchronous = data.TrainLoader(shards, 4, 16, 8000, prefetch=0)
    for (x1, y1), (x2, y2) in zip(batches(with_prefetch, 150), batches(synchronous, 150)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    state = with_prefetch.state_dict()
    assert state["epoch"] == 1
    expected = batches(with_prefetch, 3)
    with_prefetch.close()

    resumed = data.TrainLoader(shards, 4, 16, 8000, prefetch=2)
    resumed.next_batch()  # its prefetch thread has read ahead before the restore
    resumed.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(batches(resumed, 3), expected):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert resumed.epoch == 1 and resumed.wait_s >= 0
    resumed.close()  # stops the read-ahead, keeps the position
    assert torch.equal(resumed.next_batch()[0], expected[-1][0] + 64)

    reshaped = data.TrainLoader(shards, 2, 32, 8000, prefetch=2)  # position is in tokens
    reshaped.load_state_dict(state)
    assert torch.equal(reshaped.next_batch()[0].flatten(), expected[0][0].flatten())
    reshaped.close()
    synchronous.close()


def test_loader_ranks_disjoint(shards):
    ranks = [data.TrainLoader(shards, 2, 16, 8000, rank=r, world_size=2) for r in range(2)]
    whole = data.TrainLoader(shards, 4, 16, 8000)
    seen = [set(), set()]
    for _ in range(100):  # within one epoch
        (x0, y0), (x1, y1), (x, y) = ranks[0].next_batch(), ranks[1].next_batch(), whole.next_batch()
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        seen[0].update(x0.flatten().tolist())
        seen[1].update(x1.flatten().tolist())
    assert not seen[0] & seen[1]
    for loader in [*ranks, whole]:
        loader.close()


def shuffled(shards, batch_size=4, seq_len=16, **kw):
    return data.TrainLoader(shards, batch_size, seq_len, 8000, order="shuffle", **kw)


def test_shuffled_loader_visits_every_window_once_per_epoch(shards):
    loader = shuffled(shards, prefetch=0, seed=3)
    epoch = []
    while loader.epoch == 0:
        x, y = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        epoch.append(x)
    last = epoch.pop()  # the first batch of epoch 1
    starts = torch.cat(epoch)[:, 0]
    assert torch.equal(torch.cat(epoch), starts[:, None] + torch.arange(16))  # whole windows of the stream
    assert not ((starts < 5000) & (starts + 16 >= 5000)).any()  # none straddles the shards' boundary (5000)
    offsets = {int(s) % 16 for s in starts[starts < 5000]} | {(int(s) - 5000) % 16 for s in starts[starts >= 5000]}
    assert len(offsets) == 1 and len(set(starts.tolist())) == len(starts)  # one grid in both shards, no window twice
    offset = offsets.pop()
    n_windows = (5000 - 1 - offset) // 16 + (3000 - 1 - offset) // 16
    assert len(starts) == n_windows // 4 * 4  # all of them but a remainder smaller than a step
    assert starts.tolist() != sorted(starts.tolist())  # shuffled
    assert not torch.equal(last, epoch[0])  # the next epoch has its own order


def test_shuffled_loader_is_deterministic_resumable_and_rank_disjoint(shards):
    first, again, other = (batches(shuffled(shards, seed=s), 30) for s in (1, 1, 2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))

    loader = shuffled(shards, seed=1, prefetch=3)
    batches(loader, 20)
    state = loader.state_dict()
    expected = batches(loader, 5)
    loader.close()
    resumed = shuffled(shards, seed=1, prefetch=2)
    resumed.next_batch()  # read ahead before the restore
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches(resumed, 5), expected))
    resumed.close()
    with pytest.raises(data.DataError, match="data.order 'shuffle'"):
        data.TrainLoader(shards, 4, 16, 8000).load_state_dict(state)

    ranks = [shuffled(shards, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    for (x0, _), (x1, _), (x, _) in zip(batches(ranks[0], 30), batches(ranks[1], 30), first):
        assert torch.equal(torch.cat([x0, x1]), x)


def test_loader_rejects_bad_shards(shards, tmp_path):
    assert str(shards[0]) in error_of(data.TrainLoader, shards, 4, 16, 4000)  # ids up to 4999
    assert str(shards[1]) in error_of(data.TrainLoader, shards, 64, 64, 8000)  # shard smaller than one step
    assert "expected at least world_size 1 x batch_size 600" in error_of(shuffled, shards, 600)


def test_val_batches_cover_each_target_once(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    files = [tmp_path / "fineweb_val_000000.bin", tmp_path / "fineweb_val_000001.bin"]
    data.write_shard(files[0], tokens[:600])
    data.write_shard(files[1], tokens[600:])
    seq_len, world = 7, 3
    targets = []
    for rank in range(world):
        for x, y in data.val_batches(files, seq_len, 4, 1000, rank=rank, world_size=world):
            assert x.dtype == torch.int64 and x.shape[1] == seq_len and 0 < len(x) <= 4
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x[:, 1:], y[:, :-1])
            targets += y.flatten().tolist()
    n = (1000 - 1) // seq_len * seq_len  # the partial last window is dropped
    assert sorted(targets) == list(range(1, n + 1))

    limited = [y for x, y in data.val_batches(files, seq_len, 4, 1000, max_tokens=50)]
    assert torch.cat(limited).flatten().tolist() == list(range(1, 50 // seq_len * seq_len + 1))
    assert str(files[0]) in error_of(lambda: list(data.val_batches(files, seq_len, 4, 1000, max_tokens=5)))


# -----------------------------------------------------------------------------
# CLI


def test_cli_prepare(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data, "SHARD_TOKENS", 5000)
    src = tmp_path / "src"
    src.mkdir()
    docs = crafted_documents(120)
    (src / "notes.txt").write_text(docs[0][1])
    (src / "more.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for _, text in docs[1:]))
    out = tmp_path / "out"
    args = ["prepare", "--input", str(src), "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.3"]
    meta = data.main(args)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["n_train_docs"] + meta["n_val_docs"] == len(docs) and meta["vocab_size"] == 300
    for split in ["train", "val"]:
        sizes = [len(data.load_shard(f, 300)) for f in data.split_files(out, split)]
        assert sum(sizes) == meta[f"{split}_tokens"] > 0 and set(sizes[:-1]) <= {5000} and 0 < sizes[-1] <= 5000
    assert len(sizes) < len(list(out.glob("fineweb_train_*.bin")))  # several train shards
    assert f"val_bytes:{meta['val_bytes']}" in capsys.readouterr().out

    again = data.main([*args, "--tokenizer", meta["tokenizer"]])
    assert again == meta  # a given tokenizer reproduces the same shards


def test_cli_unigram(small, capsys):
    out, meta = small
    result = data.main(["unigram", "--data", str(out), "--vocab-size", "300"])
    train = split_tokens(out, "train").tolist()
    val = split_tokens(out, "val").tolist()
    bits = sum(-np.log2((train.count(t) + 1) / (len(train) + 300)) for t in val[1:])
    assert result["val_bytes"] == meta["val_bytes"]  # the same denominator as val_bpb
    assert result["unigram_bpb"] == pytest.approx(bits / meta["val_bytes"], rel=1e-9)
    assert "unigram_bpb:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"error: {out.parent}: 0 train and 0 val shards; expected fineweb_train_"):
        data.main(["unigram", "--data", str(out.parent), "--vocab-size", "300"])  # not a prepared folder


def test_manpages_corpus_keeps_the_words_of_a_man_page_and_drops_its_markup():
    spec = importlib.util.spec_from_file_location("manpages_corpus", Path(__file__).parent.parent / "sweeps" / "manpages_corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    source = "\n".join([
        '.\\" a comment', ".TH LS 1", ".SH NAME", "ls \\- list directory contents", ".SH SYNOPSIS",
        ".B ls", "[\\fIOPTION\\fR]... [\\fIFILE\\fR]...", ".PP", "List \\(em \\*(lqfiles\\*(rq, sizes in \\s-1KB\\s0.",
        ".BR dir (1)", "a \\e backslash and a \\& zero-width join",
    ])
    assert corpus.strip_troff(source) == (
        "NAME\nls - list directory contents\nSYNOPSIS\nls\n[OPTION]... [FILE]...\n"
        "List - files, sizes in KB.\ndir (1)\na \\ backslash and a  zero-width join\n")
