"""Where a CUDA AOTInductor package crashes on load (issue 25): run by scripts/gpu_check.sh.

On the H200 machine (torch 2.11+cu130) every aot CUDA package segfaulted inside
`AOTIModelPackageLoader(...)` (runner/execution/compiled.py, load_compiled), before any input was given,
for examples/gpt.py in fp32 and GPT-2 in bf16 alike. This loads packages one way at a time, each in
its own process (a segfault ends only that one), to tell apart the candidates:

  tiny-raw          a one-layer package straight from torch's aoti_compile_and_package, loaded by
                    torch's own aoti_load_package: whether AOTInductor CUDA packages load here at all
  tiny-raw-args     the same package through the loader call aot makes (device index 0)
  tiny-rewritten    the same package after aot's rewrite for reproducible bytes (_reproducible)
  artifact-torch    the artifact's package, through torch's aoti_load_package (device index -1)
  artifact-aot      the artifact's package, as the runner loads it

    python scripts/aoti_cuda_probe.py OUT.json                  # the tiny package's three cases
    python scripts/aoti_cuda_probe.py OUT.json ARTIFACT --artifact-only   # the artifact's two

Writes one JSON: per case its exit status (negative: the signal), seconds and the last lines of
its output (faulthandler's stack on a crash), and the entries of each package.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_LOAD = """
import sys, torch
import runner.execution.attention  # the fused attention aot's GPU programs call (the runner imports it too)
path, how = sys.argv[1], sys.argv[2]
if how == "torch":
    from torch._inductor import aoti_load_package
    model = aoti_load_package(path)
    loader = model.loader
else:
    loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, int(how))
print("loaded; call spec:", loader.get_call_spec()[0][:200], flush=True)
if len(sys.argv) > 3:  # the tiny package: run it once
    out = loader.run([torch.ones(2, 8, device="cuda")])
    print("ran:", out[0].sum().item(), flush=True)
"""


def _case(path: Path, how: str, run: bool = False) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-X", "faulthandler", "-c", _LOAD, str(path), how, *(["run"] if run else [])]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        rc, out = r.returncode, (r.stdout + r.stderr)
    except subprocess.TimeoutExpired as e:
        rc, out = "timed out", str(e.stdout or "") + str(e.stderr or "")
    return {"rc": rc, "seconds": round(time.time() - t0, 1), "tail": out.strip().splitlines()[-25:]}


def _entries(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return [f"{i.filename} {i.file_size}" for i in z.infolist()]


class _Skipped(Exception):
    """--artifact-only: the tiny package is not made."""


def main() -> None:
    import torch

    from aot.emit.aoti import _reproducible, cuda_inductor_configs

    args = [a for a in sys.argv[1:] if a != "--artifact-only"]
    out_path = Path(args[0])
    artifact = Path(args[1]) if len(args) > 1 else None
    tiny = "--artifact-only" not in sys.argv
    result: dict = {"torch": torch.__version__, "cases": {}, "packages": {}}
    with tempfile.TemporaryDirectory(prefix="aoti-probe-") as tmp:
        raw = Path(tmp) / "tiny.pt2"
        t0 = time.time()
        try:
            if not tiny:
                raise _Skipped
            ep = torch.export.export(torch.nn.Linear(8, 8).cuda(), (torch.randn(2, 8, device="cuda"),))
            torch._inductor.aoti_compile_and_package(ep, package_path=str(raw), inductor_configs=cuda_inductor_configs(torch.__version__))
            result["tiny_compile_s"] = round(time.time() - t0, 1)
        except _Skipped:
            pass
        except Exception as e:
            result["tiny_compile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        if raw.is_file():
            rewritten = Path(tmp) / "tiny_rewritten.pt2"
            rewritten.write_bytes(_reproducible(raw.read_bytes()))
            result["packages"]["tiny"] = _entries(raw)
            result["cases"]["tiny-raw"] = _case(raw, "torch", run=True)
            result["cases"]["tiny-raw-args"] = _case(raw, "0", run=True)
            result["cases"]["tiny-rewritten"] = _case(rewritten, "0", run=True)
        manifest = json.loads((artifact / "manifest.json").read_text()) if artifact and (artifact / "manifest.json").is_file() else {}
        if manifest.get("compiled"):
            package = artifact / manifest["compiled"]["programs"]["train"]["file"]
            result["packages"]["artifact"] = _entries(package)
            result["cases"]["artifact-torch"] = _case(package, "torch")
            result["cases"]["artifact-aot"] = _case(package, "0" if torch.cuda.is_available() else "-1")
    out_path.write_text(json.dumps(result, indent=1))
    for name, case in result["cases"].items():
        print(f"aoti probe: {name}: exit {case['rc']} in {case['seconds']} s: {case['tail'][-1] if case['tail'] else ''}")


if __name__ == "__main__":
    main()
