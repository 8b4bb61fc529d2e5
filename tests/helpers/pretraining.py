"""A tiny GPT-2 pretraining run as the tests configure it: the DeepSpeed config, the validated
RunConfig for ``zoo.training.pretrain.pretrain``, and the training events a run logs."""

from __future__ import annotations

TINY_MODEL = dict(n_layer=2, n_embd=64, n_head=4)
NO_DROPOUT = dict(TINY_MODEL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def ds_config(micro: int, global_batch: int, **extra) -> dict:
    """A complete DeepSpeed config: AdamW (torch's, no JIT build) with weight decay 0.01, clipping 1.0, a
    10-step warm-up cosine schedule; ``extra`` top-level keys are added or replaced."""
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2, "cos_min_ratio": 0.1,
                                                           "warmup_type": "linear"}},
    }
    config.update(extra)
    return config


def run_config(data_path, save, tp, micro, global_batch, train_iters, **changes):
    """A validated RunConfig of gpt2-tiny (``TINY_MODEL``) on sequences of 32 tokens, logging every
    iteration, no evaluation unless ``changes`` say so; ``changes`` set RunConfig fields."""
    from zoo.config.run_config import RunConfig
    from zoo.config.validation import validate_static

    config = RunConfig(tensor_parallel_size=tp, model="gpt2-tiny", seq_length=32, train_iters=train_iters,
                       data_path=data_path, split="80,20,0", save=save, log_interval=1, eval_interval=0, eval_iters=1,
                       model_overrides=dict(TINY_MODEL), ds_config=ds_config(micro, global_batch),
                       ds_config_path="<test>")
    for key, value in changes.items():
        setattr(config, key, value)
    return validate_static(config)


def train_events(run_dir) -> list[dict]:
    """The training events of ``run_dir``'s metrics.jsonl (evaluation events left out)."""
    from zoo.training.metrics import read_metrics

    return [e for e in read_metrics(run_dir) if "split" not in e]
