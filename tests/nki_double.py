"""A numpy test double of the parts of the NKI API (standalone namespace, NKI 0.3+) that the kernels
in kernels/nki_*.py call, so that the kernels' own source runs unmodified on a CPU in CI.

`installed()` puts fake `nki`, `nki.language` and `nki.isa` modules into sys.modules for the
duration of a `with` block; a kernel module imported inside it binds to them (import it with
`load_kernel_module`, which also removes it from sys.modules afterwards, so nothing else sees the
double). `nki.jit` runs the Python function directly: numpy arrays become HBM tensors, returned
HBM tensors become numpy arrays again.

Semantics are those the NKI API reference states (awsdocs-neuron, nki/api/generated/nki.isa.*):
nc_matmul computes dst = stationary.T @ moving in fp32 and overwrites dst or, with
accumulate=True, adds to it; activation computes op(data * scale + bias); tensor_scalar broadcasts
a (P, 1) operand along the free dimension; tensor_reduce reduces the free axis; iota writes
offset + channel * channel_multiplier + sum(step * index); memset, tensor_copy, dma_copy copy
with a cast to the destination's dtype. bfloat16 tiles hold float32 values rounded to bfloat16
(round to nearest even) on every write, so bf16 kernels round where the hardware would store.

Shape and placement rules, asserted on every call (nki/guides/architecture/trainium2_arch and the
nc_matmul page): an on-chip tile has at most 128 partitions (its first dimension); a PSUM tile is
fp32 and at most 2 KiB per partition (512 fp32, one bank); nc_matmul reads SBUF and writes PSUM,
contraction (partition) dims equal and <= 128, stationary free dim <= 128, moving free dim <= 512;
the first matmul into a PSUM location overwrites (accumulate=True onto a location that no matmul
wrote is undefined behaviour on trn2); nc_transpose reads SBUF (at most 128 x 128) and writes
PSUM; compute instructions read and write on-chip tiles only, DMA moves between HBM and SBUF;
elementwise operands have the destination's partition count and shape; every nisa call takes its
destination first and returns nothing.

Fresh allocations (on chip and in HBM) hold NaN, so a kernel that reads memory no instruction
wrote, or leaves part of an output unwritten, fails its test instead of passing on zeros.

What passing tests on this double proves: the kernels' index math, tiling and partial tiles
(masking by static slices), that every output element is written and nothing unwritten is read, the order of accumulation (online log-sum-exp, PSUM accumulation
groups), the math of forward and backward against the reference in numpy fp32 (and bf16 rounding
at the stores), and that every tile and instruction respects the shape and buffer rules above.
What it does not prove: that the Neuron compiler accepts the kernels (tracing rules, loop
lowering, SBUF/PSUM capacity and allocation, engine choice), hardware numerics (activation
function approximations, fp32 vs bf16 matmul paths), performance, memory placement beyond the
checks above, or the XLA and TorchNeuron call paths (custom-call lowering, custom-op
registration on a Neuron device).
"""

import contextlib
import importlib
import sys
import types

import numpy as np

PMAX = 128  # partitions of SBUF and PSUM
PSUM_FMAX = 512  # fp32 elements per partition in one PSUM bank (2 KiB)
STATIONARY_FMAX = 128
MOVING_FMAX = 512


class DType:
    def __init__(self, name, storage):
        self.name, self.storage = name, storage

    def __repr__(self):
        return f"nl.{self.name}"


float32 = DType("float32", np.float32)
bfloat16 = DType("bfloat16", np.float32)  # values rounded to bf16, stored as float32
int32 = DType("int32", np.int32)
NUMPY_DTYPES = {np.dtype(np.float32): float32, np.dtype(np.int32): int32}


