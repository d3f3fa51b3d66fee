"""An interpreter started as a fork of the zygote (_zygote.py), for pytest-xdist's workers.

pytest-xdist starts each worker through execnet as ``python -u -c BOOTSTRAP`` with pipes for
stdin and stdout. ``start_workers_forked(SOCKET)`` makes execnet start instead ``python -I -S
_forked_python.py SOCKET -u -c BOOTSTRAP``: this script, standard library only and without
site (so it starts fast), hands its stdin, stdout and stderr with the command, working
directory and environment to the zygote listening on SOCKET, which forks the worker; the
script ends as the worker does, with its exit status. The worker starts with torch and
torch._dynamo imported instead of importing them, and skips the interpreter's teardown
(what each costs: benchmarks/results/cpu/readme_commands.txt).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

SCRIPT = os.path.abspath(__file__)


def request(
    socket_path: str,
    argv: list[str],
    fds: list[int],
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> socket.socket:
    """Ask the zygote at socket_path for a process running argv on fds (stdin, stdout,
    stderr), in cwd and env (by default this process's); the connection answers its pid, then
    its exit status, one line each."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    payload = {
        "argv": argv,
        "cwd": os.getcwd() if cwd is None else cwd,
        "env": dict(os.environ if env is None else env),
    }
    socket.send_fds(connection, [json.dumps(payload).encode() + b"\n"], fds)
    return connection


def forked_popen_args(
    original: Callable[[Any], list[str]], socket_path: Callable[[], str]
) -> Callable[[Any], list[str]]:
    """execnet's popen_args (the command of a popen gateway, pytest-xdist's workers), made to
    start the gateway as a fork of the zygote listening on socket_path()."""

    def popen_args(spec: Any) -> list[str]:
        args = original(spec)
        if getattr(spec, "python", None):  # an interpreter named in --tx: left alone
            return args
        return [sys.executable, "-I", "-S", SCRIPT, socket_path(), *args[1:]]

    return popen_args


def main() -> None:
    socket_path, argv = sys.argv[1], sys.argv[2:]
    answers = request(socket_path, argv, [0, 1, 2]).makefile("rb")
    answers.readline()  # the pid: the zygote kills the process if this one ends first
    status = int(answers.readline())
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
