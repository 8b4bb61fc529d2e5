"""The engine path of the step benchmarks (bench_gpt2_step.py, bench_llama_step.py): a model stepped as
pretraining steps it, to set beside the same model's bare step.

* :func:`pretraining_ds_config`: the DeepSpeed config a ``launch/pretrain.py`` run of these flags hands
  ``deepspeed.initialize`` (the ds_config file, its zoo block and the flags, through the pretraining parser,
  ``load_run_config`` and ``deepspeed_dict``);
* :class:`EngineStep`: zoo's ``setup_engine`` over the model with that config, and one call = one iteration of
  the training loop's own step (:meth:`zoo.training.loop.TrainingLoop.train_step` over the acceptance run's
  one-batch task): forward, zoo's backward (the fp16 scale applied once), the grad norm where zoo takes its
  own, ``engine.step()``. Its phases come from the loop's clock (:mod:`zoo.training.phase_clock`);
* :func:`compile_blocks`: ``--compile``, zoo's regional compilation of the transformer blocks, or one line
  saying it is not in this checkout;
* ``--stock-step``: the "before" arm on today's code. ``EngineStep(..., stock=True)`` builds the same engine with
  DeepSpeed's stock step (``setup_engine`` without :func:`zoo.training.lean_step.lighten_step`: DeepSpeed's
  per-tensor overflow check on its fp16 optimizers, its gradient all-reduce at dp = 1) and runs each iteration
  under :func:`one_chunk_cross_entropy` (zoo's cross-entropy with every token in one chunk, i.e. unchunked). Both
  are patched here, in the benchmark, for the arm's own calls; zoo itself is unchanged. The ds_config is the same
  in both arms (bf16 keeps its gradient accumulation in fp32).

Timing only: nothing here is asserted.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DS_CONFIG = REPO / "ds_configs" / "cpu_demo.json"
COMPILED_MODULE = "zoo.models.compiled"
COMPILE_MISSING = ("--compile: zoo.models.compiled.compile_transformer_blocks is not in this checkout, so every "
                   "step below is eager")


def pretraining_ds_config(ds_config_path: str | os.PathLike, micro: int, seq: int, world_size: int = 1,
                          tp: int = 1, precision: str | None = None) -> tuple[dict, float]:
    """(ds_config, weight decay) of ``launch/pretrain.py --deepspeed_config PATH`` at micro-batch ``micro``, one
    micro-batch per iteration per DP rank, ``seq`` tokens, tensor-parallel ``tp`` of ``world_size`` ranks;
    ``precision`` "fp16"/"bf16" passes that flag (None: the file's)."""
    from zoo.cli.pretrain import build_parser
    from zoo.config.deepspeed_dict import deepspeed_dict
    from zoo.config.loading import load_run_config
    from zoo.config.validation import validate_for_world

    argv = ["--deepspeed_config", str(ds_config_path), "--tensor-parallel-size", str(tp),
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * world_size // tp),
            "--seq-length", str(seq), "--train-iters", "1000", "--eval-interval", "0"]
    if precision is not None:
        argv.append(f"--{precision}")
    config = load_run_config(build_parser().parse_args(argv))
    ds = deepspeed_dict(config, validate_for_world(config, world_size))
    return ds, ds.get("optimizer", {}).get("params", {}).get("weight_decay", 0.01)


def join_world_of_one(seed: int = 1234):
    """This process as a world of one (the launcher variables of zoo.distributed.single_process_env, which
    DeepSpeed's engine reads, stay set), joined as zoo's jobs join (zoo.training.startup.join), the benchmark's
    torch thread count kept. Returns the ParallelState (tp = 1)."""
    import torch

    from zoo.distributed import single_process_env
    from zoo.training.startup import join

    threads = torch.get_num_threads()
    single_process_env()
    parallel = join(1, seed)
    torch.set_num_threads(threads)     # join shares the cores between local ranks; keep the benchmark's count
    return parallel


def compiled_module():
    """zoo's regional compilation module (:data:`COMPILED_MODULE`), or None where this checkout lacks it or its
    ``compile_transformer_blocks``; imported by name because the benchmarks run on checkouts without it."""
    if importlib.util.find_spec(COMPILED_MODULE) is None:
        return None
    module = importlib.import_module(COMPILED_MODULE)
    return module if hasattr(module, "compile_transformer_blocks") else None


def compile_missing() -> str | None:
    """The one line ``--compile`` prints where this checkout has no
    ``zoo.models.compiled.compile_transformer_blocks``; None where it has it."""
    return COMPILE_MISSING if compiled_module() is None else None


def compile_blocks(model) -> None:
    """zoo's regional compilation of ``model``'s transformer blocks (check :func:`compile_missing` first)."""
    compiled_module().compile_transformer_blocks(model)


@contextlib.contextmanager
def one_chunk_cross_entropy():
    """While inside, zoo's vocab-parallel cross-entropy takes every token in one chunk where its caller names no
    ``chunk_tokens`` (the models' losses): its default chunk (``zoo.parallel.cross_entropy.default_chunk_tokens``)
    is unbounded, so forward and backward each make one pass over the whole logits, as before chunking."""
    from zoo.parallel import cross_entropy

    with mock.patch.object(cross_entropy, "default_chunk_tokens", lambda *args, **kwargs: sys.maxsize):
        yield


@contextlib.contextmanager
def stock_deepspeed_step():
    """While inside, zoo's ``setup_engine`` leaves DeepSpeed's step as DeepSpeed builds it (no
    :func:`zoo.training.lean_step.lighten_step`)."""
    from zoo.training import startup

    with mock.patch.object(startup, "lighten_step", lambda engine: None):
        yield


class EngineStep:
    """One pretraining iteration of ``model`` on the fixed batch ``ids`` per call (see the module doc); ``stock``:
    DeepSpeed's stock step and the unchunked cross-entropy (``--stock-step``)."""

    def __init__(self, model, ds_config: dict, parallel, ids, weight_decay: float, stock: bool = False):
        from zoo.smoke import OneBatchTask
        from zoo.training.loop import LoopState, TrainingLoop
        from zoo.training.startup import setup_engine

        self.stock = stock
        with stock_deepspeed_step() if stock else contextlib.nullcontext():
            self.engine = setup_engine(model, ds_config, parallel, weight_decay, refresh_masters=False)
        self.engine.train()
        self.loop = TrainingLoop(self.engine, parallel, OneBatchTask(ids.to(self.engine.device), parallel))
        self.state = LoopState()
        self.calls = 0

    def __call__(self):
        """One iteration; its loss (fp32, on the device)."""
        with one_chunk_cross_entropy() if self.stock else contextlib.nullcontext():
            sums, _ = self.loop.train_step(self.state)
        self.calls += 1
        return sums["loss"]

    def reset_phases(self) -> None:
        """Forget the phases timed so far (call after the warm-up steps)."""
        from zoo.training.log_window import LogWindow

        self.loop.window = LogWindow(self.loop.timing_events)
        self.calls = 0

    def phase_ms(self) -> dict[str, float]:
        """Milliseconds per call in each phase since :meth:`reset_phases` (reads the device events, if any)."""
        totals = self.loop.window.clock.totals_ms()
        return {phase: total / max(self.calls, 1) for phase, total in totals.items()}