def round_bf16(values):
    """float32 -> nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def cast(values, dtype):
    values = np.asarray(values)
    if dtype is bfloat16:
        return round_bf16(values.astype(np.float32))
    return values.astype(dtype.storage)


class Tensor:
    """A tile (or HBM tensor): a numpy view plus its dtype and buffer. Slicing gives a view.
    `root` is the allocation; for PSUM it carries which elements a matmul wrote last."""

    def __init__(self, data, dtype, buffer, root=None):
        self.data, self.dtype, self.buffer = data, dtype, buffer
        self.root = root if root is not None else self
        if root is None and buffer == "psum":
            self.matmul_written = np.zeros(data.shape, dtype=bool)

    @property
    def shape(self):
        return self.data.shape

    def __getitem__(self, index):
        assert self.root is self, "slice an allocation, not a slice"
        view = Tensor(self.data[index], self.dtype, self.buffer, self.root)
        view.index = index
        return view

    def write(self, values, by_matmul=False):
        values = np.asarray(values)
        assert values.shape == self.shape, (values.shape, self.shape)
        self.data[...] = cast(values, self.dtype)
        if self.buffer == "psum":
            region = self.root.matmul_written[getattr(self, "index", Ellipsis)]
            region[...] = by_matmul

    def read(self):
        return self.data.astype(np.float32) if self.dtype is not int32 else self.data


def ndarray(shape, dtype, buffer):
    shape = tuple(int(s) for s in shape)
    assert buffer in ("sbuf", "psum", "shared_hbm"), f"unknown buffer {buffer!r}"
    if buffer != "shared_hbm":
        assert shape[0] <= PMAX, f"{buffer} tile {shape}: partition dim > {PMAX}"
    if buffer == "psum":
        assert dtype is float32, f"PSUM tile {shape} must be fp32, got {dtype}"
        assert int(np.prod(shape[1:])) <= PSUM_FMAX, f"PSUM tile {shape}: > {PSUM_FMAX} fp32 per partition"
    # Fresh memory holds NaN (int32: a sentinel), so a read of anything no instruction wrote
    # poisons what depends on it instead of passing as zeros.
    fill = np.iinfo(np.int32).min if dtype is int32 else np.nan
    return Tensor(np.full(shape, fill, dtype=dtype.storage), dtype, buffer)


def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


def _on_chip(*tensors):
    for t in tensors:
        assert isinstance(t, Tensor) and t.buffer in ("sbuf", "psum"), f"compute operand not on chip: {t}"


def _operand(value, dst):
    """A (P, 1) per-partition tile or a Python scalar, broadcast along dst's free dims."""
    if isinstance(value, Tensor):
        _on_chip(value)
        assert value.shape == (dst.shape[0], 1), f"vector operand {value.shape} for dst {dst.shape}"
        return value.read().reshape((dst.shape[0],) + (1,) * (len(dst.shape) - 1))
    assert isinstance(value, (int, float)), value
    return np.float32(value)


def _same(dst, *data):
    _on_chip(dst, *data)
    for d in data:
        assert d.shape == dst.shape, f"operand {d.shape} != dst {dst.shape}"


class Op:
    """An nki.language operator: elementwise on numpy operands; `reducer` for tensor_reduce."""

    def __init__(self, name, fn, reducer=None):
        self.name, self.fn, self.reducer = name, fn, reducer

    def __call__(self, *operands):
        return self.fn(*operands)

    def __repr__(self):
        return f"nl.{self.name}"


OPS = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
    "equal": lambda a, b: (a == b).astype(np.float32),
    "exp": np.exp, "log": np.log, "tanh": np.tanh, "relu": lambda a: np.maximum(a, 0),
    "rsqrt": lambda a: 1 / np.sqrt(a), "copy": lambda a: a,
}
REDUCERS = {"add": np.sum, "maximum": np.max}


def dma_copy(dst, src):
    assert isinstance(dst, Tensor) and isinstance(src, Tensor)
    assert "psum" not in (dst.buffer, src.buffer), "DMA moves between HBM and SBUF"
    assert "shared_hbm" in (dst.buffer, src.buffer), "DMA here moves between HBM and SBUF"
    assert dst.data.size == src.data.size, f"dma {src.shape} -> {dst.shape}"
    dst.write(src.read().reshape(dst.shape))


def memset(dst, value):
    _on_chip(dst)
    dst.write(np.full(dst.shape, value, dtype=np.float32))


def tensor_copy(dst, src):
    _same(dst, src)
    dst.write(src.read())


def tensor_tensor(dst, data1, data2, op):
    _same(dst, data1, data2)
    dst.write(op(data1.read(), data2.read()))


def tensor_scalar(dst, data, op0, operand0):
    _same(dst, data)
    dst.write(op0(data.read(), _operand(operand0, dst)))


def tensor_reduce(dst, op, data, axis):
    _on_chip(dst, data)
    assert axis == 1 and len(data.shape) == 2, "reduce the free axis of a 2D tile"
    assert dst.shape == (data.shape[0], 1), (dst.shape, data.shape)
    dst.write(op.reducer(data.read(), axis=1, keepdims=True))


def activation(dst, op, data, bias=None, scale=1.0):
    _same(dst, data)
    pre = data.read() * _operand(scale, dst)
    if bias is not None:
        pre = pre + _operand(bias, dst)
    dst.write(op(pre))


def iota(dst, pattern, offset, channel_multiplier=0):
    _on_chip(dst)
    assert dst.buffer == "sbuf", "iota writes SBUF"
    values = np.full(dst.shape[0], offset, dtype=np.int64)[:, None] + channel_multiplier * np.arange(dst.shape[0])[:, None]
    free = np.zeros(1, dtype=np.int64)
    for step, count in pattern:
        free = (free[:, None] + step * np.arange(count)[None, :]).reshape(-1)
    assert free.size == int(np.prod(dst.shape[1:])), (pattern, dst.shape)
    dst.write((values + free[None, :]).reshape(dst.shape))


