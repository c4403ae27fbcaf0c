"""Batches for one data-parallel rank, from --data or the artifact's example batch.

A data source is a sequence of samples (rows): `inputs` (one or more tensors) and `targets`.
Global step s uses samples [s*G, (s+1)*G) of the order with G = B * dp (B the per-rank batch
size), and data-parallel rank r takes [s*G + r*B, s*G + (r+1)*B); sample k of the order is row
k mod N of the data (N rows), in epoch k // N. With `--shuffle SEED` sample k of epoch e reads row
`RowOrder(N, SEED, e)[k mod N]`: a keyed pseudo-random permutation of [0, N) (a 4-round Feistel
network over the next even power of two, walked until it lands in range), computed row by row:
nothing stored, no memory that grows with the data (a permutation tensor of a 4 GiB shard's 33
million windows held 1.3 GB per rank), the same on every rank, so a resumed run reads exactly the
samples the uninterrupted run would have.

`--data` is a file, a folder or a glob of shards, read in name order as one sequence:
- safetensors files of rows (`inputs` or `inputs.0`, ...; `targets`), memory-mapped: a rank reads
  the rows it uses, not the file;
- token streams, for a program whose one input and targets are [B, T] token ids: llm.c's `.bin`
  (a 256 x int32 header: magic 20240520, version, token count; uint16 tokens), a raw `.bin` of
  `--token-dtype` tokens, or a 1-D `.npy`; read with pread (the bytes of the windows asked for,
  nothing mapped) and cut into windows of T + 1 tokens
  (sample i is tokens [i*T, i*T + T]: inputs its first T, targets its last T), the shards one stream.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from runner.errors import AotError
from runner.format.axes import DATA_AXES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype `dtype_name` wrote as `name` ("float32" -> torch.float32)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise AotError(f"unknown dtype {name!r}")
    return dtype


def describe(shape, dtype: str) -> str:
    return f"[{', '.join(str(d) for d in shape)}] {dtype}"


def split_batch_tensors(tensors: dict[str, torch.Tensor], where: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`inputs` or `inputs.0`, `inputs.1`, ... and `targets` from a safetensors mapping."""
    if "targets" not in tensors:
        raise AotError(f"{where}: no tensor named 'targets' (has: {', '.join(sorted(tensors)) or 'nothing'})")
    if "inputs" in tensors:
        inputs = [tensors["inputs"]]
    else:
        inputs = []
        while f"inputs.{len(inputs)}" in tensors:
            inputs.append(tensors[f"inputs.{len(inputs)}"])
        if not inputs:
            raise AotError(f"{where}: no tensor named 'inputs' or 'inputs.0' (has: {', '.join(sorted(tensors))})")
    return inputs, tensors["targets"]


def data_rank_of(mesh: dict, coords: dict) -> tuple[int, int]:
    """(this rank's data rank, how many data ranks): ranks that differ along a data axis (dp,
    fsdp) read different rows; along the others (tp, pp) the same."""
    rank, size = 0, 1
    for axis, degree in zip(mesh["axes"], mesh["shape"]):
        if axis in DATA_AXES:
            rank, size = rank * degree + coords.get(axis, 0), size * degree
    return rank, size


