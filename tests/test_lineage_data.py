"""The competition lineage's row pool (FrontierForge K82s4, make_stream_dataloader's FF_ROW_SHUFFLE and
FF_ROW_SHUFFLE_FROM) as data.row_pool and data.row_pool_from: off, the loader's batches and positions as before;
on, every row the stream gave is drawn once or still pooled, the first row_pool_from micro-batches come in stream
order, the draws are the swap-with-last rule of a generator seeded by the run's seed and the rank, and a loader or a
run resumed from its state is the uninterrupted one to the bit. And data.order=replay (another program's rows, in
their order): a run on recorded rows is the run that read them, to the bit."""
import dataclasses
import io
import random
from collections import Counter

import numpy as np
import pytest
import torch

import clock
import config
import data
import train
from config import ConfigError, load_config
from data import DataError
from test_kit_contract import ROOT, SMOKE, calibrated, kit_args, kit_task  # noqa: F401 (a fixture)
from test_kit_data import BOS, make_docs, write_docs

ORDERS = ("contiguous", "packed")


def loaders(tmp_path, order):
    """-> make(**kw): loaders of rows of seq_len + 1 = 17 tokens, 4 a micro-batch, over a stream whose rows are all
    different within its first epoch: contiguous reads tokens that are their own positions, packed documents whose
    tokens name the document."""
    if order == "contiguous":
        files = [tmp_path / "fineweb_train_000000.bin", tmp_path / "fineweb_train_000001.bin"]
        data.write_shard(files[0], np.arange(30000, dtype=np.uint16))
        data.write_shard(files[1], np.arange(30000, 60000, dtype=np.uint16))
    else:
        files = write_docs(tmp_path, make_docs(3000, random.Random(5), longest=60), cut=20011)

    def make(batch_size=4, seq_len=16, **kw):
        return data.TrainLoader(files, batch_size, seq_len, 65536, order=order, bos_id=BOS, **kw)
    return make


def drained(loader, n):
    """The rows of a loader's first n micro-batches; the loader is closed."""
    rows = rows_of(loader, n)
    loader.close()
    return rows


def rows_of(loader, n):
    """The rows (seq_len + 1 tokens, as tuples) of the loader's next n micro-batches."""
    out = []
    for _ in range(n):
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x[:, 1:], y[:, :-1])
        out += map(tuple, torch.cat([x, y[:, -1:]], 1).tolist())
    return out


def pooled(state):
    return [tuple(row.tolist()) for row in state["pool"]["rows"]]


def by_hand(stream, b, size, start, n, seed, rank=0):
    """The lineage's pool over a stream of rows, b a micro-batch: the first `start` micro-batches in order, then
    the buffer topped up to (size + 1) * b rows before each draw of b rows, each pick j uniform in
    [0, len(buffer)), swapped with the last row and popped, by random.Random(seed * 7919 + rank + 7777 * 4)."""
    rng, out, pool, read = random.Random(seed * 7919 + rank + 7777 * 4), [], [], 0
    for k in range(n):
        if k < start:
            out += stream[read:read + b]
            read += b
            continue
        while len(pool) < (size + 1) * b:
            pool += stream[read:read + b]
            read += b
        for _ in range(b):
            j = rng.randrange(len(pool))
            pool[j], pool[-1] = pool[-1], pool[j]
            out.append(pool.pop())
    return out, pool


def checkpointed(state):
    """The state through a checkpoint file: torch.save, then torch.load with weights_only=True."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def same_state(a, b):
    """Loader states equal: the pool's rows tensor by tensor, the rest as values."""
    rest = [{k: v for k, v in s.items() if k != "pool"} for s in (a, b)]
    pools = [{k: v for k, v in s["pool"].items() if k != "rows"} for s in (a, b)]
    return rest[0] == rest[1] and pools[0] == pools[1] and len(a["pool"]["rows"]) == len(b["pool"]["rows"]) and all(
        torch.equal(r, s) for r, s in zip(a["pool"]["rows"], b["pool"]["rows"]))


