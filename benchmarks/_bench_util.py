"""Device-agnostic measurement and reporting helpers for the benchmarks in this folder.

Nothing here knows about the JSD loss: timing, peak memory, the environment record and the
output formats.
"""

from __future__ import annotations

import csv
import gc
import importlib.metadata
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

GIB = 1024**3

# One call of the code under test; what it returns (e.g. the loss) is kept from the last call.
Step = Callable[[], Optional[torch.Tensor]]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work; a no-op on CPU."""
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def free_memory(device: torch.device) -> None:
    """Return cached blocks so the next measurement starts from the same state."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def available_bytes(device: torch.device) -> int | None:
    """Bytes that a new allocation can still get: driver-free plus the allocator's cache.

    None where the device has no such statistic (CPU).
    """
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached


@dataclass(frozen=True)
class Measurement:
    """Timings of the timed calls, the first call's wall time and the peak extra memory."""

    times_ms: list[float]
    first_call_s: float
    peak_extra_bytes: int | None
    last_output: torch.Tensor | None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)


def _wall_seconds(step: Step, device: torch.device) -> tuple[float, torch.Tensor | None]:
    synchronize(device)
    start = time.perf_counter()
    out = step()
    synchronize(device)
    return time.perf_counter() - start, out


def _time_once_ms(step: Step, device: torch.device) -> tuple[float, torch.Tensor | None]:
    if device.type != "cuda":
        seconds, out = _wall_seconds(step, device)
        return seconds * 1e3, out
    # Timed on the device's clock, between events queued before and after the call.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def _peak_extra_bytes(step: Step, device: torch.device) -> int | None:
    """Peak allocated during one call above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def measure(
    step: Step, reset: Callable[[], None], device: torch.device, warmup: int, iters: int
) -> Measurement:
    """Warm up, measure peak memory in one extra call (CUDA only), then time `iters` calls.

    `reset` runs before every call, outside the timed region (e.g. it drops gradients so
    nothing accumulates and the memory baseline holds only inputs and weights). The first
    warm-up call is timed on the wall clock: it carries compilation and autotuning.
    """
    if warmup < 1 or iters < 1:
        raise ValueError("need at least one warm-up and one timed call")
    reset()
    first_call_s, _ = _wall_seconds(step, device)
    for _ in range(warmup - 1):
        reset()
        step()
    reset()
    peak = _peak_extra_bytes(step, device)
    times_ms, out = [], None
    for _ in range(iters):
        reset()
        elapsed_ms, out = _time_once_ms(step, device)
        times_ms.append(elapsed_ms)
    return Measurement(times_ms, first_call_s, peak, out)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if device.type == "cpu" and cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or device.type


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(repo: Path) -> str | None:
    """HEAD's hash, with "-dirty" when the working tree differs from it."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:  # git not installed
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device, repo: Path, packages: Iterable[str]) -> dict[str, Any]:
    """What produced the numbers: versions, device, commit (None outside a git checkout)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        **{name: _package_version(name) for name in packages},
        "device": str(device),
        "device_name": device_name(device),
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "commit": git_commit(repo),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows may differ in keys: the header is their union, in first-seen order."""
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