class DataSource:
    """Rows as the step contract reads them; `read(start, stop)` gives rows [start, stop) of the
    whole data (inputs, targets), which may be tensors in memory or a reader of shards."""

    def __init__(self, inputs: list[torch.Tensor], targets: torch.Tensor, spec: dict, dp_rank: int, dp_size: int, where: str):
        _check_rows(inputs, targets, spec, where)
        self._init(targets.shape[0], lambda a, b: ([t[a:b] for t in inputs], targets[a:b]), spec, dp_rank, dp_size)

    def _init(self, rows: int, read, spec: dict, dp_rank: int, dp_size: int) -> None:
        self.read, self.rows, self._spec = read, rows, spec
        self.shuffle: int | None = None  # --shuffle SEED (see `shuffle_with`)
        self._epoch_order: tuple[int, RowOrder] | None = None
        self.batch_size = spec["batch_size"]
        self.global_batch = self.batch_size * dp_size
        self.offset = dp_rank * self.batch_size

    @classmethod
    def from_rows(cls, rows: int, read, spec: dict, dp_rank: int, dp_size: int) -> "DataSource":
        source = cls.__new__(cls)
        source._init(rows, read, spec, dp_rank, dp_size)
        return source

    @classmethod
    def from_file(cls, path: str | Path, spec: dict, dp_rank: int, dp_size: int, token_dtype: str | None = None) -> "DataSource":
        """--data PATH: a file, a folder or a glob of shards (the module docstring)."""
        shards = _shards(str(path))
        kinds = {_kind(p) for p in shards}
        if len(kinds) > 1:
            raise AotError(f"{path}: mixes {' and '.join(sorted(kinds))} shards; give one kind")
        kind = kinds.pop()
        if token_dtype is not None and kind == "safetensors":
            raise AotError("--token-dtype applies to token streams (.bin), not to safetensors rows")
        rows, read = _safetensors_rows(shards, spec) if kind == "safetensors" else _token_windows(shards, spec, token_dtype)
        return cls.from_rows(rows, read, spec, dp_rank, dp_size)

    def unread(self) -> "DataSource":
        """This source, reading nothing: every batch is the same zeros of the program's batch shapes,
        made once (for a rank whose program uses no tensor of the batch: a pipeline's middle stages)."""
        spec = self._spec
        zeros = (
            [torch.zeros(i["shape"], dtype=dtype_of(i["dtype"])) for i in spec["inputs"]],
            torch.zeros(spec["targets"]["shape"], dtype=dtype_of(spec["targets"]["dtype"])),
        )
        self.read = lambda a, b: zeros
        self.batch = lambda step: zeros  # type: ignore[method-assign]
        return self

    def shuffle_with(self, seed: int) -> "DataSource":
        """Read every epoch's rows in the seeded order of `RowOrder` (--shuffle SEED)."""
        self.shuffle = seed
        return self

    def batch(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        first = step * self.global_batch + self.offset
        if self.shuffle is not None:
            spans = [(r, r + 1) for r in (self._row(k) for k in range(first, first + self.batch_size))]
        else:  # contiguous rows, wrapping at the end of the data: one or two reads
            start, left, spans = first % self.rows, self.batch_size, []
            while left:
                stop = min(self.rows, start + left)
                spans.append((start, stop))
                left, start = left - (stop - start), 0
        return _joined([self.read(a, b) for a, b in spans])

    def _row(self, k: int) -> int:
        """The row that sample k of the shuffled order reads."""
        assert self.shuffle is not None  # _shuffled_batch calls it
        epoch = k // self.rows
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, RowOrder(self.rows, self.shuffle, epoch))
        return self._epoch_order[1][k % self.rows]


