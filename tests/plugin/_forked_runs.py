"""pytester's subprocess runs, forked from a process that has imported torch already.

A test that needs its generated run in a process of its own (the run installs the simulated
npu, or changes other process-wide torch state) pays for a new interpreter: on a 2-core CPU,
a one-test run took 1.9 s as `python -m pytest`, of which importing torch and torch._dynamo
is about 1.2 s and the interpreter's exit, which tears down every module torch loaded, about
0.7 s; the run itself is about 0.4 s. A zygote, one per test process, imports both once and
forks a child for each run: 0.4 s.

The child is the run's own process, as `python -m pytest` is: it takes the caller's working
directory, environment and PYTHONPATH, and writes to its own stdout and stderr files. It
ends as `os._exit` does, after the atexit handlers: non-daemon threads are not joined and
modules are not torn down, so a run that would hang or fail only in the interpreter's exit
needs pytester.runpytest_subprocess. So does a test that checks what a fresh interpreter has
or has not imported (the plugin's torch-free start, the order of imports around the
simulated npu): here torch is imported before the run. pytest, its plugins and this package
are not, so pytest's assertion rewriting and entry-point loading see them as in a new
interpreter. The zygote freezes what it imported out of the garbage collector's reach, which
halves the collections pytest runs at its end.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
from _pytest.pathlib import make_numbered_dir

# Reads one request per line from stdin: forks, and in the child runs pytest as `python -m
# pytest` would; answers the child's exit status, or "timeout" where it ran past the
# request's timeout and was killed with its process group.
_ZYGOTE = r"""
import gc, json, os, signal, sys, time
import torch, torch._dynamo

gc.freeze()

base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *base_path]
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        import atexit, runpy, traceback
        sys.argv = ["-m", *request["args"]]
        try:
            runpy.run_module("pytest", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else int(end.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = None if request["timeout"] is None else time.monotonic() + request["timeout"]
    while True:
        ended, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if ended:
            print(os.waitstatus_to_exitcode(status), flush=True)
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("timeout", flush=True)
            break
        time.sleep(0.02)
"""


class _Zygote:
    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(self._process.kill)
        return self._process

    def run(self, request: dict[str, object]) -> int | None:
        """The child's exit status, or None where it ran past the request's timeout."""
        process = self._started()
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        answer = process.stdout.readline().strip()
        if not answer:
            raise RuntimeError("the zygote that forks pytest runs ended; its error is above")
        return None if answer == "timeout" else int(answer)


_zygote = _Zygote()


def runpytest_forked(
    pytester: pytest.Pytester, *args: str | os.PathLike[str], timeout: float | None = None
) -> pytest.RunResult:
    """pytester.runpytest_subprocess's run and result, in a child forked from the zygote."""
    if not hasattr(os, "fork"):
        return pytester.runpytest_subprocess(*args, timeout=timeout)
    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    arguments = [f"--basetemp={basetemp}", *map(os.fspath, args)]
    for plugin in pytester.plugins:
        arguments = ["-p", str(plugin), *arguments]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get("PYTHONPATH", "")])
    )
    stdout, stderr = pytester.path / "stdout", pytester.path / "stderr"
    request = {
        "args": arguments,
        "cwd": os.getcwd(),
        "env": env,
        "stdout": str(stdout),
        "stderr": str(stderr),
        "timeout": timeout,
    }
    print("running (forked): pytest", *arguments)
    started = time.perf_counter()
    code = _zygote.run(request)
    if code is None:
        raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: {arguments}")
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
