"""The repository root: the working directory of every script and launcher the tests run."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
