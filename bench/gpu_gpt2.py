"""Benchmark: GPT-2 124M (transformers) or Llama-3.2-1B's shape training on one GPU in bf16, eager
PyTorch and torch.compile against aot's tiers, in one run.

    python bench/gpu_gpt2.py [--batch-size 16] [--steps 40] [--out gpu_gpt2.json]
    python bench/gpu_gpt2.py --model llama-1b --batch-size auto          # the largest batch that fits
    python bench/gpu_gpt2.py --build-only --artifact DIR --out build.json   # the aot build alone
    python bench/gpu_gpt2.py --artifact DIR --build-json build.json ...     # measure on that build

--model llama-1b (issue #46) is examples/llama.py at AOT_SIZE=1b (16 layers, 2048 wide, 32 heads
of which 8 key/value, vocabulary 128,256, embeddings tied, 2048 tokens a sample; 1.24 B parameters),
its own batch, loss, AdamW and schedule, made by its model() on the CPU as the file makes it.
`--batch-size auto` takes the largest batch the build predicts fits 85% of the GPU's memory: the
model is built once at a batch of 1 (portable tier), its predicted peak split into what a batch
does not change and the activations and batch a sample adds (aot's predicted peak was 1.002x the
measured one for GPT-2), and the artifact then built at that batch; the measuring run reads the
batch from the artifact.

The model is transformers' GPT2LMHeadModel(GPT2Config()) with the config's defaults (12 layers,
12 heads, 768 wide, vocabulary 50257, context 1024, the embedding tied to the head; 124,439,808
parameters) but dropout 0 (as nanoGPT and llm.c pretrain it), randomly initialised: nothing is
downloaded. Its forward returns the logits (use_cache=False); the loss is cross-entropy on random
token ids shifted by one; AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1), gradients clipped to
norm 1.0; forward and loss under torch.autocast("cuda", torch.bfloat16), fp32 master weights. Attention is transformers'
default implementation (`sdpa`) unless --attn says otherwise. (--attn eager builds, but on
2026-12-03 with transformers 5.17 `aot run` refused that artifact on the CPU: "the program takes
param transformer.wte.weight of shape []"; sdpa trained.)

This file is also the aot model file that is built (model, batch, loss, optimizer, max_grad_norm,
precision): `aot build` imports it with no arguments, so the shapes it builds come from the
environment (AOT_GPT2_SEQ, AOT_GPT2_ATTN; AOT_GPT2_LAYERS/EMBD/HEADS only for --smoke), which this
script sets for every process it starts.

The variants, each launched as a fresh process on one GPU, one after the other:
  eager      plain PyTorch: the model made on the CPU after torch.manual_seed(0) and moved to the GPU
  compile    the same with torch.compile(model) (default mode; fresh inductor and Triton caches, so
             its first step includes compiling, as on a fresh machine)
  portable   `python -m aot run ARTIFACT --tier portable` (the exported program, no compiler)
  compiled   `python -m aot run ARTIFACT --tier compiled` (the AOTInductor package)
  portable-graphs, compiled-graphs
             the same with `--cuda-graphs on`: the step captured once as a CUDA graph after 3 eager
             steps and replayed (the steady steps are replays)
  compile-graphs
             torch.compile(model, mode="reduce-overhead"), its CUDA-graph mode (last: launched only
             where the deadline leaves time)
The artifact is built once, ahead of time, with `aot build --precision bf16 --compile aoti
--world-size 1 --no-onnx` (its seconds are reported apart: they are not part of any cold start).

Figures per variant:
  cold start   seconds from just before the process is launched to the end of step 1 (its loss on
               the host): interpreter, imports, weights, compilation if any, step 1
  step time    median wall time of steps 6..N; every step ends with loss.item(), which waits for
               the GPU
  tokens/s     batch x sequence / step time
  MFU          model FLOPs per step / step time / peak. FLOPs per token: 6 N + 12 L S d (N the
               parameters but the position embedding, counted once: 123,653,376; L layers, S
               tokens per sample, d width; nanoGPT's and PaLM's estimate). Peak: 790 TFLOP/s, the
               H200's dense bf16 rate this workplace measured (8192^3 bf16 matmuls, 769-798);
               the datasheet's 989 is given too (--peak-tflops changes the first)
Goals (issue 25): compiled tier <= 1.0x torch.compile's step time, cold start <= 0.15x
torch.compile's. The JSON says for each whether it was met.

Without a CUDA device this refuses in one line (exit 1). --smoke checks the harness on the CPU
instead (a 2-layer, 64-wide model, the `cpu` topology; its figures mean nothing).
"""

