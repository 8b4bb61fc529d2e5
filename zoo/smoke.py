"""The acceptance run: on the launched devices (CUDA/NCCL on GPUs, gloo on CPU) it checks

    parity     tp = N against tp = 1 built from the same seed: logits and loss, fp32, <= 1e-5 relative
    train      a few fp16 and bf16 DeepSpeed steps on one batch (dropout on): finite losses, the loss
               without dropout falls, fp16's dynamic loss scale is alive (fp16 and bf16 only where the
               accelerator supports them, else "skipped")
    bert       two iterations of zoo's pretraining loop on BERT (a few bundled articles, preprocessed
               here): finite loss, MLM/SOP losses and validation loss
    generate   greedy generation of left-padded prompts: the batch equals each prompt alone, every
               TP rank chose the same tokens
    checkpoint a DeepSpeed save + load in a temporary directory restores the weights exactly
    throughput achieved TFLOPs per device of the fp16 and bf16 steps, and MFU where the device's peak
               is known (else "n/a")

Every check's verdict is agreed over all ranks (the worst wins); rank 0 prints one line per check and
the process exits 1 if any failed. The device is DeepSpeed's accelerator's, set right after
``init_distributed``; the models and every tensor live on it.

    deepspeed --num_gpus N launch/smoke.py [--model gpt2-1.2b] [--seq-length 1024]

The training steps are the training loop's own (:meth:`zoo.training.loop.TrainingLoop.train_step` over a
:class:`OneBatchTask`), so the smoke checks the step every zoo job takes.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import transformers

from zoo.assets import GPT2_TOKENIZER_DIR
from zoo.config.run_config import RunConfig
from zoo.config.validation import validate_static
from zoo.data import preprocess_bert
from zoo.data.preprocess import BUNDLED_CORPUS
from zoo.distributed import join_process_group
from zoo.errors import UserError
from zoo.inference import GenerationConfig, generate
from zoo.models.bert.presets import BERT_PRESETS, bert_config
from zoo.models.families import FAMILIES, family_of, family_of_preset, model_config, shape_of
from zoo.parallel import ParallelState, model_parallel_seed
from zoo.planning.flops import model_flops_per_iteration
from zoo.planning.gpus import peak_tflops_of  # the one table of GPU peaks (zoo.planning.gpus.GPUS)
from zoo.training.grad_norm import current_loss_scale, deepspeed_reports_true_norm, unscaled_grad_norm
from zoo.training.loop import LoopState, TrainingLoop
from zoo.training.pretrain import pretrain
from zoo.training.pretraining_objectives import forward_with_metrics
from zoo.training.startup import setup_engine

REL_TOL = 1e-5
PARITY_TEXT = "Megatron-LM splits every transformer layer across GPUs with two all-reduces forward."
PROMPTS = ("The tensor-parallel transformer", "Attention heads are split", "A")


@dataclass
class Smoke:
    """What every check needs: the parsed flags, the parallel state and the device."""

    args: argparse.Namespace
    parallel: object
    device: torch.device
    is_writer: bool
    started: float = field(default_factory=time.perf_counter)
    first_grad_norms: dict = field(default_factory=dict)    # precision -> the unscaled norm of step 1

    def say(self, line: str) -> None:
        if self.is_writer:
            print(f"[{time.perf_counter() - self.started:6.1f}s] {line}", flush=True)

    def agreed(self, ok: bool) -> bool:
        """True only if the check passed on every rank."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def check(self, name: str, ok: bool, detail: str) -> bool:
        ok = self.agreed(ok)
        self.say(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        return ok


def validate(args: argparse.Namespace) -> None:
    """The same UserError on every rank, before any collective."""
    language_models = sorted(name for family in FAMILIES if family.generates_text for name in family.presets)
    family = family_of_preset(args.model)   # an unknown name is one sentence listing every preset
    if not family.generates_text:
        raise UserError(f"--model {args.model!r} is a {family.display_name} preset, and the language-model checks "
                         f"need a {' or '.join(f.display_name for f in FAMILIES if f.generates_text)} one (the BERT step "
                         f"takes --bert-model); choose one of "
                         f"{language_models}.")
    if args.bert_model not in BERT_PRESETS:
        raise UserError(f"--bert-model {args.bert_model!r} is not a BERT preset; choose one of "
                         f"{sorted(BERT_PRESETS)}.")
    if args.steps < 2:
        raise UserError(f"--steps {args.steps} leaves no loss to compare; pass --steps 2 or more.")
    n_positions = model_config(args.model).n_positions
    if not 1 <= args.seq_length <= n_positions:
        raise UserError(f"--seq-length {args.seq_length} does not fit {args.model}'s {n_positions} positions; pass "
                         f"a length from 1 to {n_positions}.")
    if args.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {args.micro_batch_size} must be a positive integer.")
    bert_positions = bert_config(args.bert_model).max_position_embeddings
    if args.bert_seq_length is None:
        args.bert_seq_length = min(args.seq_length, bert_positions)
    if not 1 <= args.bert_seq_length <= bert_positions:
        raise UserError(f"--bert-seq-length {args.bert_seq_length} does not fit {args.bert_model}'s {bert_positions} "
                         f"positions; pass a length from 1 to {bert_positions}.")


def setup(args: argparse.Namespace) -> Smoke:
    """Join the launcher's group as every zoo job does (on this rank's device), then the TP x DP grid."""
    device = torch.device(join_process_group(args.local_rank))
    parallel = ParallelState.initialize(args.tensor_parallel_size or dist.get_world_size())
    return Smoke(args, parallel, device, is_writer=dist.get_rank() == 0)


def seed_everything(seed: int, parallel) -> None:
    model_parallel_seed(seed, parallel)


def build(smoke: Smoke, cls, config, parallel):
    """``cls(config, parallel)`` drawn on the device from the run's seed (the same weights at every tp)."""
    seed_everything(smoke.args.seed, smoke.parallel)
    with torch.device(smoke.device):
        return cls(config, parallel=parallel)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-30)).item()


