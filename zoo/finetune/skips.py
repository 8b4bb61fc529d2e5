"""Counting malformed examples while reading, and the one warning that reports them.

The finetune readers share one bad-input policy:

- A source that cannot be read at all (a missing file or directory, a missing TSV column, text
  that is not JSON, a directory without any split) raises ``MissingInput`` or ``UserError``
  with one sentence that names the file or column and the fix.
- A malformed individual example (too few fields, a label outside the label set, a SQuAD answer
  whose ``answer_start`` does not point at its text, a RACE question without exactly four options
  or with an answer letter outside A-D) is skipped and counted. After the source is read, ONE
  :class:`MalformedExampleWarning` (via :func:`warnings.warn`) says how many examples were skipped,
  why, and the id of the first one. A source is one file, or one RACE split directory (whose
  thousands of small files would otherwise warn one by one).
"""

from __future__ import annotations

import warnings
from collections import Counter


class MalformedExampleWarning(UserWarning):
    """Some examples of a task file were malformed and have been skipped."""


class SkippedExamples:
    """Tally of the malformed examples of one source; :meth:`warn` reports them once."""

    def __init__(self, source: str, headline: str = "skipped {count} malformed example(s)"):
        self.source = source
        self.headline = headline
        self.count = 0
        self.reasons: Counter[str] = Counter()
        self.first: tuple[str, str] | None = None  # (example id, reason)

    def skip(self, example_id: str, reason: str) -> None:
        self.count += 1
        self.reasons[reason] += 1
        if self.first is None:
            self.first = (str(example_id), reason)

    def warn(self) -> None:
        """Emit one :class:`MalformedExampleWarning` if anything was skipped."""
        if not self.count:
            return
        why = "; ".join(f"{n} {reason}" for reason, n in self.reasons.most_common())
        first_id, first_reason = self.first
        first_why = f" ({first_reason})" if len(self.reasons) > 1 else ""
        warnings.warn(
            f"{self.source}: {self.headline.format(count=self.count)} ({why}); "
            f"the first is id '{first_id}'{first_why}.",
            MalformedExampleWarning,
            stacklevel=3,
        )
