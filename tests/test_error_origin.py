"""Only zoo's own user errors (zoo.errors.UserError, MissingInput) end a CLI as one line and exit 2: a
ValueError a library raises (DeepSpeed's op builder on ``TORCH_CUDA_ARCH_LIST=9.0a`` raises ``invalid literal
for int() with base 10: '0a'``) names neither the value nor the fix, so it ends the command with its
traceback, whatever file raised it."""

from __future__ import annotations

import pytest
from packaging.version import Version

from zoo.cli import pretrain as pretraining
from zoo.errors import USER_ERRORS, MissingInput, UserError, error_kind, error_line, report_error
from zoo.models.gpt2.presets import gpt2_config


def _raised_by_a_library() -> ValueError:
    try:
        Version("not a version")
    except ValueError as err:
        return err
    raise AssertionError("packaging accepted it")


def _raised_by_zoo() -> UserError:
    try:
        gpt2_config("gpt2-huge")
    except ValueError as err:
        return err
    raise AssertionError("the preset exists")


def test_zoos_checks_raise_user_errors_that_callers_still_catch_as_value_errors():
    err = _raised_by_zoo()
    assert isinstance(err, UserError) and isinstance(err, ValueError)
    assert issubclass(MissingInput, UserError) and issubclass(MissingInput, FileNotFoundError)


def test_zoos_own_sentence_is_left_as_it_is():
    err = _raised_by_zoo()
    assert error_line(err) == f"error: {err}"


@pytest.mark.parametrize("err, kind", [
    (UserError("x."), "UserError"),
    (MissingInput("x."), "MissingInput"),
    (ValueError("x."), "ValueError"),
    (FileNotFoundError("x."), "FileNotFoundError"),
])
def test_ranks_agree_on_a_user_error_by_its_kind_and_on_anything_else_by_its_type(err, kind):
    assert error_kind(err) == kind
    assert (kind in USER_ERRORS) == isinstance(err, UserError)


def test_a_subclass_of_a_user_error_travels_as_the_kind_it_is():
    from zoo.checkpoint.safe_load import UnsafeCheckpointError

    assert error_kind(UnsafeCheckpointError("x.")) == "UserError"


def test_zoo_traceback_prints_the_traceback_before_the_line(monkeypatch, capsys):
    monkeypatch.setenv("ZOO_TRACEBACK", "1")
    report_error(_raised_by_zoo())
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("value", ["", "0"])
def test_without_zoo_traceback_it_is_one_line(value, monkeypatch, capsys):
    monkeypatch.setenv("ZOO_TRACEBACK", value)
    report_error(_raised_by_zoo())
    assert capsys.readouterr().err.count("\n") == 1


def test_the_pretraining_cli_lets_a_library_error_end_it_with_its_traceback(monkeypatch, capsys):
    """Through pretraining's main(): a ValueError raised inside a library while the run is set up
    (packaging's here, standing in for DeepSpeed's op builder) is not reported as the user's one line."""
    def deepspeed_like_failure(args):
        raise _raised_by_a_library()

    monkeypatch.setattr(pretraining, "load_run_config", deepspeed_like_failure)
    with pytest.raises(ValueError, match="Invalid version") as caught:
        pretraining.main(["--deepspeed_config", "ds_configs/cpu_demo.json"])
    assert not isinstance(caught.value, UserError)
    assert "error:" not in capsys.readouterr().err


def test_the_pretraining_cli_reports_a_user_error_as_one_line_and_exit_2(monkeypatch, capsys):
    def bad_value(args):
        raise UserError("--lr -1 is negative; pass a positive learning rate.")

    monkeypatch.setattr(pretraining, "load_run_config", bad_value)
    with pytest.raises(SystemExit) as exit_info:
        pretraining.main(["--deepspeed_config", "ds_configs/cpu_demo.json"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --lr -1 is negative; pass a positive learning rate.\n"