def lm_config(smoke: Smoke, **overrides):
    """The config of ``--model`` (a GPT-2 or Llama preset; zoo.models.families picks the family)."""
    return model_config(smoke.args.model, **overrides)


def no_dropout(smoke: Smoke) -> dict[str, float]:
    """The config fields of ``--model``'s family that turn every dropout off."""
    return dict(family_of_preset(smoke.args.model).no_dropout)


def token_ids(text: str, vocab_size: int) -> list[int]:
    """``text`` in GPT-2 BPE ids, folded into a ``vocab_size`` vocabulary (a preset with another vocabulary, such as
    Llama 2's 32,000 tokens, still gets ids it has: the checks compare layouts, not text)."""
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(GPT2_TOKENIZER_DIR))
    return [token % vocab_size for token in tokenizer(text)["input_ids"]]


def parity_ids(smoke: Smoke, vocab_size: int) -> torch.Tensor:
    return torch.tensor([token_ids(PARITY_TEXT, vocab_size)], device=smoke.device)   # (1, s)


def check_parity(smoke: Smoke, model, ids: torch.Tensor) -> bool:
    """tp = N against the tp = 1 model of the same seed, both on the device, fp32, dropout off."""
    reference = build(smoke, family_of(model.config).pretraining_model, model.config, None).eval()
    with torch.no_grad():
        ours = model.eval()(ids, labels=ids, gather_output=True)
        ref = reference(ids, labels=ids, gather_output=True)
    logits_err, loss_err = rel_err(ours.logits, ref.logits), rel_err(ours.loss, ref.loss)
    del reference
    ok = max(logits_err, loss_err) <= REL_TOL
    return smoke.check("parity", ok, f"tp={smoke.parallel.tp_size} vs tp=1 on {smoke.device.type}, "
                                     f"{ids.shape[1]} tokens: logits rel err {logits_err:.1e}, loss "
                                     f"{ours.loss.item():.6f} vs {ref.loss.item():.6f} (rel err {loss_err:.1e}), "
                                     f"limit {REL_TOL:.0e}")


