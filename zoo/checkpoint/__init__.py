"""Checkpoint conversion: zoo DeepSpeed training checkpoints (any tp) to transformers' layout."""

from zoo.checkpoint.deepspeed_export import ExportResult, export_checkpoint, merged_hf_state, tag_directory

__all__ = ["ExportResult", "export_checkpoint", "merged_hf_state", "tag_directory"]
