"""Reading the kernel's names for devices and CPUs: PCI bus ids and cpulists.

NVML, sysfs and profiles spell a PCI address differently; these helpers turn any spelling into
NVML's (what profiles store) and back into the name sysfs uses. Pure functions, no torch.
"""

from __future__ import annotations

import re

from runner.errors import AotError

BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{4}|[0-9a-fA-F]{8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
CPULIST = re.compile(r"^\s*\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*\s*$")


def normalize_bus_id(bus_id: str) -> str:
    """Any PCI address spelling -> NVML's: 8 hex digits of domain, upper case (`00000000:07:00.0`)."""
    m = BUS_ID.match(bus_id.strip()) if isinstance(bus_id, str) else None
    if not m:
        raise AotError(f"{bus_id!r} is not a PCI bus id (domain:bus:device.function, e.g. 00000000:07:00.0)")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):08X}:{bus.upper()}:{dev.upper()}.{fn}"


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's bus id -> the name sysfs uses (`0000:07:00.0`)."""
    domain, rest = normalize_bus_id(bus_id).split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def parse_cpulist(text: str) -> set[int]:
    """`0-3,8,10-11` (the kernel's cpulist format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.strip().split(","))):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus) -> str:
    """{0, 1, 2, 3, 8} -> `0-3,8`."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
