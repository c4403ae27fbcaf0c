"""Prepare a training set for examples/gpt.py.

Cuts windows of `block_size` tokens out of examples/data/tinytext.txt at
deterministic pseudo-random offsets and writes them to a safetensors file with
two int64 tensors of shape [N, block_size]: `inputs`, and `targets` (the same
windows shifted one character to the right).

    python examples/prepare_data.py --samples 512 -o examples/data/gpt_train.safetensors
    python examples/prepare_data.py --tokens examples/data/tinytext.bin   # the whole text as one llm.c token shard
    python examples/prepare_data.py --tokens train.bin --val-tokens val.bin   # its first 90% and last 10%

`aot run --data` reads either: the safetensors windows as rows, or the token shard cut into windows
of block_size + 1 tokens in order (runner/execution/data.py).
"""

import argparse
import importlib.util
from pathlib import Path

import torch
from safetensors.torch import save_file

here = Path(__file__).resolve().parent


def load_gpt():
    # Import examples/gpt.py by path so this script works from any directory.
    spec = importlib.util.spec_from_file_location("aot_example_gpt", here / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(
        description="Write a safetensors training set (keys 'inputs' and 'targets', int64 [N, block_size]) of character windows for examples/gpt.py."
    )
    parser.add_argument("--samples", type=int, default=512, help="number of windows N to write (default: %(default)s)")
    parser.add_argument(
        "-o", "--output", type=Path, default=here / "data" / "gpt_train.safetensors", help="output file (default: examples/data/gpt_train.safetensors)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for choosing window offsets (default: %(default)s)")
    parser.add_argument("--tokens", type=Path, help="also write the whole text as one llm.c token shard (.bin: 256 x int32 header, uint16 tokens) here")
    parser.add_argument(
        "--val-tokens", type=Path, help="with --tokens: write the text's last 10%% here as a validation shard, and only the first 90%% to --tokens"
    )
    args = parser.parse_args()

    gpt = load_gpt()
    data = torch.tensor(gpt.encode(gpt.text_path.read_text(encoding="ascii")), dtype=torch.int64)
    T = gpt.block_size
    g = torch.Generator().manual_seed(args.seed)
    offsets = torch.randint(0, len(data) - T - 1, (args.samples,), generator=g)
    # idx[i, t] = offsets[i] + t picks every window in one gather.
    idx = offsets[:, None] + torch.arange(T)[None, :]
    tensors = {"inputs": data[idx].contiguous(), "targets": data[idx + 1].contiguous()}

    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.output))
    print(f"wrote {args.samples} windows of {T} tokens (inputs, targets: int64 [{args.samples}, {T}]) from {len(data)} characters to {args.output}")
    if args.val_tokens is not None and args.tokens is None:
        parser.error("--val-tokens needs --tokens")
    if args.tokens is not None:
        cut = len(data) * 9 // 10 if args.val_tokens is not None else len(data)
        write_shard(args.tokens, data[:cut])
        if args.val_tokens is not None:
            write_shard(args.val_tokens, data[cut:])


def write_shard(path: Path, tokens: torch.Tensor) -> None:
    header = torch.zeros(256, dtype=torch.int32)
    header[:3] = torch.tensor([20240520, 1, len(tokens)])  # llm.c's magic, version 1 (uint16 tokens), token count
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.numpy().tobytes() + tokens.to(torch.int32).numpy().astype("uint16").tobytes())
    print(f"wrote {len(tokens)} tokens as an llm.c shard to {path}")


if __name__ == "__main__":
    main()