import time

T_TOP = time.time()  # first statement: as close to a worker's process start as Python code gets

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

# -- the model file (read by `aot build`, and by the eager and torch.compile workers) -----------------
SEQ_LEN = int(os.environ.get("AOT_GPT2_SEQ", "1024"))  # tokens per sample (the context, 1024, stays)
ATTN = os.environ.get("AOT_GPT2_ATTN", "sdpa")  # transformers' attention implementation
_SMALL = {
    k: int(os.environ[f"AOT_GPT2_{k.upper()}"]) for k in ("layers", "embd", "heads") if os.environ.get(f"AOT_GPT2_{k.upper()}")
}  # --smoke only: a smaller model
precision = "bf16"
max_grad_norm = 1.0
_CLASS = []


def config():
    from transformers import GPT2Config

    sizes = {"n_layer": _SMALL.get("layers"), "n_embd": _SMALL.get("embd"), "n_head": _SMALL.get("heads")}
    # No dropout, as nanoGPT and llm.c pretrain GPT-2 124M; with attention dropout aot keeps the math
    # attention (runner/execution/attention.py: its fused operator has no dropout).
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2Config(use_cache=False, attn_implementation=ATTN, **dropout, **{k: v for k, v in sizes.items() if v})


def model():
    """GPT2LMHeadModel whose forward returns the logits alone (its state_dict keys are transformers')."""
    if not _CLASS:
        from transformers import GPT2LMHeadModel

        class GPT2Logits(GPT2LMHeadModel):
            def forward(self, input_ids):
                return super().forward(input_ids=input_ids, use_cache=False).logits

        _CLASS.append(GPT2Logits)
    return _CLASS[0](config())


