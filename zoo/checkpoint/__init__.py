"""Checkpoints, every kind zoo reads or writes, in one home. Its import-free ``__init__`` lets the
transformers-format layer below the models (:mod:`zoo.checkpoint.hf`) sit in this package.

    hf/               transformers' directories: config.json, safetensors shards, per-rank slices (below zoo.models)
    files.py          DeepSpeed's checkpoint layout: tags, ``latest``, rank files, the completion marker
    save.py           a DeepSpeed save that is complete or absent
    safe_load.py      weights-only loading of rank files
    resume.py         which tag a run resumes, and its recorded layout
    training_state.py the layout-free reader of a tag's model and optimizer state
    layout_change.py  a resume at another tp, pp, dp or ZeRO stage, moved by the new ranks
    reshard.py, zero_reshard.py  the readers of DeepSpeed's optimizer layouts
    pipeline_files.py pipeline stages' layer files
    deepspeed_export.py  a training checkpoint to transformers' layout, at any tp
    megatron_import.py   a Megatron-LM checkpoint to transformers' layout
    deepspeed_tools.py, universal.py  DeepSpeed's own tools: zero_to_fp32 scripts, universal checkpoints
    layout.py, mapped_pages.py  what a tag's layout is; page accounting of memory-mapped reads
"""
