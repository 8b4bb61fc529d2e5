"""The bundled data files (licenses in LICENSES.md): the paths, said once. Imports nothing of zoo."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
GPT2_TOKENIZER_DIR = ASSETS_DIR / "gpt2"
BERT_TOKENIZER_DIR = ASSETS_DIR / "bert-base-uncased"
BUNDLED_CORPUS = ASSETS_DIR / "corpora" / "wiki-sample.jsonl.gz"