# -- off: the loader as it was -------------------------------------------------------------------------------

@pytest.mark.parametrize("order", [o for o in data.ORDERS if o != "replay"])  # a replay never has a pool
def test_off_the_batches_and_positions_are_the_streams(tmp_path, order):
    make = loaders(tmp_path, order)
    before, off = make(prefetch=0), make(prefetch=2, row_pool=0, row_pool_from=0)
    for _ in range(30):
        (x, y), (x_off, y_off) = before.next_batch(), off.next_batch()
        assert torch.equal(x, x_off) and torch.equal(y, y_off)
        assert off.state_dict() == before.state_dict() and "pool" not in off.state_dict()
    if order == "contiguous":  # the stream by hand: 64 tokens a micro-batch, the first 30 of them
        assert torch.equal(x.flatten(), torch.arange(29 * 64, 30 * 64)) and torch.equal(y.flatten(), x.flatten() + 1)
    before.close()
    off.close()


# -- on: the lineage's rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("prefetch", [0, 3])
def test_every_row_read_is_drawn_once_or_still_pooled(tmp_path, order, prefetch):
    make = loaders(tmp_path, order)
    b, size, start, n = 4, 6, 3, 40
    stream = drained(make(prefetch=0), 60)
    loader = make(prefetch=prefetch, row_pool=size, row_pool_from=start)
    drawn = []
    for k in range(n):
        drawn += rows_of(loader, 1)
        state = loader.state_dict()
        assert state["pool"]["emitted"] == k + 1
        # In order first; then each draw from the stream's first start + size + 1 + k' micro-batches (one in, one
        # out), size micro-batches' rows staying after it.
        read = k + 1 if k < start else start + size + 1 + (k - start)
        assert len(state["pool"]["rows"]) == (read - k - 1) * b == (0 if k < start else size * b)
        assert set(drawn[-b:]) <= set(stream[:read * b])
    assert drawn[:start * b] == stream[:start * b]  # the first row_pool_from micro-batches: the stream's, in order
    read = start + size + 1 + (n - start - 1)
    assert Counter(drawn + pooled(state)) == Counter(stream[:read * b])  # nothing lost, nothing doubled
    assert drawn[start * b:] != stream[start * b:n * b]  # another order than the stream's
    assert (drawn, pooled(state)) == by_hand(stream, b, size, start, n, seed=0)
    loader.close()


def test_the_lineage_numbers_2056_rows_then_2048(tmp_path):
    """K82s4's pool on its micro-batch of 8 rows: 96 micro-batches in order, then 257 * 8 = 2056 rows pooled before
    the first draw, 2048 after it and after every later one; the draws are the hand-made ones for seed 73."""
    make = loaders(tmp_path, "contiguous")
    stream = drained(make(batch_size=8, seq_len=4, prefetch=0), 96 + 257 + 30)
    loader = make(batch_size=8, seq_len=4, prefetch=2, row_pool=256, row_pool_from=96, seed=73)
    drawn = rows_of(loader, 96)
    assert drawn == stream[:96 * 8] and loader.state_dict()["pool"]["rows"] == []
    drawn += rows_of(loader, 1)
    assert len(loader.state_dict()["pool"]["rows"]) == 2048
    drawn += rows_of(loader, 29)
    assert len(loader.state_dict()["pool"]["rows"]) == 2048
    assert (drawn, pooled(loader.state_dict())) == by_hand(stream, 8, 256, 96, 126, seed=73)
    loader.close()


@pytest.mark.parametrize("order", ORDERS)
def test_the_seed_decides_the_order(tmp_path, order):
    make = loaders(tmp_path, order)
    assert drained(make(seed=1), 20) == drained(make(seed=2), 20)  # the stream is the same for every seed
    first = drained(make(seed=1, row_pool=4, row_pool_from=2), 20)
    assert first == drained(make(seed=1, row_pool=4, row_pool_from=2, prefetch=0), 20)
    other = drained(make(seed=2, row_pool=4, row_pool_from=2), 20)
    assert other != first and other[:8] == first[:8]  # the same rows in order before the pool starts


