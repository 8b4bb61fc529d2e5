"""Data pipeline: GPT-2 tokenizer, Megatron-layout mmap indexed dataset, preprocessing, GPT samples."""

from zoo.data.bert_dataset import BertDataset, build_bert_datasets
from zoo.data.bert_preprocess import BertPreprocessSummary, default_bert_corpus_prefix, preprocess_bert, split_sentences
from zoo.data.gpt_dataset import (
    DistributedPretrainingSampler,
    GPTDataset,
    build_gpt_datasets,
    build_pretraining_dataloader,
    parse_split,
    split_document_ranges,
)
from zoo.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    dataset_exists,
    index_file_path,
)
from zoo.data.preprocess import PreprocessSummary, default_cache_dir, default_corpus_prefix, preprocess
from zoo.data.tokenizers import (
    BERT_TOKENIZER_DIR,
    GPT2_EOD_TOKEN_ID,
    GPT2_TOKENIZER_DIR,
    load_bert_tokenizer,
    load_gpt2_tokenizer,
)

__all__ = [
    "BERT_TOKENIZER_DIR",
    "BertDataset",
    "BertPreprocessSummary",
    "build_bert_datasets",
    "default_bert_corpus_prefix",
    "load_bert_tokenizer",
    "preprocess_bert",
    "split_sentences",
    "DistributedPretrainingSampler",
    "GPT2_EOD_TOKEN_ID",
    "GPT2_TOKENIZER_DIR",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "PreprocessSummary",
    "best_fitting_dtype",
    "build_gpt_datasets",
    "build_pretraining_dataloader",
    "data_file_path",
    "dataset_exists",
    "default_cache_dir",
    "default_corpus_prefix",
    "index_file_path",
    "load_gpt2_tokenizer",
    "parse_split",
    "preprocess",
    "split_document_ranges",
]