def ds_config(smoke: Smoke, precision: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": smoke.args.micro_batch_size,
              "train_batch_size": smoke.args.micro_batch_size * smoke.parallel.dp_size,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              # The throughput timer synchronises twice per step; the steps are timed here instead.
              "timers": {"throughput": {"enabled": False}},
              "optimizer": {"type": "AdamW", "params": {"lr": smoke.args.lr, "weight_decay": 0.01,
                                                        "torch_adam": uses_torch_adam(smoke)}}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def uses_torch_adam(smoke: Smoke) -> bool:
    """On an accelerator the steps run DeepSpeed's FusedAdam (JIT-built), as the GPU configs do; on a
    CPU, torch's AdamW, as the CPU configs do."""
    return smoke.device.type == "cpu"


def engine_for(smoke: Smoke, model, precision: str):
    return setup_engine(model, ds_config(smoke, precision), smoke.parallel, weight_decay=0.01, refresh_masters=False)


def train_batch(smoke: Smoke, vocab_size: int) -> torch.Tensor:
    """One fixed batch of token ids, the same on every rank, drawn on the host and copied over."""
    generator = torch.Generator().manual_seed(smoke.args.seed)
    ids = torch.randint(0, vocab_size, (smoke.args.micro_batch_size, smoke.args.seq_length), generator=generator)
    return ids.to(smoke.device)                                                        # (b, s)


@contextmanager
def timed(smoke: Smoke, seconds: list[float]):
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    get_accelerator().synchronize()
    start = time.perf_counter()
    yield
    get_accelerator().synchronize()
    seconds.append(time.perf_counter() - start)


class OneBatchTask:
    """The smoke's training task (:class:`zoo.training.loop_tasks.TrainTask`): the LM loss of one fixed batch
    ``ids`` (on the device), one micro-batch per step; its own grad norm is zoo's unscaled one where DeepSpeed's
    is not the true norm (:func:`zoo.training.grad_norm.deepspeed_reports_true_norm`), as a pretraining run
    logs it."""

    total_iterations = samples_per_iteration = log_interval = 1

    def __init__(self, ids: torch.Tensor, parallel):
        self.ids, self.parallel = ids, parallel

    def micro_batches(self, state: LoopState) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": self.ids, "labels": self.ids}]

    def forward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        return forward_with_metrics(engine, batch)

    def own_grad_norm(self, engine) -> torch.Tensor | None:
        return None if deepspeed_reports_true_norm(engine) else unscaled_grad_norm(engine, self.parallel)


def train_step(smoke: Smoke, engine, ids: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """One optimizer step of the LM loss on ``ids`` through the training loop's step: the loss (fp32, still on
    the device) and the step's unscaled gradient norm over every TP rank (zoo's, or DeepSpeed's where it is
    the true norm)."""
    loop = TrainingLoop(engine, smoke.parallel, OneBatchTask(ids, smoke.parallel))
    sums, _ = loop.train_step(LoopState())
    norm = loop.window.grad_norm if loop.window.grad_norm is not None else engine.get_global_grad_norm()
    return sums["loss"], None if norm is None else float(norm)


def train_steps(smoke: Smoke, engine, ids: torch.Tensor) -> tuple[list[float], list[float]]:
    """``--steps`` optimizer steps on one batch: the losses and the seconds of each step."""
    losses, seconds = [], []
    engine.train()
    for step in range(smoke.args.steps):
        with timed(smoke, seconds):
            loss, grad_norm = train_step(smoke, engine, ids)
        losses.append(loss.item())
        if step == 0:
            smoke.first_grad_norms[engine_precision(engine)] = grad_norm
    return losses, seconds


def engine_precision(engine) -> str:
    return "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"


def eval_loss(engine, ids: torch.Tensor) -> float:
    """The LM loss on ``ids`` with dropout off (training draws dropout, so its losses are noisy)."""
    engine.eval()
    with torch.no_grad():
        loss = engine(ids, labels=ids).loss.item()
    engine.train()
    return loss


def dynamic_loss_scaling(optimizer) -> bool:
    holder = getattr(optimizer, "loss_scale_config", optimizer)
    return bool(getattr(holder, "dynamic_loss_scale", False))


def check_training(smoke: Smoke, precision: str, ids: torch.Tensor):
    """(passed, engine, seconds per step), or None when the accelerator lacks the precision."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import


    supported = get_accelerator().is_fp16_supported() if precision == "fp16" else get_accelerator().is_bf16_supported()
    if not supported:
        smoke.say(f"skipped: {precision} not supported on {smoke.device.type}")
        return None
    config = lm_config(smoke)
    engine = engine_for(smoke, build(smoke, family_of(config).pretraining_model, config, smoke.parallel), precision)
    before = eval_loss(engine, ids)
    losses, seconds = train_steps(smoke, engine, ids)
    after = eval_loss(engine, ids)
    ok = all(math.isfinite(x) for x in (before, *losses, after)) and after < before
    detail = (f"{len(losses)} steps with dropout, training loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"loss without dropout {before:.4f} -> {after:.4f}")
    if precision == "fp16":
        scale, dynamic = current_loss_scale(engine.optimizer), dynamic_loss_scaling(engine.optimizer)
        ok = ok and dynamic and math.isfinite(scale) and scale >= 1.0
        detail += f", dynamic loss scale {'on' if dynamic else 'OFF'} at {scale:g}"
    return smoke.check(f"train {precision}", ok, detail), engine, seconds


GRAD_NORM_AGREEMENT = 0.1


def check_loss_scale(smoke: Smoke) -> bool:
    """fp16's first-step gradient norm against bf16's, the same weights and batch, both the unscaled norm of the
    gradients the step used (zoo's over every TP rank, divided by the scale they carry, where DeepSpeed's
    still carries it): a loss scale applied twice or never shows as a factor of S (4096 here), rounding as a
    few percent. Passes vacuously where one of the two precisions did not run."""
    fp16, bf16 = smoke.first_grad_norms.get("fp16"), smoke.first_grad_norms.get("bf16")
    if fp16 is None or bf16 is None:
        smoke.say("skipped: loss scale (needs both fp16 and bf16 steps)")
        return True
    fp16, bf16 = float(fp16), float(bf16)
    ratio = fp16 / bf16 if bf16 > 0 else float("inf")
    ok = math.isfinite(ratio) and abs(ratio - 1.0) <= GRAD_NORM_AGREEMENT
    return smoke.check("loss scale", ok, f"first-step grad norm fp16 {fp16:.4g} vs bf16 {bf16:.4g} (ratio {ratio:.4g}, "
                                         f"limit 1 +- {GRAD_NORM_AGREEMENT})")


BUNDLED_ARTICLES = 12    # of the bundled Wikipedia sample: the BERT run's corpus


def bert_corpus(directory: str) -> str:
    """The first articles of the bundled corpus, preprocessed for BERT into ``directory`` (rank 0)."""
    source = os.path.join(directory, "articles.jsonl")
    with gzip.open(BUNDLED_CORPUS, "rt") as articles, open(source, "w") as out:
        out.writelines(line for _, line in zip(range(BUNDLED_ARTICLES), articles))
    prefix = os.path.join(directory, "bert")
    preprocess_bert([source], prefix, workers=1, progress=False)
    return prefix


def bert_run_config(smoke: Smoke, data_path: str, save: str):
    micro = smoke.args.micro_batch_size
    ds = {"train_batch_size": micro * smoke.parallel.dp_size, "train_micro_batch_size_per_gpu": micro,
          "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
          "optimizer": {"type": "AdamW", "params": {"lr": smoke.args.lr, "weight_decay": 0.01,
                                                    "torch_adam": uses_torch_adam(smoke)}}}
    return validate_static(RunConfig(
        tensor_parallel_size=smoke.parallel.tp_size, model=smoke.args.bert_model, seq_length=smoke.args.bert_seq_length,
        train_iters=2, data_path=data_path, split="80,20,0", seed=smoke.args.seed, save=save, log_interval=1,
        eval_interval=2, eval_iters=1, ds_config=ds, ds_config_path="<smoke>"))


def check_bert(smoke: Smoke) -> bool:
    """Two iterations of zoo's own pretraining loop on BERT (MLM + SOP metrics, a validation pass, a
    checkpoint): the loop's batches, metrics and collectives on the device, not only the model's."""
    directory = shared_temp_dir(make=bert_corpus)
    try:
        result = pretrain(bert_run_config(smoke, os.path.join(directory, "bert"), os.path.join(directory, "run")))
    finally:
        remove_shared_temp_dir(directory)
    keys = ("loss", "mlm_loss", "sop_loss", "val_loss")
    values = {key: result.get(key) for key in keys}
    ok = all(isinstance(v, float) and math.isfinite(v) for v in values.values()) and result.get("iteration") == 2
    shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
    return smoke.check("bert", ok, f"{smoke.args.bert_model} pretraining loop at tp={smoke.parallel.tp_size}, "
                                   f"sequence {smoke.args.bert_seq_length}, {result.get('iteration')} iterations: {shown}")


def check_generation(smoke: Smoke, model) -> bool:
    """Left-padded batch vs each prompt alone (greedy): the same tokens; no TP rank disagreed."""
    prompts = [token_ids(text, model.config.vocab_size) for text in PROMPTS]
    config = GenerationConfig(max_new_tokens=8, greedy=True, eod_token_id=None)
    batched = generate(model, prompts, config, smoke.parallel, batch_size=len(prompts))
    alone = generate(model, prompts, config, smoke.parallel, batch_size=1)
    same = [a.tokens == b.tokens for a, b in zip(batched, alone)]
    disagreements = sum(c.rank_disagreements for c in batched + alone)
    ok = all(same) and disagreements == 0
    lengths = sorted({len(p) for p in prompts})
    return smoke.check("generate", ok, f"{len(prompts)} prompts of {lengths} tokens, left-padded batch equals "
                                       f"each alone: {same}; TP rank disagreements {disagreements}")


def shared_temp_dir(make=None) -> str:
    """A directory rank 0 creates (and fills with ``make(directory)``) and every rank is then told
    (one node: the launcher's own machine)."""
    holder = [None]
    if dist.get_rank() == 0:
        holder[0] = tempfile.mkdtemp(prefix="zoo-smoke-")
        if make is not None:
            make(holder[0])
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def remove_shared_temp_dir(directory: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def check_checkpoint(smoke: Smoke, engine, ids: torch.Tensor) -> bool:
    """Save, take one more step (the weights move), load: the saved weights are back, bit for bit."""
    directory = shared_temp_dir()
    try:
        engine.save_checkpoint(directory, tag="smoke")
        saved = weights(engine)
        train_step(smoke, engine, ids)
        moved = any(not torch.equal(saved[n], p) for n, p in engine.module.named_parameters())
        load_path, _ = engine.load_checkpoint(directory, tag="smoke")
        restored = all(torch.equal(saved[n], p) for n, p in engine.module.named_parameters())
    finally:
        remove_shared_temp_dir(directory)
    ok = load_path is not None and moved and restored
    return smoke.check("checkpoint", ok, f"save + load in a temporary directory: weights moved by a step {moved}, "
                                         f"restored exactly {restored}")


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


def report_throughput(smoke: Smoke, precision: str, seconds: list[float], config) -> None:
    """Model TFLOPs per device of the timed steps (the first, warm-up, step left out) and the MFU."""
    per_step = sorted(seconds[1:])[len(seconds[1:]) // 2]                              # median
    flops = model_flops_per_iteration(smoke.args.micro_batch_size * smoke.parallel.dp_size, smoke.args.seq_length,
                                      shape_of(config), config.vocab_size)
    tflops = flops / per_step / dist.get_world_size() / 1e12
    peak = peak_tflops(smoke.device)
    mfu = f"{100 * tflops / peak:.1f}% of {peak:g}" if peak else f"n/a (no known peak for {smoke.device.type})"
    smoke.say(f"throughput {precision}: {per_step * 1e3:.1f} ms/step, {tflops:.3g} TFLOPs per device, MFU {mfu}")


def run(smoke: Smoke) -> bool:
    config = lm_config(smoke, **no_dropout(smoke))
    model = build(smoke, family_of(config).pretraining_model, config, smoke.parallel)
    results = [check_parity(smoke, model, parity_ids(smoke, config.vocab_size)), check_generation(smoke, model)]
    del model
    ids = train_batch(smoke, config.vocab_size)
    for precision in ("fp16", "bf16"):
        outcome = check_training(smoke, precision, ids)
        if outcome is None:
            continue
        passed, engine, seconds = outcome
        del outcome                                        # one engine on the device at a time
        results.append(passed)
        report_throughput(smoke, precision, seconds, config)
        if precision == "bf16":
            results.append(check_checkpoint(smoke, engine, ids))
        del engine
    results.append(check_loss_scale(smoke))
    results.append(check_bert(smoke))
    return all(results)
