"""zoo DeepSpeed training checkpoints: export to transformers' layout (GPT-2, BERT; any tp) and reshard to a new tp."""

from zoo.checkpoint.deepspeed_export import ExportResult, export_checkpoint, merged_hf_state
from zoo.checkpoint.files import tag_directory

__all__ = ["ExportResult", "export_checkpoint", "merged_hf_state", "tag_directory"]