def batch(batch_size):
    """(inputs, targets), int64 [batch_size, SEQ_LEN]: random token ids, targets shifted by one."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 50257, (batch_size, SEQ_LEN + 1), generator=g, dtype=torch.int64)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)


# -- the model files ---------------------------------------------------------------------------------------

LLAMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "llama.py")
MODEL_FILES = {"gpt2": os.path.abspath(__file__), "llama-1b": os.path.abspath(LLAMA_FILE)}


@functools.cache  # the driver reads the file's sizes more than once; each read runs it
def model_file(name: str):
    """The module whose model(), batch(), loss(), optimizer() (and scheduler(), max_grad_norm) a
    run of `name` uses: this file for gpt2; examples/llama.py, at the AOT_SIZE in the environment,
    for llama-1b."""
    if name == "gpt2":
        return sys.modules[__name__]
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_bench_llama", MODEL_FILES[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- a worker: eager or torch.compile, one process ------------------------------------------------------

COMPILE_MODES = {"compile": "default", "compile-graphs": "reduce-overhead"}


def worker(kind: str, name: str, batch_size: int, steps: int, result: str) -> None:
    t_torch = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: --smoke only
    mf = model_file(name)
    torch.manual_seed(0)
    net = mf.model().to(device)  # made on the CPU, as aot's init program makes it, then moved
    t_model = time.time()
    params = list(net.parameters())
    opt = mf.optimizer(params)
    schedule = mf.scheduler(opt) if hasattr(mf, "scheduler") else None
    forward = torch.compile(net, mode=COMPILE_MODES[kind]) if kind in COMPILE_MODES else net
    x, y = (t.to(device) for t in mf.batch(batch_size))
    clip = getattr(mf, "max_grad_norm", None)
    losses, times, t_step1 = [], [], None
    for step in range(steps):
        start = time.perf_counter()
        torch.manual_seed((step * 1_009) % 2**63)  # aot run's per-step seed (seed 0, rank 0): the same dropout draws
        with torch.autocast(device.type, dtype=torch.bfloat16):
            value = mf.loss(forward(x), y)
        value.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if schedule is not None:
            schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value.item())  # waits for the GPU
        times.append(time.perf_counter() - start)
        t_step1 = t_step1 or time.time()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    with open(result, "w") as f:
        json.dump(
            {
                "t_top": T_TOP,
                "import_torch_s": t_torch - T_TOP,
                "model_s": t_model - t_torch,
                "t_step1_end": t_step1,
                "step_times_s": times,
                "losses": losses,
                "peak_memory_bytes": peak,
            },
            f,
        )


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    sys.exit(0)

# -- the driver ------------------------------------------------------------------------------------------
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5  # steady state: steps 6..N
PEAK_TFLOPS = 790.0  # H200 dense bf16 as measured by this workplace (8192^3 matmuls: 769-798 TFLOP/s)
DATASHEET_TFLOPS = 989.0
GOAL_STEP, GOAL_COLD = 1.0, 0.15  # compiled / torch.compile: step time, cold start
DESCRIPTIONS = {
    "gpt2": "GPT-2 124M (transformers GPT2LMHeadModel, GPT2Config defaults, random init)",
    "llama-1b": "Llama-3.2-1B's shape (examples/llama.py, AOT_SIZE=1b, random init)",
}
VARIANTS = ("eager", "compiled", "compile", "portable", "compiled-graphs", "portable-graphs", "compile-graphs")  # the goals' first
SMOKE_ENV = {"AOT_GPT2_LAYERS": "2", "AOT_GPT2_EMBD": "64", "AOT_GPT2_HEADS": "4", "AOT_GPT2_SEQ": "64"}
# the model file's environment per model (the size of examples/llama.py; --smoke: its tiny preset)
MODEL_ENV = {"gpt2": {}, "llama-1b": {"AOT_SIZE": "1b"}}
SMOKE_MODEL_ENV = {"gpt2": SMOKE_ENV, "llama-1b": {"AOT_SIZE": "tiny"}}
FIT = 0.85  # --batch-size auto: of the GPU's memory, what the build's predicted peak may take
SMOKE_MEMORY = 2**26  # --batch-size auto under --smoke: the "device" memory (there is no GPU)


def say(msg: str) -> None:
    print(f"gpu_gpt2: {msg}", file=sys.stderr, flush=True)


def child_env(extra: dict | None = None) -> dict:
    env = {**os.environ, **(extra or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AOT_DEBUG"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def flops_per_step(name: str, batch_size: int) -> float:
    """6 N + 12 L S d per token, N the parameters without a position embedding (tied ones counted
    once; nanoGPT, PaLM)."""
    if name == "gpt2":
        cfg = config()
        d, layers, vocab = cfg.n_embd, cfg.n_layer, cfg.vocab_size
        per_layer = 12 * d * d + 13 * d  # attention c_attn, c_proj; MLP c_fc, c_proj; two LayerNorms
        n = vocab * d + layers * per_layer + 2 * d  # tied embedding/head, blocks, final LayerNorm
    else:
        mf = model_file(name)
        with torch.device("meta"):
            n = sum(p.numel() for p in mf.model().parameters())  # a tied embedding is one parameter
        d, layers = mf.dim, mf.n_layers
    return batch_size * SEQ_LEN * (6 * n + 12 * layers * SEQ_LEN * d)


def build(artifact: Path, args, deadline: float) -> dict:
    """`aot build` of the model file with both tiers; its seconds and outcome. Where AOTInductor
    fails, the error (with its traceback: --debug) is kept and the portable tier alone is built, so
    that tier is still measured. `--batch-size auto`: at the largest batch predicted to fit."""
    sizing = None
    if args.batch_size == "auto":
        sizing = fitting_batch(artifact.with_name(artifact.name + ".sizing"), args, deadline)
        if not sizing["ok"]:
            return sizing
        args.batch_size = sizing["batch_size"]
    out = _built(artifact, args, deadline)
    if sizing is not None:
        out["sizing"] = sizing
    return out


def fitting_batch(folder: Path, args, deadline: float) -> dict:
    """The largest batch whose predicted peak takes at most FIT of the GPU's memory, from one
    portable build at a batch of 1: what a batch does not change (parameters, optimizer state,
    gradients) and what each sample adds (the activations live at the peak, the batch)."""
    one = argparse.Namespace(**{**vars(args), "batch_size": 1})
    out = build_once(folder, one, deadline, compiled=False)
    if not out["ok"]:
        return {**out, "error": f"sizing the batch: {out.get('error')}"}
    memory = json.loads((folder / "manifest.json").read_text())["memory"]["predicted"]
    shutil.rmtree(folder, ignore_errors=True)
    device = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else SMOKE_MEMORY
    per_sample = memory["at_peak"]["activations"] + memory["resident"]["batch"]
    fixed = memory["peak"] - per_sample
    batch = max(1, int((FIT * device - fixed) // per_sample))
    say(f"batch {batch}: predicted peak {fixed / 2**30:.1f} GiB + {per_sample / 2**30:.2f} GiB a sample, under {FIT:.0%} of {device / 2**30:.1f} GiB")
    return {"ok": True, "batch_size": batch, "fixed_bytes": fixed, "per_sample_bytes": per_sample, "device_bytes": device, "fit": FIT}


def _built(artifact: Path, args, deadline: float) -> dict:
    out = build_once(artifact, args, deadline, compiled=True)
    if out["ok"] or time.time() > deadline - 60:
        return out
    portable = build_once(artifact, args, deadline, compiled=False)
    portable["compiled_error"] = out.get("error")
    return portable


def build_once(artifact: Path, args, deadline: float, compiled: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "aot",
        "build",
        MODEL_FILES[args.model],
        "--world-size",
        "1",
        "--batch-size",
        str(args.batch_size),
        "--precision",
        "bf16",
        "--no-onnx",
        *(["--compile", "aoti"] if compiled else []),
        "-o",
        str(artifact),
        "--json",
        "--quiet",
        "--debug",
    ]
    if args.topology:
        cmd[4:4] = ["--topology", args.topology]
    say(f"building {artifact} (aot build{' --compile aoti' if compiled else ''}) ...")
    start = time.time()
    try:
        r = subprocess.run(
            cmd,
            cwd=REPO,
            env=child_env({"TORCHINDUCTOR_CACHE_DIR": str(artifact) + ".inductor-cache"}),
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.time()),
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": time.time() - start, "error": "timed out", "command": " ".join(cmd[1:])}
    out = {"ok": r.returncode == 0, "seconds": time.time() - start, "command": " ".join(cmd[1:])}
    if r.returncode != 0:
        out["error"] = r.stderr[-3000:]
        say(f"build failed ({r.returncode}): {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
        return out
    try:
        out["aot_build_seconds"] = json.loads(r.stdout).get("seconds")
    except ValueError:
        out["aot_build_seconds"] = None
    manifest = json.loads((artifact / "manifest.json").read_text())
    out["compiled_device"] = (manifest.get("compiled") or {}).get("device")
    out["train_graph_nodes"] = manifest["programs"]["train"]["graph_nodes"]
    # what the build predicts for this GPU (its profile: probed here unless --topology), to set beside the steps measured
    out["predicted"] = {"time": manifest.get("time"), "memory": (manifest.get("memory") or {}).get("predicted")}
    say(f"built in {out['seconds']:.1f} s")
    return out


def launch(name: str, cmd: list[str], env: dict, timeout: float, log: Path) -> tuple[int | str, float]:
    """Run one variant's process; (exit status or 'timed out', the launch time on time.time())."""
    t0 = time.time()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timed out"
    return rc, t0