def _joined(parts: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(inputs, targets) read in parts, joined in order, contiguous: as the program was traced on
    (its views assume the example batch's strides)."""
    inputs = [torch.cat([p[0][i] for p in parts]).contiguous() for i in range(len(parts[0][0]))]
    return inputs, torch.cat([p[1] for p in parts]).contiguous()


SHUFFLE_ORDER = "feistel-4"  # what checkpoints record of --shuffle's order (runner.format.checkpoint.check_data_order)
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash whose every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class RowOrder:
    """Epoch `epoch`'s order of `rows` rows under --shuffle `seed`: `order[i]` is the row read i-th.
    A Feistel network is a permutation of [0, 4**h) whatever its round function; walking it from i
    until the value falls below `rows` (4**h < 4 * rows: a few steps) restricts it to a
    permutation of [0, rows) (cycle walking). Memory: four keys."""

    def __init__(self, rows: int, seed: int, epoch: int):
        self.rows = rows
        self.half = max(1, ((rows - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        base = _mix(seed * 1_000_003 + epoch)
        self.keys = [_mix(base + r) for r in range(4)]

    def __getitem__(self, i: int) -> int:
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
            x = (left << self.half) | right
            if x < self.rows:
                return x


def shuffled_rows(rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The whole order of epoch `epoch`'s rows under --shuffle `seed` (RowOrder's, for a reader
    that wants it at once: the tests)."""
    order = RowOrder(rows, seed, epoch)
    return torch.tensor([order[i] for i in range(rows)], dtype=torch.int64)


def _check_rows(inputs: list[torch.Tensor], targets: torch.Tensor, spec: dict, where: str) -> None:
    _check_shapes(inputs, targets, spec, where)
    rows = targets.shape[0]
    for i, tensor in enumerate(inputs):
        if tensor.shape[0] != rows:
            raise AotError(f"{where}: inputs.{i} has {tensor.shape[0]} samples but targets has {rows}")
    if rows == 0:
        raise AotError(f"{where}: holds no samples")


def _shards(path: str) -> list[Path]:
    """The files --data names, in name order: the file, a folder's data files, or a glob's matches."""
    given = Path(path)
    if given.is_dir():
        found = sorted(p for p in given.iterdir() if p.is_file() and _kind(p, strict=False))
        if not found:
            raise AotError(f"{path}: a folder without data shards (.safetensors, .bin, .npy)")
        return found
    if given.is_file():
        _kind(given)
        return [given]
    if any(c in path for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(path) if Path(p).is_file())
        if not found:
            raise AotError(f"{path}: the pattern matches no file")
        return found
    raise AotError(f"{path}: no such data file")


class Watched:
    """A shard as it was when the run opened it (size, modification time): each read of it first
    checks that it still is. A shard rewritten under a run would feed other samples than the
    run's order says (and a resumed run others again), without a word."""

    def __init__(self, path: Path):
        self.path = path
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def check(self) -> None:
        now = self._stamp()
        if now == self.stamp:
            return
        if now is None or self.stamp is None:
            what = "was removed"
        elif now[0] != self.stamp[0]:
            what = f"changed size ({self.stamp[0]} -> {now[0]} bytes)"
        else:
            what = "was rewritten"
        raise AotError(f"{self.path}: {what} during the run; a run reads its data as it was when it started (write new data to new files)")


def _kind(path: Path, strict: bool = True) -> str:
    kind = {".safetensors": "safetensors", ".bin": "token", ".npy": "token"}.get(path.suffix)
    if kind is None and strict:
        raise AotError(f"{path}: not a data shard (.safetensors rows, or tokens in .bin or .npy)")
    return kind or ""


def _safetensors_rows(shards: list[Path], spec: dict):
    """(rows, read) over safetensors shards of rows, each memory-mapped (safe_open)."""
    opened, starts, total = [], [], 0
    for shard in shards:
        try:
            handle = safe_open(str(shard), framework="pt")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise AotError(f"{shard}: not a readable safetensors file ({e})") from None
        # the rows' shapes and dtypes checked on an empty slice of each tensor
        empty = {n: handle.get_slice(n)[0:0] for n in names}
        inputs, targets = split_batch_tensors(empty, str(shard))
        lengths = {n: handle.get_slice(n).get_shape()[0] if handle.get_slice(n).get_shape() else 0 for n in names}
        rows = lengths["targets"]
        for n, length in lengths.items():
            if length != rows:
                raise AotError(f"{shard}: {n} has {length} samples but targets has {rows}")
        _check_shapes(inputs, targets, spec, str(shard))
        if rows == 0:
            raise AotError(f"{shard}: holds no samples")
        input_names = ["inputs"] if "inputs" in names else [f"inputs.{i}" for i in range(len(inputs))]
        opened.append((handle, input_names, Watched(shard)))
        starts.append(total)
        total += rows

    bounds = [*((want.get("below"), True) for want in spec["inputs"]), (spec["targets"].get("below"), False)]  # (bound, an input)

    def read(a: int, b: int):
        parts = []
        for (handle, input_names, watched), first, last in zip(opened, starts, [*starts[1:], total]):
            lo, hi = max(a, first), min(b, last)
            if lo < hi:
                watched.check()
                part = ([handle.get_slice(n)[lo - first : hi - first] for n in input_names], handle.get_slice("targets")[lo - first : hi - first])
                for (below, is_input), name, tensor in zip(bounds, [*input_names, "targets"], [*part[0], part[1]]):
                    if below is not None:
                        _check_ids(tensor, below, is_input, lambda at: f"{watched.path}: {name} row {lo - first + at[0]}, position {list(at[1:])}")
                parts.append(part)
        return _joined(parts)

    return total, read


def _check_ids(tensor, below: int, is_input: bool, where) -> None:
    """Refuse a token id at or above `below` (the model's vocabulary: FORMAT.md, `data.below`), or
    a negative input id (targets may hold a loss's negative ignore_index), in one line naming
    `where(index)` (the index of the first one in `tensor`): not an index error inside a step."""
    values = torch.as_tensor(tensor)
    bad = (values >= below) | (values < 0) if is_input else values >= below
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise AotError(f"{where(at)}: token id {int(values[at])} is outside the model's vocabulary of {below} (ids 0..{below - 1})")


def _check_shapes(inputs: list[torch.Tensor], targets: torch.Tensor, spec: dict, where: str) -> None:
    """Each tensor's sample shape and dtype against the program's (`spec`)."""
    expected = spec["inputs"]
    if len(inputs) != len(expected):
        raise AotError(f"{where}: the program takes {len(expected)} input tensor(s), the data has {len(inputs)}")
    for name, tensor, want in [*((f"inputs.{i}", t, w) for i, (t, w) in enumerate(zip(inputs, expected))), ("targets", targets, spec["targets"])]:
        got_row, want_row = list(tensor.shape[1:]), want["shape"][1:]
        if tensor.dim() == 0 or got_row != want_row or dtype_name(tensor.dtype) != want["dtype"]:
            raise AotError(
                f"{where}: {name} expected samples of shape {describe(want_row, want['dtype'])}, "
                f"got {describe(got_row if tensor.dim() else [], dtype_name(tensor.dtype))}"
            )


LLMC_MAGIC, LLMC_HEADER_INTS = 20240520, 256
LLMC_TOKENS = {1: np.uint16}  # llm.c's header version -> its token dtype
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


class TokenFile:
    """A shard's tokens, `count` of `dtype` from byte `offset`, read with pread: the bytes asked for
    and no more, through the page cache, nothing mapped into the process. (Memory-mapped, a
    shuffled run's windows scattered over a 4 GiB shard stayed resident as mapped pages, readahead
    included: 290 MB per rank after 120 steps.)"""

    def __init__(self, path: Path, offset: int, dtype: np.dtype, count: int):
        self.path, self.offset, self.dtype, self.count = path, offset, np.dtype(dtype), count
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.count

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the shard."""
        size = (hi - lo) * self.dtype.itemsize
        data = os.pread(self._fd, size, self.offset + lo * self.dtype.itemsize)
        if len(data) != size:
            raise AotError(f"{self.path}: ends before token {hi}; it changed during the run (a run reads its data as it was when it started)")
        return np.frombuffer(data, dtype=self.dtype)


def _tokens_of(shard: Path, token_dtype: str | None) -> TokenFile:
    """A shard's tokens (its header read and checked; no token read until asked for)."""
    if shard.suffix == ".npy":
        try:
            tokens = np.load(shard, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise AotError(f"{shard}: not a readable .npy file ({e})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise AotError(f"{shard}: a token .npy holds a 1-D array of integers, this one is {tokens.ndim}-D {tokens.dtype}")
        assert isinstance(tokens, np.memmap)  # what np.load's mmap_mode gives
        return TokenFile(shard, tokens.offset, tokens.dtype, len(tokens))
    size = shard.stat().st_size
    header = np.fromfile(shard, dtype=np.int32, count=LLMC_HEADER_INTS) if size >= 4 * LLMC_HEADER_INTS else np.zeros(0, np.int32)
    if token_dtype is None:
        if len(header) < 3 or header[0] != LLMC_MAGIC:
            raise AotError(f"{shard}: no llm.c header (magic {LLMC_MAGIC}); for raw tokens give --token-dtype ({', '.join(TOKEN_DTYPES)})")
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_TOKENS:
            raise AotError(f"{shard}: llm.c header version {version}, which aot does not read (it reads {', '.join(map(str, LLMC_TOKENS))})")
        stored = np.dtype(LLMC_TOKENS[version])
        if size != 4 * LLMC_HEADER_INTS + count * stored.itemsize:
            raise AotError(f"{shard}: its header says {count} tokens, the file holds {(size - 4 * LLMC_HEADER_INTS) // stored.itemsize}")
        return TokenFile(shard, 4 * LLMC_HEADER_INTS, stored, count)
    if token_dtype not in TOKEN_DTYPES:
        raise AotError(f"--token-dtype {token_dtype}: expected one of {', '.join(TOKEN_DTYPES)}")
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    if size % dtype.itemsize:
        raise AotError(f"{shard}: {size} bytes is not a whole number of {token_dtype} tokens")
    return TokenFile(shard, 0, dtype, size // dtype.itemsize)


def _token_windows(shards: list[Path], spec: dict, token_dtype: str | None):
    """(rows, read) over token shards as one stream cut into windows of T + 1 tokens."""
    inputs, targets = spec["inputs"], spec["targets"]
    shapes = [i["shape"] for i in inputs] + [targets["shape"]]
    if (
        len(inputs) != 1
        or any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes)
        or not all(d["dtype"].startswith(("int", "uint")) for d in [*inputs, targets])
    ):
        wanted = ", ".join(describe(i["shape"][1:], i["dtype"]) for i in inputs)
        raise AotError(f"token data feeds a program whose one input and targets are [batch, T] token ids; this one takes {wanted}")
    window = shapes[0][1]
    streams = [_tokens_of(shard, token_dtype) for shard in shards]
    watched = [Watched(shard) for shard in shards]
    starts = np.cumsum([0] + [len(t) for t in streams])
    total = int(starts[-1])
    rows = (total - 1) // window if total > window else 0
    if rows == 0:
        raise AotError(f"{shards[0] if len(shards) == 1 else str(shards[0].parent)}: {total} tokens, fewer than one window of {window + 1}")
    dtypes = dtype_of(inputs[0]["dtype"]), dtype_of(targets["dtype"])
    # every token is an input of one window and a target of another: the least bound holds for all
    found = [b for b in (inputs[0].get("below"), targets.get("below")) if b is not None]
    below = min(found) if found else None

    def tokens(a: int, b: int) -> np.ndarray:
        pieces = []
        for stream, first, shard in zip(streams, starts[:-1], watched):
            lo, hi = max(a, int(first)), min(b, int(first) + len(stream))
            if lo < hi:
                shard.check()
                piece = stream.read(lo - int(first), hi - int(first)).astype(np.int64)
                if below is not None:
                    _check_ids(torch.from_numpy(piece), below, True, lambda at: f"{shard.path}: token offset {lo - int(first) + at[0]}")
                pieces.append(piece)
        return np.concatenate(pieces)

    def read(a: int, b: int):
        span = torch.from_numpy(tokens(a * window, b * window + 1))
        samples = torch.stack([span[i * window : i * window + window + 1] for i in range(b - a)])
        return [samples[:, :-1].to(dtypes[0])], samples[:, 1:].to(dtypes[1])

    return rows, read
