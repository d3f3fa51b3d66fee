"""The zygote of _forked_runs.py: imports torch once, then forks a process for each request.

Run as ``python _zygote.py SOCKET``. A request is a connection to the Unix socket SOCKET that
sends file descriptors (the new process's stdin, stdout and stderr, then any others it keeps)
with one JSON line: the process's ``argv`` (what follows the interpreter on a command line,
``-m pytest ...`` or ``-u -c CODE``), ``cwd``, ``env``, ``fds`` (the number each descriptor
takes in the process) and ``process_group`` (null: a group of its own). For each, the zygote
forks a waiter, which forks the process, answers its pid, waits for it and answers its exit
status (negative: the signal that ended it). A client that hangs up before has the process
killed, with its group where it leads one.

The process starts as the interpreter would, with torch, torch._dynamo, pytest's own modules and
the plugins pytest loads (rewritten as a run rewrites them) already imported, and ends as
``os._exit`` does once the atexit handlers ran (no teardown of the modules).
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import multiprocessing.util
import os
import runpy
import select
import signal
import socket
import sys
import traceback
import types
from typing import Any

import _forked_python
import _pytest.assertion
import pytest
import torch
import torch._dynamo  # noqa: F401
from _pytest.config import default_plugins, get_config
from execnet import gateway_io

# pytest and its default plugins: a run imports them before it installs its assertion
# rewriting, which leaves pytest's own modules alone, so here they are what they would be in
# a new interpreter (the CPU this saves a run: benchmarks/results/cpu/readme_commands.txt).
for _name in default_plugins:
    importlib.import_module(f"_pytest.{_name}")


def import_plugins_rewritten() -> None:
    """Import the plugins a run loads from entry points, and hypothesis, which its plugin
    imports at the end of every run, through an assertion-rewriting hook that marks the names
    a run's hook marks (pytest's own code), then take the hook out again.

    A run's hook finds them already rewritten by a hook of its kind, as its own import would
    have left them, and imports nothing again; imported without a hook, they would draw its
    "Module already imported so cannot be rewritten" warning. Where plugin autoloading is off
    a run marks nothing, so nothing is imported here; nor before pytest 9.1, whose hook cannot
    be built before a run has read its ini file (the runs import them themselves). The hook
    reads the ini's defaults: a run whose ini enables assertion pass hooks would get the
    plugins without them."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") or pytest.version_tuple < (9, 1):
        return
    config = get_config()
    hook = _pytest.assertion.install_importhook(config)
    try:
        config._mark_plugins_for_rewrite(hook, False)
        for entry_point in importlib.metadata.entry_points(group="pytest11"):
            importlib.import_module(entry_point.module)
        if importlib.util.find_spec("hypothesis") is not None:
            importlib.import_module("hypothesis")
    finally:
        sys.meta_path.remove(hook)


import_plugins_rewritten()

# sys.path[0] is this script's folder: a new interpreter would have the command's own there.
BASE_PATH = [
    entry
    for entry in sys.path[1:]
    if entry not in os.environ.get("PYTHONPATH", "").split(os.pathsep)
]


def main(socket_path: str) -> None:
    gateway_io.popen_args = _forked_python.forked_popen_args(
        gateway_io.popen_args, lambda: socket_path
    )
    multiprocessing.util.spawnv_passfds = _forked_python.forked_spawnv_passfds(
        multiprocessing.util.spawnv_passfds, lambda: socket_path
    )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    # What is loaded now stays for every child: out of the collector's way, and the waiters
    # reaped by the kernel.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _wait_on(connection)
        connection.close()


def _wait_on(connection: socket.socket) -> None:
    """The waiter: start the requested process, answer its pid and its exit status."""
    request, fds = _receive(connection)
    wakeup, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd in (wakeup, wake, connection.fileno()):
            os.close(fd)
        _run(request, fds)
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    while True:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        readable, _, _ = select.select([connection, wakeup], [], [])
        if wakeup in readable:
            os.read(wakeup, 512)
        if connection in readable and not connection.recv(1):
            if request["process_group"] is None:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def _freeze_the_startup_path() -> None:
    """pytest-xdist keeps the sys.path of its import as the interpreter's startup path and
    gives it to its local workers as theirs: imported here, that is the zygote's (this
    script's folder first, then the zygote's PYTHONPATH), not the run's. A new interpreter
    would have imported it on the path the process has now."""
    xdist_plugin = sys.modules.get("xdist.plugin")
    startup_path = getattr(xdist_plugin, "_sys_path", None)
    if isinstance(startup_path, list):  # the list xdist.workermanage imported too
        startup_path[:] = sys.path


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 16)
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            raise EOFError("the request ended before its newline")
        data += more
    return json.loads(data), fds


def _run(request: dict[str, Any], fds: list[int]) -> None:
    """The process: as the interpreter would run the request's argv."""
    os.setpgid(0, request["process_group"] or 0)
    targets = request["fds"]
    # Out of the targets' way first: a descriptor received under one target's number would be
    # overwritten by the move to that target.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, max(targets) + 1) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)
        os.close(fd)
    cwd, env, argv = str(request["cwd"]), dict(request["env"]), list(request["argv"])
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    code = 0
    try:
        if argv[:2] == ["-m", "pytest"]:
            sys.path[:] = [cwd, *extra, *BASE_PATH]
            _freeze_the_startup_path()
            sys.argv = ["-m", *argv[2:]]
            runpy.run_module("pytest", run_name="__main__", alter_sys=True)
        else:
            source = argv[argv.index("-c") + 1]
            sys.path[:] = ["", *extra, *BASE_PATH]
            _freeze_the_startup_path()
            sys.argv = ["-c", *argv[argv.index("-c") + 2 :]]
            if "-u" in argv:
                sys.stdout.reconfigure(write_through=True)
                sys.stderr.reconfigure(write_through=True)
            # A `-c` command's __main__ has no file (multiprocessing's spawned and forkserver
            # children run the parent's __main__ file again: here it would be the zygote's).
            main_module = types.ModuleType("__main__")
            sys.modules["__main__"] = main_module
            exec(compile(source, "<string>", "exec"), main_module.__dict__)
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1])
