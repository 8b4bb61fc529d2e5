"""A checkpoint tag counts only once its save finished, and a failed save leaves nothing behind.

One real tp = 2 run (2 iterations, a checkpoint after each, through pretrain in the spawn harness) is
written once per module; each test copies it. Claims:
* a run killed during its first save (a tag with some rank files, no completion marker, no ``latest``)
  is not resumed: the resumed run starts from iteration 0;
* with ``latest`` missing, or naming a tag whose save did not finish, resume takes the newest complete
  tag and says which; export refuses the incomplete tag in one sentence;
* a checkpoint directory written by a zoo without completion markers still loads through ``latest``
  (resume and export);
* a failed write on rank 1 during a save (torch's own RuntimeError under a file size limit, or ENOSPC)
  ends every rank with the same one sentence naming the directory (and for a full disk the bytes
  needed), removes the partial tag and leaves ``latest``; torch's write errors without an errno are read
  as a full disk by their strerror or by the free space; a failed re-save says the tag is left incomplete.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from tests.helpers.pretraining import run_config, train_events
from tests.helpers.random_corpus import MODEL, make_corpus
from tests.spawn import spawn

COMPLETE = "zoo_complete.json"


def _config(data_path, save, **changes):
    return run_config(data_path, save, 2, 1, 1, train_iters=changes.pop("train_iters", 2), model_overrides=dict(MODEL),
                      data_workers=0, save_interval=1, **changes)


def _train(rank, world_size, data_path, save):
    from zoo.training.pretrain import pretrain

    pretrain(_config(data_path, save))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("completion")
    corpus = make_corpus(root / "random")
    spawn(_train, 2, corpus, str(root / "run"))
    return root / "run", corpus


def copied(real_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(real_run[0], run)
    return run


def test_saves_write_a_marker_then_latest(real_run):
    checkpoints = real_run[0] / "checkpoints"
    assert (checkpoints / "latest").read_text() == "iter_0000002"
    for tag in ("iter_0000001", "iter_0000002"):
        assert (checkpoints / tag / COMPLETE).is_file()


def _resume(rank, world_size, data_path, run):
    from zoo.training.pretrain import pretrain

    pretrain(_config(data_path, run, train_iters=1, load=run))
    return [e["iteration"] for e in train_events(run)]


def test_run_killed_during_its_first_save_is_not_resumed(real_run, tmp_path):
    """The first save's tag holds rank 0's file only, no marker and no `latest`: the run starts fresh."""
    from zoo.checkpoint.files import has_complete_checkpoint, resume_tag_directory

    run = tmp_path / "run"
    partial = run / "checkpoints" / "iter_0000002"
    partial.mkdir(parents=True)
    shutil.copy(real_run[0] / "checkpoints" / "iter_0000002" / "mp_rank_00_model_states.pt", partial)
    assert not has_complete_checkpoint(run)
    tag_dir, note = resume_tag_directory(run)
    assert tag_dir is None and note.endswith("holds no complete checkpoint; starting from iteration 0"), note
    assert spawn(_resume, 2, real_run[1], str(run))[0] == [1]
    assert (run / "checkpoints" / "latest").read_text() == "iter_0000001"


def test_newest_complete_tag_is_resumed_and_said(real_run, tmp_path, capsys):
    from zoo.checkpoint.resume import checkpoint_to_load

    run = copied(real_run, tmp_path)
    checkpoints = run / "checkpoints"
    (checkpoints / "latest").unlink()
    directory, tag = checkpoint_to_load(run, two_rank_view())
    assert (directory, tag) == (checkpoints, "iter_0000002")
    assert f"{checkpoints / 'latest'} is missing; resuming from iter_0000002, the newest complete checkpoint" in \
        capsys.readouterr().out
    # A later save that did not finish: its files are there, the marker is not; `latest` names it.
    (checkpoints / "iter_0000002" / COMPLETE).unlink()
    (checkpoints / "latest").write_text("iter_0000002")
    directory, tag = checkpoint_to_load(run, two_rank_view())
    assert tag == "iter_0000001"
    assert ("names 'iter_0000002', which is incomplete (it has no zoo_complete.json: its save did not finish); "
            "resuming from iter_0000001, the newest complete checkpoint") in capsys.readouterr().out
    # Written by a zoo that wrote no markers at all: `latest` names the tag to load, and export reads it.
    (checkpoints / "iter_0000001" / COMPLETE).unlink()
    assert checkpoint_to_load(run, two_rank_view())[1] == "iter_0000002"
    assert capsys.readouterr().out == ""
    from zoo.checkpoint.deepspeed_export import export_checkpoint

    assert export_checkpoint(run, tmp_path / "hf").tag_dir.name == "iter_0000002"


def two_rank_view():
    """Rank 0's view of a tp = 2 layout (no process group: the agreement helpers run locally)."""
    from zoo.parallel import ParallelState

    return ParallelState(tp_size=2, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None, world_size=2,
                         rank=0)


