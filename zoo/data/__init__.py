"""Data pipeline: GPT-2 tokenizer, Megatron-layout mmap indexed dataset, preprocessing, GPT samples.

The names below load their module on first use (PEP 562): preprocessing and ``--help`` never pay for
torch, which only the datasets and samplers need.
"""

from __future__ import annotations

import importlib

# Imported now, not on first use: the submodule of the same name would otherwise shadow the function
# once anything imports zoo.data.preprocess. It does not import torch.
from zoo.data.preprocess import preprocess as preprocess

_MODULE_OF = {
    "BertDataset": "zoo.data.bert_dataset",
    "build_bert_datasets": "zoo.data.bert_dataset",
    "BertPreprocessSummary": "zoo.data.bert_preprocess",
    "default_bert_corpus_prefix": "zoo.data.bert_preprocess",
    "preprocess_bert": "zoo.data.bert_preprocess",
    "split_sentences": "zoo.data.bert_preprocess",
    "DistributedPretrainingSampler": "zoo.data.gpt_dataset",
    "GPTDataset": "zoo.data.gpt_dataset",
    "build_gpt_datasets": "zoo.data.gpt_dataset",
    "build_pretraining_dataloader": "zoo.data.gpt_dataset",
    "parse_split": "zoo.data.gpt_dataset",
    "split_document_ranges": "zoo.data.gpt_dataset",
    "IndexedDataset": "zoo.data.indexed_dataset",
    "IndexedDatasetBuilder": "zoo.data.indexed_dataset",
    "best_fitting_dtype": "zoo.data.indexed_dataset",
    "data_file_path": "zoo.data.indexed_dataset",
    "dataset_exists": "zoo.data.indexed_dataset",
    "index_file_path": "zoo.data.indexed_dataset",
    "PreprocessSummary": "zoo.data.preprocess",
    "default_cache_dir": "zoo.data.preprocess",
    "default_corpus_prefix": "zoo.data.preprocess",
    "BERT_TOKENIZER_DIR": "zoo.data.tokenizers",
    "GPT2_EOD_TOKEN_ID": "zoo.data.tokenizers",
    "GPT2_TOKENIZER_DIR": "zoo.data.tokenizers",
    "load_bert_tokenizer": "zoo.data.tokenizers",
    "load_gpt2_tokenizer": "zoo.data.tokenizers",
}

__all__ = sorted([*_MODULE_OF, "preprocess"])


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
