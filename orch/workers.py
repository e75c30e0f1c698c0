"""Several manager processes on one port: the parent binds the socket and forks the workers
(before any event loop exists), which inherit it; the kernel spreads the connections among them.
Each worker is a full replica, as if started on its own: nothing is shared but the socket."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable

#: Runs one worker on the shared socket with its replica id; returns its exit code.
Worker = Callable[[socket.socket, str], int]


def listening(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_workers(host: str, port: int, workers: int, worker: Worker) -> int:
    """Fork and supervise ``workers`` processes; 0 when all stopped on a signal, 1 when one of
    them failed (the others are stopped then)."""
    from orch_manager.leader import new_holder_id

    sock = listening(host, port)
    children: set[int] = set()
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # a worker: never returns into the parent's code
            code = 1
            try:
                code = worker(sock, new_holder_id())
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.add(pid)
    sock.close()
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            _signal(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        children.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not stopping:
            code = 1
            stop(signal.SIGTERM, None)
    return code


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