def test_export_refuses_an_incomplete_tag(real_run, tmp_path):
    from zoo.checkpoint.deepspeed_export import export_checkpoint

    run = copied(real_run, tmp_path)
    (run / "checkpoints" / "iter_0000002" / COMPLETE).unlink()
    for tag in (None, "iter_0000002"):
        with pytest.raises(ValueError, match=r"checkpoint tag 'iter_0000002' under .* is incomplete \(it has no "
                                             r"zoo_complete.json: its save did not finish\); pass --tag with one of "
                                             r"\['iter_0000001'\]\.$"):
            export_checkpoint(run, tmp_path / "hf", tag=tag)
    assert not (tmp_path / "hf").exists()
    assert export_checkpoint(run, tmp_path / "hf", tag="iter_0000001").tag_dir.name == "iter_0000001"


def _failing_write_on_second_save(rank, world_size, data_path, run, failure):
    """pretrain with rank 1's write of iter_0000002 failing: ``"file size limit"`` runs torch.save under
    RLIMIT_FSIZE (torch's own error for a write that stops short), ``"ENOSPC"`` writes the file then raises
    the OSError a full disk gives; the ValueError's sentence or None."""
    import resource
    import signal

    import torch

    from zoo.training.pretrain import pretrain

    real_save = torch.save
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the failed write returns EFBIG instead of killing the rank

    def save(obj, path, *args, **kwargs):
        if rank != 1 or "iter_0000002" not in str(path):
            return real_save(obj, path, *args, **kwargs)
        if failure == "ENOSPC":
            real_save(obj, path, *args, **kwargs)   # a partial file first, as a write that ran out of space
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            return real_save(obj, path, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    torch.save = save
    try:
        pretrain(_config(data_path, run))
    except ValueError as err:
        return str(err)
    finally:
        torch.save = real_save
    return None


@pytest.mark.parametrize("failure", ["ENOSPC", "file size limit"])
def test_a_failed_write_during_a_save_is_one_sentence_on_every_rank(real_run, tmp_path, failure):
    run = tmp_path / "run"
    messages = spawn(_failing_write_on_second_save, 2, real_run[1], str(run), failure)
    assert messages[0] == messages[1] and messages[0] is not None, messages
    message = messages[0]
    written = run / "checkpoints" / "iter_0000002" / "mp_rank_01_model_states.pt"
    if failure == "ENOSPC":
        assert message.startswith(f"checkpoint iter_0000002 could not be saved in {run / 'checkpoints'}: the disk is "
                                  f"full writing {written} (about "), message
        assert " MB needed for it, " in message and " MB free); " in message
    else:   # torch's zip writer: "[enforce fail at inline_container.cc:...] . unexpected pos N vs M"
        assert message.startswith(f"checkpoint iter_0000002 could not be saved in {run / 'checkpoints'}: writing "
                                  f"{written} failed (unexpected pos "), message
        assert "inline_container" not in message
    assert "; the partial checkpoint was removed and 'latest' still names iter_0000001; " in message, message
    assert "\n" not in message and message.endswith(", then resume with --load.")
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_0000001", "latest"]
    assert (checkpoints / "latest").read_text() == "iter_0000001"
    assert (checkpoints / "iter_0000001" / COMPLETE).is_file()


def _failure(tmp_path, err, needed=None, free=None, resaved=False):
    from zoo.checkpoint.save import WriteFailure, write_failure_sentence

    (tmp_path / "latest").write_text("iter_0000001")
    return write_failure_sentence(tmp_path, "iter_0000002", WriteFailure(str(tmp_path / "f.pt"), err, needed, free,
                                                                         resaved))


def test_torch_write_errors_are_read_as_a_full_disk_by_their_text_or_the_free_space(tmp_path):
    """torch's texts as observed (torch 2.13): its legacy writer names the strerror, its zip writer does not,
    so there the free space right after the failure decides."""
    full = f"could not be saved in {tmp_path}: the disk is full writing {tmp_path / 'f.pt'} "
    legacy = RuntimeError("write(): fd 7 failed with No space left on device")
    assert full + "(about 2.0 MB needed for it, 50.0 MB free); " in _failure(tmp_path, legacy, 2_000_000, 50_000_000)
    quota = RuntimeError("write(): fd 7 failed with Disk quota exceeded")
    assert ": the disk quota is exhausted writing " in _failure(tmp_path, quota, 2_000_000, 50_000_000)
    for text in ("[enforce fail at inline_container.cc:672] . file write failed",
                 "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"):
        assert full + "(about 2.0 MB needed for it, 0.0 MB free); " in _failure(tmp_path, RuntimeError(text),
                                                                                 2_000_000, 0)
        roomy = _failure(tmp_path, RuntimeError(text), 2_000, 50_000_000)
        assert f"writing {tmp_path / 'f.pt'} failed ({text.split('. ', 1)[1]}); " in roomy, roomy
    too_large = _failure(tmp_path, RuntimeError("write(): fd 3 failed with File too large"), 2_000, 50_000_000)
    assert "failed (write(): fd 3 failed with File too large); the partial checkpoint was removed" in too_large


def test_a_failed_resave_of_an_existing_tag_says_the_tag_is_left_incomplete(tmp_path):
    message = _failure(tmp_path, OSError(errno.ENOSPC, "No space left on device"), 2_000_000, 0, resaved=True)
    assert ("; iter_0000002 existed before, is now incomplete and will not be resumed (its completion marker was "
            "removed, and so were the files this save added), and 'latest' still names iter_0000001; ") in message
    assert "partial checkpoint was removed" not in message
