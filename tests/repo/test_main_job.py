"""The README's main job (`pytest tests/kernels -m "not exhaustive" -n auto`) still runs the
kernel through every path its device has: the selection is collected as the README runs it
and checked for each path's tests, and for what the exhaustive marker leaves out: the large
shapes everywhere, the Triton kernels only where Triton runs in its CPU interpreter."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
from _forked_runs import run_pytest

ROOT = Path(__file__).resolve().parents[2]


def _collected(triton_interpret: str, *args: str) -> list[str]:
    """The node ids `pytest tests/kernels *args --collect-only` selects, with TRITON_INTERPRET
    set as a machine without CUDA ("1") or with it ("0") has it; in a process of its own,
    forked from the zygote (_forked_runs.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GRADREF_"))}
    env["TRITON_INTERPRET"] = triton_interpret
    with tempfile.TemporaryDirectory() as folder:
        stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
        arguments = ["tests/kernels", "--collect-only", "-q", *args]
        code = run_pytest(arguments, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
        out, err = stdout.read_text(), stderr.read_text()
    assert code == 0, out[-3000:] + err[-3000:]
    return [line for line in out.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def main_job() -> list[str]:
    return _collected("1", "-m", "not exhaustive", "-p", "no:randomly")


@pytest.fixture(scope="module")
def main_job_with_cuda() -> list[str]:
    # TRITON_INTERPRET=0: Triton compiles for the GPU, a path the device has. The kernels'
    # tests still collect on a CPU-only machine (they skip there when run).
    return _collected("0", "-m", "not exhaustive", "-p", "no:randomly")


def test_the_main_job_runs_every_path_of_the_cpu(main_job: list[str]) -> None:
    for path in (
        "test_fused_linear_jsd.py::test_correctness[",  # the module
        "test_fused_linear_jsd.py::test_correctness_functional[",  # the function
        "test_compile.py::test_compiled_function[torch-",  # torch.compile
        "test_vocab_parallel_jsd.py::test_two_ranks_match_the_full_reference[",  # ranks
        "test_ops.py::test_chunked_forward[torch-",  # the custom operators, opchecked
    ):
        assert any(path in node for node in main_job), path


def test_the_main_job_leaves_out_the_large_shapes_and_interpreted_triton(
    main_job: list[str], main_job_with_cuda: list[str]
) -> None:
    everything = set(_collected("1", "-p", "no:randomly"))
    with_cuda = set(main_job_with_cuda)
    # Everywhere: the large shapes, and nothing else.
    assert all("8x128x1024x4096" in node for node in everything - with_cuda)
    assert any("8x128x1024x4096" in node for node in everything - with_cuda)
    # Without CUDA also the Triton kernels' tests, each one (tests named for a Triton
    # parameter and tests of the Triton kernels alone), and no test of another path.
    interpreted = with_cuda - set(main_job)
    assert {node for node in with_cuda if "[triton" in node} <= interpreted
    assert not any(re.search(r"\[torch(-|\])", node) for node in interpreted)
    assert len(interpreted) > len({node for node in with_cuda if "[triton" in node})


def test_with_cuda_the_main_job_keeps_the_triton_kernels(main_job_with_cuda: list[str]) -> None:
    selected = main_job_with_cuda
    assert any("test_compile.py::test_compiled_function[triton-" in node for node in selected)