def summarize(step_times: list[float], losses: list[float], t0: float, t_step1_end: float, flops: float, peak: float, batch_size: int) -> dict:
    steady = step_times[WARMUP:] or step_times[1:] or step_times
    step = statistics.median(steady)
    return {
        "cold_start_s": t_step1_end - t0,
        "first_step_s": step_times[0],
        "step_s": step,
        "step_best_s": min(steady),
        "tokens_per_s": batch_size * SEQ_LEN / step,
        "mfu": flops / step / (peak * 1e12),
        "mfu_datasheet": flops / step / (DATASHEET_TFLOPS * 1e12),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "step_times_s": step_times,
    }


WORKERS = ("eager", *COMPILE_MODES)  # the variants run by this file's worker (the others: aot run)


def run_variant(name: str, args, artifact: Path | None, tmp: Path, deadline: float, flops: float) -> dict:
    result, log = tmp / f"{name}.json", tmp / f"{name}.log"
    timeout = min(args.variant_timeout, deadline - time.time())
    if timeout < 10:
        return {"ok": False, "error": "no time left before the deadline"}
    if name in WORKERS:
        extra = {}
        if name in COMPILE_MODES:  # a cold compile: nothing cached from earlier runs
            extra = {"TORCHINDUCTOR_CACHE_DIR": str(tmp / f"{name}-inductor-cache"), "TRITON_CACHE_DIR": str(tmp / f"{name}-triton-cache")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, args.model, str(args.batch_size), str(args.steps), str(result)]
    else:
        if artifact is None:
            return {"ok": False, "error": "no artifact (the build failed)"}
        if args.smoke and name.endswith("-graphs"):
            return {"ok": False, "error": "no CUDA graphs on the CPU (--smoke)"}
        extra = {}
        tier, graphs = name.removesuffix("-graphs"), "on" if name.endswith("-graphs") else "off"
        cmd = [
            sys.executable,
            "-m",
            "aot",
            "run",
            str(artifact),
            "--steps",
            str(args.steps),
            "--tier",
            tier,
            "--cuda-graphs",
            graphs,
            "--metrics",
            str(result),
            "--log-every",
            str(args.steps),
        ]
    say(f"{name}: launching ({' '.join(cmd[1:4])} ...), at most {timeout:.0f} s")
    rc, t0 = launch(name, cmd, child_env(extra), timeout, log)
    if rc != 0:
        tail = log.read_text()[-3000:] if log.is_file() else ""
        say(f"{name}: failed ({rc})")
        return {"ok": False, "error": f"exit {rc}", "log_tail": tail}
    if name in WORKERS:
        data = json.loads(result.read_text())
        out = summarize(data["step_times_s"], data["losses"], t0, data["t_step1_end"], flops, args.peak_tflops, args.batch_size)
        out.update(
            import_torch_s=data["import_torch_s"],
            model_s=data["model_s"],
            launch_to_interpreter_s=data["t_top"] - t0,
            peak_memory_bytes=data["peak_memory_bytes"],
        )
    else:
        records = [json.loads(line) for line in result.read_text().splitlines()]
        assert all(r["tier"] == tier for r in records), records
        out = summarize(
            [r["step_time_s"] for r in records], [r["loss"] for r in records], t0, records[0]["unix_time"], flops, args.peak_tflops, args.batch_size
        )
        ready = [line for line in log.read_text().splitlines() if " ready in " in line]
        out["ready_line"] = ready[0] if ready else None
    out["ok"] = True
    say(f"{name}: cold start {out['cold_start_s']:.2f} s, step {out['step_s'] * 1e3:.2f} ms, {out['tokens_per_s']:,.0f} tokens/s, MFU {out['mfu'] * 100:.1f}%")
    return out


