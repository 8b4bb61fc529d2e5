"""How zoo's launcher (:mod:`zoo.operations.launcher`) and its ranks talk, on every node: a TCPStore the launcher serves.

The launcher serves the store (:func:`serve`) and names it to every rank in ``$ZOO_LAUNCHER_STORE``
(``host:port``): through the environment on its own node, through DeepSpeed's environment file
(``DS_ENV_FILE``) on the nodes pdsh or mpirun reach. Through the store:

* the launcher asks every rank to stop (:func:`request_stop`; the key holds the reason, e.g. "signal
  SIGTERM"), so a stop reaches ranks that are no descendants of the launcher, and no other job's;
* the ranks see the launcher alive (:class:`LauncherLink`, polled by :mod:`zoo.operations.launcher_watch`): the
  connection fails as soon as the launcher's process is gone, even after SIGKILL;
* every rank reports an early stop (:func:`report_stop`: why, after which iteration) once the stop's
  checkpoint is saved and ``latest`` names it (the save ends with a barrier after ``latest``), never
  before. The launcher reads the report after every process of the job has exited
  (:func:`read_stop_report`), so "a report is there" means "stopped and checkpointed", on every node
  that runs ranks of the launcher.

Without the variable (the plain ``deepspeed`` launcher, the test harness) nothing is reported.

This module imports nothing from zoo: every layer may use it.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

__all__ = ["STORE_VARIABLE", "LauncherLink", "serve", "request_stop", "report_stop", "read_stop_report",
           "store_address"]

STORE_VARIABLE = "ZOO_LAUNCHER_STORE"
CONNECT_TIMEOUT_S = 10.0     # a rank that cannot reach its launcher in this time goes on without it
STOP_KEY = "zoo/stop"        # the launcher's request: the reason
REPORT_KEY = "zoo/stopped"   # the ranks' report: {"stopped_by": ..., "iteration": ...}


def store_address(environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """(host, port) of the launcher's store from ``$ZOO_LAUNCHER_STORE``; None without it (or unreadable)."""
    environ = os.environ if environ is None else environ
    host, _, port = environ.get(STORE_VARIABLE, "").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def serve():
    """The launcher's store: listening on every interface, on a free port (``.port``)."""
    from torch.distributed import TCPStore  # local: torch's import cost, paid only by the launcher and ranks

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def connect(address: tuple[str, int], timeout_s: float | None = None):
    """A client of the launcher's store; OSError (one sentence) when it cannot be reached in ``timeout_s``
    (:data:`CONNECT_TIMEOUT_S` by default)."""
    from torch.distributed import TCPStore  # local: torch's import cost

    host, port = address
    timeout_s = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise OSError(f"zoo's launcher at {host}:{port} ({STORE_VARIABLE}) cannot be reached: "
                      f"{str(err).splitlines()[0]}") from None


def request_stop(store, reason: str) -> None:
    """Ask every rank to stop with a checkpoint (the first reason stays)."""
    if not store.check([STOP_KEY]):
        store.set(STOP_KEY, reason)


class LauncherLink:
    """A rank's connection to its launcher's store (see the module)."""

    def __init__(self, address: tuple[str, int], timeout_s: float | None = None):
        self.address = address
        self.store = connect(address, timeout_s)

    def requested_stop(self) -> str | None:
        """The reason the launcher asked every rank to stop, or None; OSError once the launcher is gone."""
        try:
            if not self.store.check([STOP_KEY]):
                return None
            return self.store.get(STOP_KEY).decode()
        except RuntimeError as err:
            raise OSError(f"zoo's launcher at {self.address[0]}:{self.address[1]} is gone ({err})") from None

    def describe_exit(self) -> str:
        return f"the exit of zoo's launcher ({self.address[0]}:{self.address[1]})"


def report_stop(reason: str, iteration: int, environ: dict[str, str] | None = None) -> bool:
    """Tell the launcher the run stopped after ``iteration`` with a checkpoint; False without a launcher
    (no ``$ZOO_LAUNCHER_STORE``), OSError when it cannot be reached. Call it on every rank, only after
    the stop's checkpoint and its ``latest`` are written."""
    address = store_address(environ)
    if address is None:
        return False
    store = connect(address)
    try:
        store.set(REPORT_KEY, json.dumps({"stopped_by": reason, "iteration": iteration}))
    except RuntimeError as err:
        raise OSError(f"zoo's launcher at {address[0]}:{address[1]} did not take the stop report ({err})") from None
    return True


def read_stop_report(store) -> dict[str, Any] | None:
    """The ranks' stop report in the launcher's ``store``, or None when there is none."""
    if not store.check([REPORT_KEY]):
        return None
    try:
        report = json.loads(store.get(REPORT_KEY))
    except ValueError:
        return None
    return report if isinstance(report, dict) and "stopped_by" in report else None
