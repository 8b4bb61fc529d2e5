"""What asked this process to stop: the signals and the launcher watch's reason, recorded, never fatal.

SIGTERM and SIGUSR1 (what SLURM and Kubernetes send before killing a job; zoo's launcher forwards them to the
ranks of its node) and a first SIGINT (Ctrl-C reaches every process of the foreground group) only append
"signal SIGTERM" (...) to :attr:`StopRequests.received`; a second SIGINT raises KeyboardInterrupt, the
immediate stop without checkpoint. The launcher watch (:mod:`zoo.operations.launcher_watch`) hands its reason
("the exit of the launcher (pid N, deepspeed)", or the stop zoo's launcher asked for) to the same list instead
of ending the process.

Installed (:meth:`StopRequests.install`), no stop request ends the process at whatever it is doing: a rank
killed in a collective leaves its peers a "Connection reset" traceback, its run directory's lock and no summary.
The training loop reads :attr:`~StopRequests.received` at its iteration boundaries
(:class:`zoo.training.stop_conditions.StopConditions`) and stops there with a checkpoint; a request that comes
after the last iteration's agreement finds the run finishing, and it finishes. The pretraining command installs
one for the whole process (:mod:`zoo.cli.pretrain`), so that a signal at any moment, from reading the config to
the process's exit, ends the run as finished or as stopped with a checkpoint.

``handle_signals`` False (``--no-exit-signal-handler``) leaves the signals their default action (the process
ends at once); the watch's reason is still recorded.

This module imports nothing from zoo but :mod:`zoo.operations.launcher_watch`: every layer may use it.
"""

from __future__ import annotations

import signal
from typing import Any

from zoo.operations.launcher_watch import current_watch

__all__ = ["STOP_SIGNALS", "StopRequests"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequests:
    """The stop requests of this process, first first (see the module)."""

    def __init__(self, handle_signals: bool = True):
        self.handle_signals = handle_signals
        self.received: list[str] = []
        self.installed = False
        self._previous_handlers: dict[int, Any] = {}
        self._watch = None

    def install(self) -> bool:
        """Record the signals (where ``handle_signals``) and the launcher watch's reason from now on; False,
        doing nothing, when this object is installed already (the caller then must not uninstall it)."""
        if self.installed:
            return False
        self.installed = True
        self.listen_to_watch()
        if self.handle_signals:
            for signum in STOP_SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return True

    def listen_to_watch(self) -> None:
        """Take the reason of this process's launcher watch, once one runs (it starts when the process joins
        its launcher's process group: call this again after joining). A watch that fired already hands its
        reason at once."""
        watch = current_watch()
        if self.installed and watch is not None and watch is not self._watch:
            self._watch = watch
            watch.listen(self.received.append)

    def stop_handling_signals(self) -> None:
        """Give the signals their previous handlers back (``--no-exit-signal-handler``, known only once the
        config is read); a signal recorded before is delivered again, so that it acts as it would have."""
        pending = [signum for signum in STOP_SIGNALS if f"signal {signal.Signals(signum).name}" in self.received]
        self._restore_signals()
        self.handle_signals = False
        for signum in pending:
            signal.raise_signal(signum)

    def uninstall(self) -> None:
        """The signals' previous handlers back, and the watch without a listener (it then ends the process)."""
        if self._watch is not None:
            self._watch.listen(None)
            self._watch = None
        self._restore_signals()
        self.installed = False

    def _restore_signals(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        reason = f"signal {signal.Signals(signum).name}"
        if signum == signal.SIGINT and reason in self.received:
            raise KeyboardInterrupt
        self.received.append(reason)
