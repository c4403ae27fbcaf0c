"""What `aot topology calibrate` measures, timed here independently of aot, for its test.

Run under torchrun on the same ranks: `torchrun --nproc-per-node 2 tests/helpers/machine_timing.py
OUT.json`. Written without aot or runner (plain torch and torch.distributed on gloo, its own
timing loops), so the test compares the profile calibrate wrote with another measurement, not
with itself. Each rank measures at once, as calibrate's ranks do (two ranks share this machine);
rank 0 writes OUT.json:

- matmul_flops_per_s: a float32 256 x 256 matmul, 2 n^3 FLOPs per call, median of 15 timings of 4 calls
- copy_bytes_per_s: bytes read plus written by a tensor copy (64 MiB each way), median of 7
- gelu_seconds_per_element: GELU over 2^20 float32 elements, median of 15
- all_reduce_s: {bytes: seconds} of a float32 all_reduce over both ranks (dist.all_reduce), each
  repetition timed after a barrier and taken as the slower rank saw it, the lower quartile of 40
  (gloo's time on a shared CPU is bimodal; the quartile is its fast path)
- send_recv_s: {bytes: seconds} of one transfer, half the round trip of a float32 tensor sent
  from rank 0 to rank 1 and back (dist.send / dist.recv), timed on rank 0, median of 40
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def median_seconds(fn, reps: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def all_reduce_seconds(nbytes: int, reps: int = 40) -> float:
    t = torch.ones(nbytes // 4)
    clock = torch.zeros(1, dtype=torch.float64)
    for _ in range(3):
        dist.all_reduce(t)
    samples = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        clock[0] = time.perf_counter() - start
        dist.all_reduce(clock, op=dist.ReduceOp.MAX)
        samples.append(float(clock[0]))
    return sorted(samples)[len(samples) // 4]


def send_recv_seconds(nbytes: int, reps: int = 40) -> float:
    t = torch.ones(nbytes // 4)
    peer = 1 - dist.get_rank()

    def there_and_back() -> None:
        if peer == 1:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)

    for _ in range(3):
        there_and_back()
    samples = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        there_and_back()
        samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    x, y = torch.empty(16 * 2**20), torch.empty(16 * 2**20)  # 64 MiB each: read 64, write 64
    g = torch.randn(2**20)
    dist.barrier()
    result = {
        "matmul_flops_per_s": 2 * n**3 / median_seconds(lambda: a @ b, 15, inner=4),
        "copy_bytes_per_s": 2 * x.numel() * 4 / median_seconds(lambda: y.copy_(x), 7),
        "gelu_seconds_per_element": median_seconds(lambda: torch.nn.functional.gelu(g), 15) / g.numel(),
        "all_reduce_s": {nbytes: all_reduce_seconds(nbytes) for nbytes in (4096, 65536)},
        "send_recv_s": {nbytes: send_recv_seconds(nbytes) for nbytes in (4096, 65536)},
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