def nc_matmul(dst, stationary, moving, accumulate=False):
    assert dst.buffer == "psum" and stationary.buffer == "sbuf" and moving.buffer == "sbuf"
    k, m = stationary.shape
    k2, f = moving.shape
    assert k == k2 <= PMAX, f"contraction dims {k}, {k2} (<= {PMAX})"
    assert m <= STATIONARY_FMAX and f <= MOVING_FMAX, f"stationary free {m}, moving free {f}"
    assert stationary.dtype is moving.dtype, (stationary.dtype, moving.dtype)
    assert dst.shape == (m, f), f"dst {dst.shape} != ({m}, {f})"
    assert isinstance(accumulate, bool), "pass accumulate explicitly"
    product = stationary.read().T @ moving.read()
    if accumulate:
        region = dst.root.matmul_written[getattr(dst, "index", Ellipsis)]
        assert region.all(), "accumulate onto PSUM that no matmul wrote (undefined on trn2)"
        product = dst.read() + product
    dst.write(product, by_matmul=True)


def nc_transpose(dst, data):
    assert dst.buffer == "psum" and data.buffer == "sbuf"
    assert len(data.shape) == 2 and max(data.shape) <= PMAX, data.shape
    assert dst.shape == data.shape[::-1], (dst.shape, data.shape)
    dst.write(data.read().T)


def _to_hbm(arg):
    """numpy arrays and CPU torch tensors become HBM tensors; scalars pass through."""
    import torch

    if isinstance(arg, torch.Tensor):
        dtype = {torch.float32: float32, torch.bfloat16: bfloat16, torch.int32: int32}[arg.dtype]
        values = arg.detach().numpy() if dtype is int32 else arg.detach().float().numpy()
        return Tensor(values.copy(), dtype, "shared_hbm")
    if isinstance(arg, np.ndarray):
        return Tensor(arg.copy(), NUMPY_DTYPES[arg.dtype], "shared_hbm")
    return arg


def _from_hbm(tensor, as_torch):
    assert tensor.buffer == "shared_hbm", "kernel outputs live in shared HBM"
    if not as_torch:
        return tensor.data.copy()
    import torch

    values = torch.from_numpy(tensor.data.copy())
    return values.to(torch.bfloat16) if tensor.dtype is bfloat16 else values


def jit(function):
    """Runs the kernel at once. Arguments: numpy arrays, CPU torch tensors (fp32, bf16, int32)
    or Python scalars; outputs come back as torch tensors if any argument was one, else numpy."""

    def run(*args):
        import torch

        as_torch = any(isinstance(a, torch.Tensor) for a in args)
        out = function(*(_to_hbm(a) for a in args))
        if isinstance(out, tuple):
            return tuple(_from_hbm(o, as_torch) for o in out)
        return _from_hbm(out, as_torch)

    return run


def _modules():
    nki = types.ModuleType("nki")
    nl = types.ModuleType("nki.language")
    nisa = types.ModuleType("nki.isa")
    nki.jit, nki.language, nki.isa = jit, nl, nisa
    nl.ndarray, nl.affine_range = ndarray, affine_range
    nl.sbuf, nl.psum, nl.shared_hbm = "sbuf", "psum", "shared_hbm"
    nl.float32, nl.bfloat16, nl.int32 = float32, bfloat16, int32
    nl.tile_size = types.SimpleNamespace(pmax=PMAX, psum_fmax=PSUM_FMAX, gemm_stationary_fmax=STATIONARY_FMAX,
                                         gemm_moving_fmax=MOVING_FMAX)
    for name, fn in OPS.items():
        setattr(nl, name, Op(name, fn, REDUCERS.get(name)))
    for fn in (dma_copy, memset, tensor_copy, tensor_tensor, tensor_scalar, tensor_reduce, activation, iota,
               nc_matmul, nc_transpose):
        setattr(nisa, fn.__name__, fn)
    return {"nki": nki, "nki.language": nl, "nki.isa": nisa}


@contextlib.contextmanager
def installed():
    """Fake nki modules in sys.modules for the block; what was there before is restored."""
    fakes = _modules()
    saved = {name: sys.modules.get(name) for name in fakes}
    sys.modules.update(fakes)
    try:
        yield fakes["nki"]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


_loaded = {}


def load_kernel_module(name):
    """Import kernels.<name> bound to the double, and take it (and kernels.nki_common) out of
    sys.modules again. Loaded once per process: a module registers its torch custom ops at import."""
    if name not in _loaded:
        before = set(sys.modules)
        with installed():
            _loaded[name] = importlib.import_module(f"kernels.{name}")
        for module in set(sys.modules) - before:
            if module.startswith("kernels.nki_"):  # the module and kernels.nki_common, bound to the double
                del sys.modules[module]
                vars(sys.modules["kernels"]).pop(module.split(".")[1], None)
    return _loaded[name]
