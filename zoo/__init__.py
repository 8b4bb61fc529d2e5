"""zoo: Megatron-LM tensor parallelism on top of DeepSpeed, with Hugging Face-style checkpoints."""

__version__ = "0.1.0"
