"""Messages of the libraries zoo drives that say nothing about a zoo run, each with why it is harmless, and
:func:`library_noise_silenced`, the block within which they are not printed."""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager

# Messages of the libraries zoo drives that say nothing about a zoo run, each with why it is harmless.
# DeepSpeed's WarmupLR/WarmupCosineLR ask for the learning rate while they are built, before their first
# step; they answer 0 and DeepSpeed's first step sets the real rate (the log's lr column shows it).
DEEPSPEED_SCHEDULER_NOTE = "Attempting to get learning rate from scheduler before it has started"
# DeepSpeed's pipeline engine moves activations and tied weights between stages with c10d broadcasts (its
# point-to-point on gloo, its tied-weight sync), some on tensors that require grad, and torch warns that
# c10d::broadcast_ has no autograd kernel. The gradients cross stages by the engine's own sends and its
# tied-weight all-reduce, never through the broadcast's autograd: tests/test_pipeline.py checks a tp x pp
# step's gradients in float64 against a single process to 1e-9.
C10D_BROADCAST_AUTOGRAD = "c10d::broadcast_: an autograd kernel was not registered to the Autograd key(s)"


class _DropMessage:
    """A logging filter that drops the records whose message contains ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


@contextmanager
def library_noise_silenced():
    """Within the block: DeepSpeed's scheduler note and torch's c10d::broadcast_ autograd warning of
    pipeline runs are not printed (each is harmless for zoo, see the comments above); every other warning
    and log record goes through as before. Restored on exit."""
    import logging

    loggers = [(logging.getLogger("DeepSpeed"), _DropMessage(DEEPSPEED_SCHEDULER_NOTE))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(C10D_BROADCAST_AUTOGRAD), category=UserWarning)
        for logger, drop in loggers:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger, drop in loggers:
                logger.removeFilter(drop)


__all__ = ["C10D_BROADCAST_AUTOGRAD", "DEEPSPEED_SCHEDULER_NOTE", "library_noise_silenced"]