@pytest.mark.parametrize("order", ORDERS)
def test_ranks_have_their_own_rows_pool_and_generator(tmp_path, order):
    make = loaders(tmp_path, order)
    own = [drained(make(batch_size=2, rank=r, world_size=2), 60) for r in range(2)]
    drawn = [drained(make(batch_size=2, rank=r, world_size=2, row_pool=5, row_pool_from=1, seed=7), 30)
             for r in range(2)]
    assert not set(drawn[0]) & set(drawn[1])  # disjoint: each rank pools its own share of the stream
    for r in range(2):
        assert drawn[r] == by_hand(own[r], 2, 5, 1, 30, seed=7, rank=r)[0]
    # Each rank's generator: its draws take other positions of its stream than the other rank's.
    assert [own[0].index(row) for row in drawn[0]] != [own[1].index(row) for row in drawn[1]]


# -- resume ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("at", [1, 9])  # inside the in-order micro-batches, inside the pool's draws
def test_a_loader_resumed_from_its_state_is_the_uninterrupted_one(tmp_path, order, at):
    make = loaders(tmp_path, order)
    whole = make(prefetch=2, row_pool=4, row_pool_from=3)
    rows_of(whole, at)
    state = whole.state_dict()
    saved = checkpointed(state)  # a checkpoint holds it: tensors, plain ints, lists and tuples
    expected = rows_of(whole, 25)
    after = whole.state_dict()
    whole.close()
    for prefetch in (0, 3):
        resumed = make(prefetch=prefetch, row_pool=4, row_pool_from=3)
        resumed.next_batch()  # its read-ahead ran before the restore
        resumed.load_state_dict(saved)
        assert rows_of(resumed, 25) == expected and same_state(resumed.state_dict(), after)
        resumed.close()  # stops the read-ahead, keeps the position
        assert same_state(resumed.state_dict(), after)


def test_a_state_carries_on_at_another_batch_shape_and_refuses_what_it_cannot(tmp_path):
    make = loaders(tmp_path, "packed")
    loader = make(row_pool=4, row_pool_from=1)
    drawn = rows_of(loader, 6)
    state = loader.state_dict()
    held = pooled(state)
    assert len(held) == 16
    wider = make(batch_size=8, row_pool=4, row_pool_from=1)  # an annealing stage's rows per micro-batch
    wider.load_state_dict(state)
    more = rows_of(wider, 10)
    assert len(set(drawn + more + pooled(wider.state_dict()))) == len(drawn + more + pooled(wider.state_dict()))
    assert set(held) <= set(more + pooled(wider.state_dict()))  # the pooled rows are drawn or still pooled
    assert len(wider.state_dict()["pool"]["rows"]) == 4 * 8
    wider.close()
    longer, without = make(seq_len=32, row_pool=4, prefetch=0), make(prefetch=0)
    with pytest.raises(DataError, match=r"row pool holds rows of 17 tokens, this loader reads rows of seq_len \+ 1 = 33"):
        longer.load_state_dict(state)
    with pytest.raises(DataError, match=r"holds 16 rows in its row pool, this loader has none \(data.row_pool=0\)"):
        without.load_state_dict(state)
    fresh = make(row_pool=4, row_pool_from=1)  # a position of no pool: the pool starts there
    fresh.load_state_dict(make(prefetch=0).state_dict())
    assert drained(fresh, 1) == drained(make(), 1)
    loader.close()


