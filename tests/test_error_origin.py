"""A CLI's error line names where an error was raised when a library, not zoo's own checks, raised it
(zoo.errors): DeepSpeed's op builder failing on ``TORCH_CUDA_ARCH_LIST=9.0a`` raises ``invalid literal
for int() with base 10: '0a'``, which alone gives the user nothing to go on."""

from __future__ import annotations

import pytest
from packaging.version import Version

from zoo.cli import pretrain as pretraining
from zoo.errors import error_line, raised_at, report_error
from zoo.models.presets import gpt2_config


def _raised_by_a_library() -> ValueError:
    try:
        Version("not a version")
    except ValueError as err:
        return err
    raise AssertionError("packaging accepted it")


def _raised_by_zoo() -> ValueError:
    try:
        gpt2_config("gpt2-huge")
    except ValueError as err:
        return err
    raise AssertionError("the preset exists")


def test_a_library_error_names_where_it_was_raised():
    line = error_line(_raised_by_a_library())
    assert line.startswith("error: Invalid version") and "\n" not in line
    assert "(raised in packaging/version.py:" in line, line
    assert "ZOO_TRACEBACK=1" in line


def test_zoos_own_sentence_is_left_as_it_is():
    err = _raised_by_zoo()
    assert error_line(err) == f"error: {err}"


def test_a_standard_library_frame_is_skipped_for_the_code_that_called_it(tmp_path):
    """A missing file raised inside pathlib for zoo's call is zoo's (its check), not a library's."""
    try:
        (tmp_path / "missing.json").read_text()
    except FileNotFoundError as err:
        assert raised_at(err)[0] == __file__
    else:
        raise AssertionError("the file exists")


def test_zoo_traceback_prints_the_traceback_before_the_line(monkeypatch, capsys):
    monkeypatch.setenv("ZOO_TRACEBACK", "1")
    report_error(_raised_by_a_library())
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("value", ["", "0"])
def test_without_zoo_traceback_it_is_one_line(value, monkeypatch, capsys):
    monkeypatch.setenv("ZOO_TRACEBACK", value)
    report_error(_raised_by_a_library())
    assert capsys.readouterr().err.count("\n") == 1


def test_the_pretraining_cli_reports_a_library_error_with_its_origin(monkeypatch, capsys):
    """Through pretraining's main(): a ValueError raised inside a library while the run is set up
    (packaging's here, standing in for DeepSpeed's op builder) is still one line and exit 2, and says
    where."""
    def deepspeed_like_failure(args):
        raise _raised_by_a_library()

    monkeypatch.setattr(pretraining, "load_run_config", deepspeed_like_failure)
    with pytest.raises(SystemExit) as exit_info:
        pretraining.main(["--deepspeed_config", "ds_configs/cpu_demo.json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(raised in packaging/version.py:" in err, err