def goals(variants: dict) -> dict:
    def ratio(a: str, b: str, key: str):
        va, vb = variants.get(a, {}), variants.get(b, {})
        return va[key] / vb[key] if va.get("ok") and vb.get("ok") else None

    out = {}
    for tier in ("compiled", "portable"):
        step, cold = ratio(tier, "compile", "step_s"), ratio(tier, "compile", "cold_start_s")
        out[tier] = {
            "step_vs_compile": step,
            "cold_start_vs_compile": cold,
            "step_goal_met": None if step is None else step <= GOAL_STEP,
            "cold_start_goal_met": None if cold is None else cold <= GOAL_COLD,
        }
    # issue #46: the compiled tier with graphs <= torch.compile's step, the portable one with graphs <= eager's
    for tier, against in (("compiled", "compile"), ("portable", "eager")):
        step = ratio(f"{tier}-graphs", against, "step_s")
        out[f"{tier}-graphs"] = {f"step_vs_{against}": step, "step_goal_met": None if step is None else step <= 1.0}
    c, p = variants.get("compiled", {}), variants.get("portable", {})
    if c.get("ok") and p.get("ok"):
        out["max_loss_diff_compiled_vs_portable"] = max(abs(a - b) for a, b in zip(c["losses"], p["losses"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring (the head of bench/gpu_gpt2.py) for what is measured."
    )
    parser.add_argument("--model", choices=sorted(MODEL_FILES), default="gpt2", help="the model trained (default gpt2: GPT-2 124M)")
    parser.add_argument(
        "--batch-size",
        default=None,
        help="samples per step, or auto: the largest the build predicts fits (default: 16 for gpt2, x 1024 tokens; auto for llama-1b)",
    )
    parser.add_argument("--steps", type=int, default=40, help="steps per variant; the median of steps 6..N is reported")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    parser.add_argument(
        "--attn",
        choices=["sdpa", "eager"],
        default=os.environ.get("AOT_GPT2_ATTN", "sdpa"),
        help="transformers' attention implementation (default sdpa, its own default)",
    )
    parser.add_argument("--topology", help="aot build --topology (default: this machine, probed)")
    parser.add_argument("--artifact", type=Path, help="the aot artifact: built here first unless it holds one already")
    parser.add_argument("--build-only", action="store_true", help="build --artifact, write the build's record to --out, stop")
    parser.add_argument("--build-json", type=Path, help="the record of a --build-only run, to report with the figures")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help=f"bf16 peak for MFU (default {PEAK_TFLOPS:g}: the H200 as measured here)")
    parser.add_argument("--deadline-s", type=float, default=600, help="stop launching variants after this many seconds")
    parser.add_argument("--variant-timeout", type=float, default=240, help="seconds one variant's process may take")
    parser.add_argument("--out", type=Path, help="write the figures (JSON) here, after each variant")
    parser.add_argument("--smoke", action="store_true", help="check the harness on the CPU (tiny model; no figures)")
    args = parser.parse_args()
    deadline = time.time() + args.deadline_s
    if args.batch_size is None:
        args.batch_size = "16" if args.model == "gpt2" else "auto"
    if args.batch_size != "auto":
        try:
            args.batch_size = int(args.batch_size)
        except ValueError:
            parser.error(f"--batch-size: a number of samples or auto, got {args.batch_size!r}")

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_gpt2: error: no CUDA device here; this benchmark needs one GPU (--smoke checks the harness on CPU)")
    try:
        import transformers
    except ImportError as e:
        sys.exit(f"gpu_gpt2: error: transformers cannot be imported ({e}); install transformers")
    os.environ["AOT_GPT2_ATTN"] = globals()["ATTN"] = args.attn
    os.environ.update((SMOKE_MODEL_ENV if args.smoke else MODEL_ENV)[args.model])  # every process this starts reads the model's size
    if args.smoke:
        args.topology = args.topology or "cpu"
        if args.model == "gpt2":
            _SMALL.update(layers=2, embd=64, heads=4)
            globals()["SEQ_LEN"] = int(SMOKE_ENV["AOT_GPT2_SEQ"])
    if args.model != "gpt2":
        globals()["SEQ_LEN"] = model_file(args.model).seq_len
    else:
        os.environ["AOT_GPT2_SEQ"] = str(SEQ_LEN)  # this file's model, as built and as the workers make it

    def write(results):
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    if args.build_only:
        if args.artifact is None:
            parser.error("--build-only needs --artifact")
        write({"build": build(args.artifact, args, deadline)})
        return

    prebuilt = args.artifact / "manifest.json" if args.artifact else None
    if args.batch_size == "auto" and prebuilt is not None and prebuilt.is_file():  # the batch the build sized
        args.batch_size = int(json.loads(prebuilt.read_text())["build"]["batch_size"])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    results = {
        "benchmark": DESCRIPTIONS[args.model] + ", 1 GPU, bf16 autocast",
        "model": args.model,
        "smoke": args.smoke,
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "attention": args.attn if args.model == "gpt2" else "torch's scaled_dot_product_attention",
        "steps": args.steps,
        "steady_steps": f"{WARMUP + 1}..{args.steps}",
        "flops_formula": "tokens x (6 N + 12 L S d), N = parameters without a position embedding",
        "peak_tflops": args.peak_tflops,
        "peak_source": "H200 dense bf16 measured by this workplace (769-798 TFLOP/s)",
        "datasheet_tflops": DATASHEET_TFLOPS,
        "goals": {"compiled_step_vs_compile": f"<= {GOAL_STEP}", "compiled_cold_start_vs_compile": f"<= {GOAL_COLD}"},
        "build": None,
        "variants": {},
    }
    if args.build_json and args.build_json.is_file():
        results["build"] = json.loads(args.build_json.read_text()).get("build")
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(wanted) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))} (choose from {', '.join(VARIANTS)})")
    with tempfile.TemporaryDirectory(prefix="aot-gpu-gpt2-") as tmp:
        tmp = Path(tmp)
        artifact = args.artifact
        if {"portable", "compiled", "portable-graphs", "compiled-graphs"} & set(wanted):
            artifact = artifact or tmp / "artifact"
            if (artifact / "manifest.json").is_file():
                results["build"] = results["build"] or {"ok": True, "note": f"prebuilt artifact {artifact}"}
            elif args.build_json:  # that build failed or did not finish: its record says why; no second try
                results["build"] = results["build"] or {"ok": False, "error": f"{args.build_json}: no record (the --build-only run did not finish)"}
            else:
                results["build"] = build(artifact, args, deadline)
            if not (artifact / "manifest.json").is_file():
                artifact = None
        if args.batch_size == "auto":  # no artifact sized it (none asked for, or its build failed)
            sys.exit("gpu_gpt2: error: --batch-size auto needs an aot build to size it; give a number")
        results["batch_size"] = args.batch_size
        results["tokens_per_step"] = args.batch_size * SEQ_LEN
        flops = results["flops_per_step"] = flops_per_step(args.model, args.batch_size)
        write(results)
        for name in wanted:
            results["variants"][name] = run_variant(name, args, artifact, tmp, deadline, flops)
            results["goals"] = {**results["goals"], **goals(results["variants"])}
            write(results)
        if args.artifact is None and artifact is not None:
            shutil.rmtree(artifact, ignore_errors=True)
    summary = {
        n: {k: v.get(k) for k in ("cold_start_s", "step_s", "tokens_per_s", "mfu")} if v.get("ok") else v.get("error") for n, v in results["variants"].items()
    }
    print(json.dumps({"variants": summary, "goals": {k: v for k, v in results["goals"].items() if k.startswith(("compiled", "portable"))}}, indent=1))
    if not all(v.get("ok") for v in results["variants"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
