"""pytester's subprocess runs, forked from a process that has imported torch already.

A test that needs its generated run in a process of its own (the run installs the simulated
npu, or changes other process-wide torch state) pays for a new interpreter: most of a one-test
run as `python -m pytest` is importing torch and torch._dynamo and the interpreter's exit,
which tears down every module torch loaded. A zygote, one per test process, imports both once
and forks a child for each run, which leaves the run itself (the figures:
benchmarks/results/cpu/readme_commands.txt).

The child is the run's own process, as `python -m pytest` is: it takes the caller's working
directory, environment and PYTHONPATH, and writes to its own stdout and stderr files. It
ends as `os._exit` does, after the atexit handlers: non-daemon threads are not joined and
modules are not torn down, so a run that would hang or fail only in the interpreter's exit
needs pytester.runpytest_subprocess. So does a test that checks what a fresh interpreter has
or has not imported (the plugin's torch-free start, the order of imports around the
simulated npu): here torch is imported before the run, so the plugin resolves an automatic
device as the run starts (on a CUDA host, initialising CUDA there), not at the first test
that needs it. So are pytest and its default plugins,
which a run imports before its assertion rewriting starts, and the plugins it loads from entry
points (this package's among them) with hypothesis, imported through an assertion-rewriting
hook that marks what a run's marks, so that a run finds them as its own rewriting would have
left them (on pytest 9.1 or later). The zygote freezes what it imported out of the garbage
collector's reach, which halves the collections pytest runs at its end.

The runs' pytest-xdist workers are forked from the zygote too (_forked_python.py), and so are
those of in-process runs (the conftest's ``_forked_xdist_workers`` fixture), and the fork
server from which the plugin forks the ranks of a forked run or of such a worker.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _forked_python
import pytest
from _pytest.pathlib import make_numbered_dir

ZYGOTE_SCRIPT = Path(__file__).with_name("_zygote.py")
# The zygote starts in this environment, the test process's before any test changed it: one
# started in a test that had set PYTHONPATH or a thread count would import with them, and
# every process forked from it would inherit what it imported.
ZYGOTE_ENVIRONMENT = dict(os.environ)


class _Zygote:
    """The zygote of this test process, started at its first use and killed at exit."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._socket = ""

    def socket_path(self) -> str:
        if self._process is None or self._process.poll() is not None:
            folder = tempfile.mkdtemp(prefix="gradref-zygote-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            self._socket = os.path.join(folder, "socket")
            self._process = subprocess.Popen(
                [sys.executable, str(ZYGOTE_SCRIPT), self._socket],
                env=ZYGOTE_ENVIRONMENT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(self._process.kill)
            assert self._process.stdout is not None
            if self._process.stdout.readline().strip() != "ready":
                raise RuntimeError("the zygote that forks test runs did not start; see above")
        return self._socket

    @property
    def pid(self) -> int:
        """The zygote's process id, starting it if it has not started."""
        self.socket_path()
        assert self._process is not None
        return self._process.pid


zygote = _Zygote()


def run_pytest(
    arguments: list[str],
    *,
    cwd: str | os.PathLike[str],
    env: dict[str, str],
    stdout: Path,
    stderr: Path,
    timeout: float | None = None,
) -> int:
    """``python -m pytest ARGUMENTS`` in cwd and env, forked from the zygote, its output
    written to the two files: its exit status (negative: the signal that ended it). Past
    timeout the run is killed and TimeoutError raised. Where the platform cannot fork or pass
    file descriptors, a new interpreter runs it."""
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(open(os.devnull)),
            stack.enter_context(stdout.open("w")),
            stack.enter_context(stderr.open("w")),
        ]
        if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
            command = [sys.executable, "-m", "pytest", *arguments]
            try:
                done = subprocess.run(
                    command,
                    cwd=cwd,
                    env=env,
                    stdin=files[0],
                    stdout=files[1],
                    stderr=files[2],
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                message = f"{timeout} second timeout expired running: {arguments}"
                raise TimeoutError(message) from None
            return done.returncode
        fds = [handle.fileno() for handle in files]
        argv = ["-m", "pytest", *arguments]
        connection = _forked_python.request(zygote.socket_path(), argv, fds, env, os.fspath(cwd))
    with connection, connection.makefile("rb") as answers:
        pid = int(answers.readline())
        connection.settimeout(timeout)
        try:
            return int(answers.readline())
        except socket.timeout:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            raise TimeoutError(f"{timeout} second timeout expired running: {arguments}") from None


def runpytest_forked(
    pytester: pytest.Pytester, *args: str | os.PathLike[str], timeout: float | None = None
) -> pytest.RunResult:
    """pytester.runpytest_subprocess's run and result, in a child forked from the zygote."""
    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    arguments = [f"--basetemp={basetemp}", *map(os.fspath, args)]
    for plugin in pytester.plugins:
        arguments = ["-p", str(plugin), *arguments]
    stdout, stderr = pytester.path / "stdout", pytester.path / "stderr"
    # As pytester gives its subprocesses: the working directory first on PYTHONPATH.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get("PYTHONPATH", "")])
    )
    print("running (forked): pytest", *arguments)
    started = time.perf_counter()
    try:
        code = run_pytest(
            arguments, cwd=os.getcwd(), env=env, stdout=stdout, stderr=stderr, timeout=timeout
        )
    except TimeoutError as timed_out:
        raise pytester.TimeoutExpired(str(timed_out)) from None
    elapsed = time.perf_counter() - started
    out = stdout.read_text(encoding="utf8").splitlines()
    err = stderr.read_text(encoding="utf8").splitlines()
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    ret: int | pytest.ExitCode = code
    with contextlib.suppress(ValueError):
        ret = pytest.ExitCode(code)
    return pytest.RunResult(ret, out, err, elapsed)
