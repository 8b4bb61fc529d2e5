"""Pretraining models are built on the engine's device: under ``with torch.device(d)``
every parameter is allocated on ``d`` and every master weight is drawn there, so no rank draws the full
model on the host. Built on ``meta`` here (what a host-side allocation would break), and on CPU at a
hand-made tp = 2 to show the init is still the tp = 1 init, sliced (single process: building issues no
collective)."""

from __future__ import annotations

import pytest
import torch

from zoo.config.run_config import RunConfig
from zoo.parallel import ParallelState
from zoo.parallel.utils import merge_shards
from zoo.training.pretrain import build_pretraining_model

MODELS = ["gpt2-tiny", "bert-tiny"]


def _config(model: str) -> RunConfig:
    return RunConfig(model=model, seq_length=128, save=None)


def _tp_rank(tp_rank: int, tp_size: int) -> ParallelState:
    return ParallelState(tp_size=tp_size, tp_rank=tp_rank, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp_size, rank=tp_rank)


def _build(model: str, ps: ParallelState, device) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(1234)
    built, _, _ = build_pretraining_model(_config(model), ps, device=device)
    return dict(built.named_parameters())


@pytest.mark.parametrize("model", MODELS)
def test_every_parameter_is_built_on_the_requested_device(model):
    params = _build(model, _tp_rank(1, 2), "meta")
    on_host = sorted(name for name, param in params.items() if param.device.type != "meta")
    assert not on_host, f"built on the host instead of the requested device: {on_host}"


def test_default_device_is_the_accelerator_and_cpu_init_is_unchanged():
    """On a CPU run DeepSpeed's accelerator device is "cpu": the init is the plain build's, bit for bit."""
    from zoo.models import model_config
    from zoo.models.families import build_model

    params = _build("gpt2-tiny", ParallelState.single(), None)
    torch.manual_seed(1234)
    plain = dict(build_model(model_config("gpt2-tiny", **_config("gpt2-tiny").model_run_fields()),
                             ParallelState.single()).named_parameters())
    assert params.keys() == plain.keys()
    for name in params:
        assert params[name].device.type == "cpu"
        assert torch.equal(params[name], plain[name]), f"{name} differs from the plain CPU build"


@pytest.mark.parametrize("model", MODELS)
def test_init_on_the_device_is_identical_across_tp(model):
    reference = _build(model, ParallelState.single(), "cpu")
    shards = [_build(model, _tp_rank(rank, 2), "cpu") for rank in range(2)]
    for name, want in reference.items():
        pieces = [shard[name].detach() for shard in shards]
        if getattr(want, "tensor_model_parallel", False):
            got = merge_shards(pieces, want.partition_dim, want.partition_stride)
            rows = min(got.shape[0], want.shape[0])   # the padded vocab differs with tp: compare the common rows
            if got.shape != want.shape:
                assert not got[rows:].any() and not want[rows:].any(), f"{name}: padding rows are not zero"
                got, want = got[:rows], want[:rows]
        else:
            assert torch.equal(pieces[0], pieces[1]), f"replicated {name} differs between the tp ranks"
            got = pieces[0]
        assert torch.equal(got, want.detach()), f"init of {name} differs between tp=1 and tp=2"


# ------------------------------------------------------------- --tf32 on evaluate and generate
@pytest.fixture
def tf32_flags_restored():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _run_until_load_fails(main, argv: list[str]) -> None:
    """Run a CLI whose --load does not exist: it sets its math flags, then stops with exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize("cli", ["evaluate", "generate"])
def test_tf32_flag_sets_both_backends_and_is_off_by_default(cli, tmp_path, tf32_flags_restored):
    import launch.generate
    import zoo.cli.evaluate

    data = tmp_path / "wiki.test.tokens"
    data.write_text(" = Title = \n\n a few words of text . \n")
    missing = str(tmp_path / "no-such-model")
    main, argv = ((zoo.cli.evaluate.main, ["--task", "wikitext", "--data", str(data), "--load", missing])
                  if cli == "evaluate" else (launch.generate.main, ["--prompt", "Hello", "--load", missing]))
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    _run_until_load_fails(main, argv + ["--tf32"])
    assert _tf32_flags() == (True, True)
    _run_until_load_fails(main, argv)
    assert _tf32_flags() == (False, False), "without --tf32 float32 must run in full float32"
