"""The run configuration: a DeepSpeed config JSON plus its ``"zoo"`` block, CLI flags overriding both.

A ds_config is complete for DeepSpeed (batch sizes, optimizer, scheduler, fp16/bf16, clipping).
zoo reads its own settings from the top-level ``"zoo"`` key, which DeepSpeed ignores:

    "zoo": {"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 128, "train_iters": 300,
            "data_path": null, "split": "969,30,1", "seed": 1234, "save": "runs/demo",
            "pretrained": null, "log_interval": 10, "eval_interval": 100, "eval_iters": 4, "save_interval": 0,
            "checkpoint_activations": false, "compile": false, "wandb_project": null, "model_overrides": {},
            "data_workers": 2, "exit_interval": 0, "exit_duration_in_mins": null, "exit_signal_handler": true,
            "distributed_timeout_minutes": null, "sample_prompts": []}

``data_path`` null means the bundled Wikipedia sample, preprocessed once into a cache directory; a
string is one indexed-dataset prefix, a list Megatron's blend ``[W1, P1, W2, P2, ...]`` (the flag:
``--data-path W1 P1 W2 P2 ...``); either is held as a list (one prefix: a list of one).
``pretrained`` names a transformers-layout directory (GPT-2, MegatronBert or Bert, e.g. from
``save_pretrained`` or ``launch/export.py``) whose weights replace the random init, at any tp; the
preset then only names the family, the shapes come from the directory. ``load`` resumes a zoo
DeepSpeed checkpoint, also one written at another layout (the new run's ranks move it, see
zoo.checkpoint.layout_change; nothing is written beside it);
a ``load`` with no checkpoint yet starts the run from iteration 0, so a job script can always pass
``--save X --load X``.

Preemption (Megatron's flag names): ``exit_interval`` N stops with a checkpoint after every iteration
that is a multiple of N (so the same flag serves every allocation of a job); ``exit_duration_in_mins``
M stops with a checkpoint before M minutes of wall time (ranks agree); ``exit_signal_handler`` (on by
default) turns SIGTERM or SIGUSR1 on any rank into a checkpoint at the next iteration and exit 0.
``sample_prompts`` (families that generate text: GPT-2, Llama) are completed by sampling at the end of the
run, and the writer prints each beside the validation perplexity (zoo.inference.run_samples); empty, nothing
is generated. They are encoded and decoded with the run's ``tokenizer``, the directory its data was
preprocessed with (``launch/preprocess.py --tokenizer``; default the bundled GPT-2 BPE), and refused where
that tokenizer has more tokens than the model's vocabulary. ``distributed_timeout_minutes`` bounds every collective (DeepSpeed's default is 10 minutes), so a rank
that never arrives ends the job with the backend's timeout error rather than a hang.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass, field
from typing import Any

from zoo.options import CommandParser, add_deepspeed_config_argument, add_options, option


@dataclass
class RunConfig:
    """One pretraining run's settings: each field is a ``--flag`` (dashes) and a zoo-block key (underscores)."""

    tensor_parallel_size: int = option(1, group="parallelism", help="tensor-parallel degree: ranks per model replica")
    pipeline_model_parallel_size: int = option(
        1, group="parallelism",
        help="pipeline stages (GPT-2 and Llama; DeepSpeed's pipeline engine, 1F1B): tp x pp x dp = world size (default 1: "
             "every rank holds all layers)")
    context_parallel_size: int = option(
        1, group="parallelism",
        help="context-parallel degree (DeepSpeed-Ulysses, GPT-2 and Llama): ranks that split each sample's sequence, "
             "attention running over the whole sequence through all-to-alls between them; tp x cp x dp = world size "
             "(default 1)")
    pipeline_partition_method: str = option(
        "parameters", group="parallelism",
        help="how the layers are split over the stages: 'parameters' (balanced parameter counts, DeepSpeed's "
             "default) or 'uniform' (the same number of transformer layers per stage)")
    model: str = option("gpt2-tiny", group="model", help="model preset (zoo.models.families), e.g. gpt2-medium, llama-tiny, bert-336m")
    seq_length: int = option(1024, group="model", help="tokens per training sample")
    train_iters: int = option(1000, group="training", help="optimizer steps of the whole run")
    data_path: list[str] | None = option(
        None, group="data", metavar="PATH",
        expects=("a string or a list of strings", '"data/corpus"'),
        help="an indexed-dataset prefix written by launch/preprocess.py, or a blend W1 PREFIX1 W2 PREFIX2 ... "
             "(default: the bundled Wikipedia sample)")
    split: str = option("969,30,1", group="data", help="train,valid,test weights of the documents")
    seed: int = option(1234, group="training", help="seeds the init, dropout and the data order")
    save: str | None = option("runs/pretrain", group="checkpointing",
                              help="run directory: metrics.jsonl, loss.png and checkpoints/")
    load: str | None = option(None, group="checkpointing",
                              help="resume from this run directory (at any tp); none there yet starts at iteration 0")
    pretrained: str | None = option(None, group="checkpointing",
                                    help="transformers-layout directory to start from (instead of random init)")
    log_interval: int = option(10, group="logging", help="iterations between log lines")
    eval_interval: int = option(1000, group="training", help="iterations between validations (0: never)")
    eval_iters: int = option(10, group="training",
                            help="global batches per validation: the same samples at every layout")
    save_interval: int = option(0, group="checkpointing", help="iterations between checkpoints (0: at the end only)")
    checkpoint_activations: bool = option(
        False, group="training",
        help="recompute each layer in backward (DeepSpeed activation checkpointing; Megatron's older flag for "
             "--recompute-granularity full)")
    recompute_granularity: str | None = option(
        None, group="training", help="'full' (every layer) or 'selective' (the attention core)")
    compile: bool = option(
        False, group="training", negatable=True,
        help="compile each transformer block with torch.compile (inductor; one graph serves every layer); off by "
             "default: on CPU it measured no faster than eager (benchmarks/bench_compile.py), and it has not been "
             "measured on a GPU yet")
    sequence_parallel: bool = option(
        False, group="parallelism",
        help="sequence parallelism (Korthikanti et al. 2022): LayerNorm, dropout and residuals on seq_length / tp "
             "tokens per rank; seq_length must divide by tp")
    wandb_project: str | None = option(None, group="logging", help="log to this W&B project")
    tensorboard_dir: str | None = option(None, group="logging",
                                         help="also write metrics.jsonl's scalars here as TensorBoard events")
    model_overrides: dict[str, Any] = option(group="model", flag=None, default_factory=dict,
                                             help='model config fields to change, e.g. {"resid_pdrop": 0.0}')
    # Megatron-LM's model-shape flags: each becomes a model_overrides entry under the preset's family's own
    # field name (zoo.models.families.megatron_shape_overrides), so config.json keeps them there.
    num_layers: int | None = option(None, group="model", in_block=False, help="transformer layers")
    hidden_size: int | None = option(None, group="model", in_block=False, help="hidden size")
    num_attention_heads: int | None = option(None, group="model", in_block=False, help="attention (query) heads")
    ffn_hidden_size: int | None = option(None, group="model", in_block=False,
                                         help="the MLP's inner width (default: the preset's)")
    num_key_value_heads: int | None = option(None, group="model", in_block=False,
                                             help="Llama: key/value heads of grouped-query attention")
    max_position_embeddings: int | None = option(None, group="model", in_block=False,
                                                 help="positions the model has (at least --seq-length)")
    make_vocab_size_divisible_by: int | None = option(
        None, group="model", in_block=False, help="the vocabulary is padded to a multiple of this x tp (default 128)")
    data_workers: int = option(2, group="data",
                               help="DataLoader worker processes per rank (0: read batches in the training process)")
    exit_interval: int = option(0, group="checkpointing",
                                help="stop with a checkpoint after every iteration that is a multiple of it (0: off)")
    exit_duration_in_mins: float | None = option(None, group="checkpointing",
                                                 help="stop with a checkpoint before this much wall time")
    exit_signal_handler: bool = option(
        True, group="checkpointing", negatable=True,
        help="on SIGTERM or SIGUSR1 every rank stops at the next iteration with a checkpoint and exits 0 (default: on)")
    distributed_timeout_minutes: float | None = option(
        None, group="parallelism", help="every collective's timeout (default: DeepSpeed's 10 minutes)")
    overwrite: bool = option(
        False, group="checkpointing",
        help="let a run without --load write into a --save directory that already holds checkpoints (its "
             "checkpoints and metrics are replaced)")
    sample_prompts: list[str] = option(group="logging", flag=None, default_factory=list,
                                       help="GPT-2 and Llama: text sampled from each prompt at the end (the demo)")
    tokenizer: str | None = option(None, group="logging", flag=None,
                                   help="the tokenizer directory the data was preprocessed with, which encodes and "
                                        "decodes sample_prompts (default: the bundled GPT-2 BPE)")
    # Megatron's flags for what the DeepSpeed part of the ds_config says (zoo.config.deepspeed_overrides):
    # None leaves the ds_config's own value.
    lr: float | None = option(None, group="learning rate",
                              help="peak learning rate (the optimizer's lr; WarmupDecayLR's warmup_max_lr)")
    min_lr: float | None = option(
        None, group="learning rate",
        help="learning rate at the end of the decay (WarmupCosineLR's cos_min_ratio x lr; WarmupDecayLR's "
             "warmup_min_lr, where its warm-up also starts); without it the ds_config's floor is kept")
    lr_warmup_iters: int | None = option(None, group="learning rate",
                                         help="iterations of linear warm-up (the scheduler's warmup_num_steps)")
    micro_batch_size: int | None = option(None, group="training",
                                          help="samples per rank per forward (train_micro_batch_size_per_gpu)")
    global_batch_size: int | None = option(
        None, group="training",
        help="samples per optimizer step over all ranks (train_batch_size) = micro-batch x accumulation steps x dp")
    fp16: bool | None = option(None, group="mixed precision",
                               help="train in fp16 with dynamic loss scaling (enables the fp16 block, disables bf16)")
    bf16: bool | None = option(None, group="mixed precision",
                               help="train in bf16 (enables the bf16 block, disables fp16)")
    clip_grad: float | None = option(None, group="training",
                                     help="gradient clipping by global norm (gradient_clipping; 0: off)")
    weight_decay: float | None = option(None, group="training",
                                        help="AdamW weight decay (the optimizer's weight_decay)")
    skip_fit_check: bool = option(
        False, group="parallelism", in_block=False,
        help="start even where the planner says the run does not fit in this device's memory")
    ds_config: dict[str, Any] = field(default_factory=dict, repr=False)
    ds_config_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data_path, str):   # one prefix is a blend of one
            self.data_path = [self.data_path]

    @property
    def recompute(self) -> str | None:
        """The activation recomputation: "full", "selective" or None."""
        return "full" if self.checkpoint_activations else self.recompute_granularity

    def model_run_fields(self) -> dict[str, Any]:
        """The model-config keywords of the run's recomputation and sequence parallelism."""
        return {"activation_checkpointing": self.recompute == "full", "sequence_parallel": self.sequence_parallel,
                "recompute_granularity": "selective" if self.recompute == "selective" else None}

    @property
    def dtype_name(self) -> str:
        if self.ds_config.get("fp16", {}).get("enabled"):
            return "fp16"
        if self.ds_config.get("bf16", {}).get("enabled"):
            return "bf16"
        return "fp32"


PRECEDENCE = ("Precedence, one rule for every setting: a flag given on the command line overrides the ds_config's "
              "zoo block, which overrides the ds_config's own DeepSpeed values (--lr, --min-lr, --lr-warmup-iters, "
              "--micro-batch-size, --global-batch-size, --fp16, --bf16, --clip-grad and --weight-decay rewrite the "
              "optimizer, scheduler, batch and precision entries they name); what neither sets keeps the ds_config's "
              "value. The run prints the settings it resolved and keeps them in <save>/config.json.")


def build_parser(description: str) -> argparse.ArgumentParser:
    """The pretraining parser: every RunConfig flag in its --help group (absent flags parse as None, so the
    zoo block keeps its values), plus DeepSpeed's ``--deepspeed_config``."""
    parser = CommandParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=textwrap.fill(PRECEDENCE, 100))
    add_options(parser, RunConfig)
    add_deepspeed_config_argument(parser)
    return parser


__all__ = ["PRECEDENCE", "RunConfig", "build_parser"]
