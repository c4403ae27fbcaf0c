"""Batches for one data-parallel rank, from a --data file or the artifact's example batch.

A data source holds `inputs` (one or more tensors) and `targets` whose first dimension is the
sample. Global step s uses rows [s*G, (s+1)*G) with G = B * dp (B the per-rank batch size), and
data-parallel rank r takes rows [s*G + r*B, s*G + (r+1)*B), wrapping at the end of the data.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from runner.errors import AotError


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


class DataSource:
    def __init__(self, inputs: list[torch.Tensor], targets: torch.Tensor, spec: dict, dp_rank: int, dp_size: int, where: str):
        expected = spec["inputs"]
        if len(inputs) != len(expected):
            raise AotError(f"{where}: the program takes {len(expected)} input tensor(s), the data has {len(inputs)}")
        rows = targets.shape[0] if targets.dim() else 0
        for name, tensor, want in [*((f"inputs.{i}", t, w) for i, (t, w) in enumerate(zip(inputs, expected))), ("targets", targets, spec["targets"])]:
            got_row, want_row = list(tensor.shape[1:]), want["shape"][1:]
            if tensor.dim() == 0 or got_row != want_row or dtype_name(tensor.dtype) != want["dtype"]:
                raise AotError(
                    f"{where}: {name} expected samples of shape {describe(want_row, want['dtype'])}, "
                    f"got {describe(got_row if tensor.dim() else [], dtype_name(tensor.dtype))}"
                )
            if tensor.shape[0] != rows:
                raise AotError(f"{where}: {name} has {tensor.shape[0]} samples but targets has {rows}")
        if rows == 0:
            raise AotError(f"{where}: holds no samples")
        self.inputs, self.targets = inputs, targets
        self.batch_size = spec["batch_size"]
        self.global_batch = self.batch_size * dp_size
        self.offset = dp_rank * self.batch_size
        self.rows = rows

    @classmethod
    def from_file(cls, path: str | Path, spec: dict, dp_rank: int, dp_size: int) -> "DataSource":
        path = Path(path)
        try:
            tensors = load_safetensors(path.read_bytes())
        except FileNotFoundError:
            raise AotError(f"{path}: no such data file") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise AotError(f"{path}: not a readable safetensors file ({e})") from None
        inputs, targets = split_batch_tensors(tensors, str(path))
        return cls(inputs, targets, spec, dp_rank, dp_size, str(path))

    def batch(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        start = step * self.global_batch + self.offset
        rows = torch.arange(start, start + self.batch_size) % self.rows
        return [t.index_select(0, rows) for t in self.inputs], self.targets.index_select(0, rows)
