"""An interpreter started as a fork of the zygote (_zygote.py), for pytest-xdist's workers
and multiprocessing's fork server.

pytest-xdist starts each worker through execnet as ``python -u -c BOOTSTRAP`` with pipes for
stdin and stdout. ``forked_popen_args`` makes execnet start instead ``python -I -S
_forked_python.py SOCKET -u -c BOOTSTRAP``: this script, standard library only and without
site (so it starts fast), hands its stdin, stdout and stderr with the command, working
directory, environment and process group to the zygote listening on SOCKET, which forks the
worker into that group; the script ends as the worker does, with its exit status. The worker
starts with torch and torch._dynamo imported instead of importing them, and skips the
interpreter's teardown (what each costs: benchmarks/results/cpu/readme_commands.txt).

multiprocessing starts its fork server (the plugin's ranks fork from it) as ``python -c
'from multiprocessing.forkserver import main; main(LISTENER_FD, ALIVE_FD, ...)'`` with those
two descriptors kept open. ``forked_spawnv_passfds`` makes it ``python -I -S
_forked_python.py --keep-fds=LISTENER_FD,ALIVE_FD SOCKET -c ...``, and the zygote's fork finds
them under the same numbers: a server that imported torch already, as the one a run starts
would have done first.
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


KEEP_FDS = "--keep-fds="
FORKSERVER_COMMAND = "from multiprocessing.forkserver import main"


def request(
    socket_path: str,
    argv: list[str],
    fds: list[int],
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    process_group: int | None = None,
) -> socket.socket:
    """Ask the zygote at socket_path for a process running argv on fds (stdin, stdout,
    stderr, then any others, each under its number here), in cwd and env (by default this
    process's), in process_group (by default a group of its own); the connection answers its
    pid, then its exit status, one line each."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    payload = {
        "argv": argv,
        "cwd": os.getcwd() if cwd is None else cwd,
        "env": dict(os.environ if env is None else env),
        "fds": [0, 1, 2, *fds[3:]],
        "process_group": process_group,
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


def forked_spawnv_passfds(
    original: Callable[..., int], socket_path: Callable[[], str]
) -> Callable[..., int]:
    """multiprocessing.util.spawnv_passfds (how multiprocessing starts an interpreter that
    keeps some descriptors), made to start the fork server as a fork of the zygote listening
    on socket_path(). Other interpreters (spawned processes, the resource tracker) are left
    alone."""

    def spawnv_passfds(path: str, args: list[str], passfds: Any) -> int:
        if "-c" in args and args[args.index("-c") + 1].startswith(FORKSERVER_COMMAND):
            kept = ",".join(str(fd) for fd in sorted(passfds))
            args = [path, "-I", "-S", SCRIPT, f"{KEEP_FDS}{kept}", socket_path(), *args[1:]]
        return original(path, args, passfds)

    return spawnv_passfds


def main() -> None:
    kept: list[int] = []
    if sys.argv[1].startswith(KEEP_FDS):
        kept = [int(fd) for fd in sys.argv.pop(1)[len(KEEP_FDS) :].split(",")]
    socket_path, argv = sys.argv[1], sys.argv[2:]
    connection = request(socket_path, argv, [0, 1, 2, *kept], process_group=os.getpgid(0))
    for fd in kept:  # the forked process has them now
        os.close(fd)
    answers = connection.makefile("rb")
    answers.readline()  # the pid: the zygote kills the process if this one ends first
    status = int(answers.readline())
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
