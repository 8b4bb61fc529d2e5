"""Evaluation of a DeepSpeed checkpoint never scores a stale export.

``launch/evaluate.py --load <run>`` exports the checkpoint once into a private cache. Rewriting the files
of the tag in place (a new run with the same ``--save``: same tag, same directory, new weights) must give
a fresh export with the new weights; an unchanged tag reuses the export and says so. That holds also
when the rewrite keeps every file's size and modification time (``cp -p``, ``rsync -a``, ``os.utime``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from tests.helpers.tp_checkpoint import write_tp_checkpoint


def exported_weight(directory: str) -> torch.Tensor:
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}["transformer.wte.weight"]


def test_rewritten_tag_is_exported_again(tmp_path, monkeypatch, capsys):
    from zoo.eval.zero_shot import transformers_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))   # the export cache lives under it
    (tmp_path / "tmp").mkdir()
    run = write_tp_checkpoint(tmp_path / "run", 1, torch.float32)
    first = transformers_directory(str(run))
    assert "using the cached export" not in capsys.readouterr().out
    assert transformers_directory(str(run)) == first
    assert f"using the cached export {first}" in capsys.readouterr().out
    before = exported_weight(first)

    # Another run writes the same tag: the files are replaced in place, the directory stays.
    other = write_tp_checkpoint(tmp_path / "other", 1, torch.float32)
    tag = run / "checkpoints" / "iter_0000007"
    from zoo.checkpoint.safe_load import safe_torch_load  # the loader zoo itself reads states with
    states = safe_torch_load(other / "checkpoints" / "iter_0000007" / "mp_rank_00_model_states.pt", mmap=False)
    states["module"] = {k: v + 1.0 if v.is_floating_point() else v for k, v in states["module"].items()}
    torch.save(states, other / "checkpoints" / "iter_0000007" / "mp_rank_00_model_states.pt")
    shutil.copyfile(other / "checkpoints" / "iter_0000007" / "mp_rank_00_model_states.pt",
                    tag / "mp_rank_00_model_states.pt")
    second = transformers_directory(str(run))
    assert second != first
    assert "using the cached export" not in capsys.readouterr().out
    assert torch.equal(exported_weight(second), before + 1.0)


def test_rewrite_keeping_size_and_mtime_is_exported_again(tmp_path, monkeypatch, capsys):
    """The states file is rewritten in place with new weights of the same size, and its modification
    time is set back to the old one, as ``cp -p`` or ``rsync -a`` leave it."""
    from zoo.eval.zero_shot import transformers_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    run = write_tp_checkpoint(tmp_path / "run", 1, torch.float32)
    states_file = run / "checkpoints" / "iter_0000007" / "mp_rank_00_model_states.pt"
    first = transformers_directory(str(run))
    before = exported_weight(first)
    old = states_file.stat()

    from zoo.checkpoint.safe_load import safe_torch_load  # the loader zoo itself reads states with
    states = safe_torch_load(states_file, mmap=False)
    for value in states["module"].values():   # in place: the storages and their sharing stay as they were
        if value.is_floating_point():
            value.add_(2.0)
    rewritten = tmp_path / "new" / states_file.name   # torch's zip records carry the file's stem
    rewritten.parent.mkdir()
    torch.save(states, rewritten)
    assert rewritten.stat().st_size == old.st_size
    shutil.copyfile(rewritten, states_file)
    os.utime(states_file, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (states_file.stat().st_size, states_file.stat().st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    capsys.readouterr()

    second = transformers_directory(str(run))
    assert second != first
    assert "using the cached export" not in capsys.readouterr().out
    assert torch.equal(exported_weight(second), before + 2.0)
