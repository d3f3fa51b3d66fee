"""How many CPU threads each test process computes with (``--gradref-threads``).

torch's CPU operators use as many threads as the host has cores, in every process. Under
pytest-xdist every worker does, so ``-n 2`` on a 2-core host runs 4 busy threads on 2 cores, and
an operator's threads wait on each other at every parallel region: on this repository's suites,
small operators (a reference's randomly rounded runs, a kernel's chunks) ran 3 to 4 times slower
than with one thread per worker. ``split`` gives each worker its share of the cores instead.

The count is applied at configure time, where an xdist worker knows it is one: through
``torch.set_num_threads`` where torch is imported already (a conftest that imports it), and
through ``OMP_NUM_THREADS``, which torch reads when it is imported later and which the
processes a test starts (pytester's subprocesses, a multi-rank test's ranks) inherit. Nothing
here imports torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# The environment variable that OpenMP, and so torch's CPU thread pool, reads at start.
OMP_ENV = "OMP_NUM_THREADS"
# The thread settings: torch's own count, or each xdist worker's share of the cores.
TORCH_CHOICE = "torch"
SPLIT_CHOICE = "split"


@dataclass(frozen=True)
class ThreadPlan:
    """The threads this process computes with, and why, as the header says it: ``count``
    None where the process keeps torch's own count."""

    count: int | None
    why: str


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(len(affinity(0)), 1)
    return os.cpu_count() or 1


def plan_threads(
    choice: int | str, workers: int | None, cores: int, omp_env: str | None
) -> ThreadPlan:
    """The thread count for ``choice`` (TORCH_CHOICE, SPLIT_CHOICE or a positive integer) in
    a test process, one of ``workers`` xdist workers (None outside xdist), on ``cores``.

    An explicit count is applied as given. ``split`` divides the cores among the workers, at
    least one each, and yields to an ``OMP_NUM_THREADS`` the environment sets already (the
    user's choice, or a parent test process's share); outside xdist the one process keeps
    torch's own count, which is the whole host."""
    if isinstance(choice, int):
        return ThreadPlan(choice, f"{choice} thread(s), from the gradref threads setting")
    if choice == TORCH_CHOICE:
        return ThreadPlan(None, "torch's own count")
    if omp_env:
        return ThreadPlan(None, f"{OMP_ENV}={omp_env} from the environment")
    if workers is None or workers <= 1:
        return ThreadPlan(None, "torch's own count: one test process")
    count = max(cores // workers, 1)
    return ThreadPlan(count, f"split: {cores} cores among {workers} xdist workers")


def apply_threads(plan: ThreadPlan) -> None:
    """Make this process, and the processes it starts, compute with ``plan.count`` threads."""
    if plan.count is None:
        return
    os.environ[OMP_ENV] = str(plan.count)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(plan.count)