def test_a_packed_run_with_the_pool_resumed_is_the_uninterrupted_run_to_the_bit(tmp_path, kit_task):
    """The pool (rows, generator, count) in train.py's checkpoint: 3 steps of 2 micro-batches, a resume to 6, against
    6; the pool starts after 2 micro-batches and holds 3 of 4 rows."""
    whole = calibrated(tmp_path, kit_args(tmp_path, kit_task, "budget.max_steps=6", "data.prefetch=2",
                                          "data.row_pool=3", "data.row_pool_from=2"))
    train.main(["--config", str(SMOKE), *whole, f"checkpoint.path={tmp_path / 'whole.pt'}"])
    train.main(["--config", str(SMOKE), *whole, "budget.max_steps=3", f"checkpoint.path={tmp_path / 'half.pt'}"])
    train.main(["--config", str(SMOKE), *whole, f"checkpoint.resume={tmp_path / 'half.pt'}",
                f"checkpoint.path={tmp_path / 'resumed.pt'}"])
    half, a, b = (train.load_checkpoint(tmp_path / name) for name in ("half.pt", "whole.pt", "resumed.pt"))
    assert half["loader"]["pool"]["emitted"] == 6 and len(half["loader"]["pool"]["rows"]) == 3 * 4
    assert a["step"] == b["step"] == 6 and a["loader"]["order"] == "packed" and same_state(a["loader"], b["loader"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


# -- config ---------------------------------------------------------------------------------------------------

def test_the_keys_at_their_base_value_keep_the_recipe_and_the_cost():
    keys = ("data.row_pool", "data.row_pool_from")
    assert all(k in config.RECIPE_NEUTRAL and k not in config.RECIPE_IGNORED and k in clock.COST_IGNORED for k in keys)
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    assert [flat[k] for k in keys] == [0, 0]
    assert config.recipe(flat, "data") == config.recipe({k: v for k, v in flat.items() if k not in keys}, "data")
    on = config.flatten(dataclasses.asdict(load_config(SMOKE, ["data.order=packed", "data.row_pool=256",
                                                               "data.row_pool_from=96"])))
    off = {**on, "data.row_pool": 0, "data.row_pool_from": 0}
    assert config.recipe(on, "data") != config.recipe(off, "data")  # what a step learns
    stage = config.resolve_stages(load_config(SMOKE))[0]
    assert clock.stage_key(on, "data", stage) == clock.stage_key(off, "data", stage)  # not what it computes


@pytest.mark.parametrize("overrides, message", [
    (["data.row_pool=-1"], "data.row_pool: expected >= 0, got -1"),
    (["data.order=packed", "data.row_pool=4", "data.row_pool_from=-2"], "data.row_pool_from: expected >= 0, got -2"),
    (["data.row_pool=4"], "data.row_pool=4: pools the rows of an ordered stream, and data.order=shuffle already draws "
                          "its rows at random; expected data.order contiguous or packed, or data.row_pool=0"),
    (["data.order=contiguous", "data.row_pool_from=3"], "data.row_pool_from=3: the micro-batches before the row pool "
                                                        "starts, but data.row_pool=0 (no pool)"),
    (["data.order=contiguous", "data.row_pool=4", "schedule.stages=[{at: 0, seq_len: 32}, {at: 0.5, seq_len: 64}]"],
     "data.row_pool=4: the pool holds rows of data.seq_len (64) tokens, but a schedule stage sets seq_len 32"),
    (["data.order=replay"], "data.order=replay, data.replay='': a replay trains on the rows of the file data.replay"),
    (["data.replay=rows.bin"], "data.order=shuffle, data.replay='rows.bin': a replay trains on the rows"),
    (["data.order=replay", "data.replay=rows.bin", "data.row_pool=4"],
     "data.row_pool=4: data.replay's rows are replayed in the order they were trained on; expected data.row_pool=0"),
    (["data.order=replay", "data.replay=rows.bin", "schedule.stages=[{at: 0, seq_len: 32}, {at: 0.5}]"],
     "data.replay=rows.bin: holds rows of data.seq_len (64) + 1 tokens, but a schedule stage sets seq_len 32"),
])
def test_config_errors_name_the_key_and_value(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, overrides)
    assert message in str(e.value)


# -- replay ---------------------------------------------------------------------------------------------------

def replay_file(tmp_path, rows, length=17):
    """A replay of `rows` rows of `length` tokens, row i's tokens all i (rows of seq_len 16 + 1 by default)."""
    path = tmp_path / "rows.bin"
    data.write_shard(path, np.repeat(np.arange(rows, dtype=np.uint16), length))
    return path


def test_a_replay_gives_its_rows_in_order_split_by_rank_and_resumes(tmp_path):
    path = replay_file(tmp_path, 24)
    loader = data.TrainLoader([path], 4, 16, 65536, order="replay", prefetch=2)
    x, y = loader.next_batch()
    assert x[:, 0].tolist() == [0, 1, 2, 3] and torch.equal(x[:, 1:], y[:, :-1]) and y[:, -1].tolist() == [0, 1, 2, 3]
    state = loader.state_dict()
    assert loader.next_batch()[0][:, 0].tolist() == [4, 5, 6, 7]
    loader.close()
    again = data.TrainLoader([path], 2, 16, 65536, order="replay", prefetch=0)  # another stage's rows a step
    again.load_state_dict(state)
    assert [again.next_batch()[0][:, 0].tolist() for _ in range(2)] == [[4, 5], [6, 7]]
    ranks = [data.TrainLoader([path], 2, 16, 65536, rank=r, world_size=2, order="replay", prefetch=0) for r in (0, 1)]
    assert [[rank.next_batch()[0][:, 0].tolist() for rank in ranks] for _ in range(2)] == [[[0, 1], [2, 3]],
                                                                                           [[4, 5], [6, 7]]]
    short = data.TrainLoader([path], 10, 16, 65536, order="replay", prefetch=0)
    assert [short.next_batch()[0][:, 0].tolist()[::9] for _ in range(3)] == [[0, 9], [10, 19], [0, 9]]
    assert short.epoch == 1  # 4 rows did not fill a step: the first again, as the stream orders do
    with pytest.raises(DataError, match="expected one file of rows of seq_len \\+ 1 = 33 tokens"):
        data.TrainLoader([path], 4, 32, 65536, order="replay", prefetch=0)


def test_a_run_on_recorded_rows_is_the_run_that_read_them_to_the_bit(tmp_path, builtin_1024):
    """smoke.yaml on the contiguous stream for 4 steps, then on a replay of the rows it read (each row its inputs and
    last target): the same weights, bit for bit."""
    common = [f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
              f"run.out_dir={tmp_path / 'runs'}", "budget.max_steps=4", "run.profile_steps=0", "eval.tokens=1024"]
    cfg = load_config(SMOKE, [*common, "data.order=contiguous"])
    loader = data.TrainLoader(train.open_data(cfg)[0], cfg.optim.micro_batch, 64, 1024, order="contiguous", prefetch=0)
    rows = [torch.cat([x, y[:, -1:]], 1) for x, y in (loader.next_batch() for _ in range(4 * config.accum_steps(cfg, 1)))]
    data.write_shard(tmp_path / "rows.bin", torch.cat(rows).numpy().astype(np.uint16).ravel())
    for name, order in (("read", ["data.order=contiguous"]),
                        ("replayed", ["data.order=replay", f"data.replay={tmp_path / 'rows.bin'}"])):
        assert train.main(["--config", str(SMOKE), *common, *order, f"checkpoint.path={tmp_path / name}.pt"]) == 0
    read, replayed = (train.load_checkpoint(tmp_path / f"{name}.pt")["model"] for name in ("read", "replayed"))
    assert all(torch.equal(read[k], replayed[k]) for k in read)


def test_a_missing_replay_is_named_before_training(tmp_path, builtin_1024, capsys):
    assert train.main(["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}", "data.order=replay",
                       f"data.replay={tmp_path / 'none.bin'}", f"ledger.path={tmp_path / 'ledger.csv'}",
                       f"run.out_dir={tmp_path / 'runs'}"]) == 2
    assert f"data.replay={tmp_path / 'none.bin'}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "ledger.csv").exists()
