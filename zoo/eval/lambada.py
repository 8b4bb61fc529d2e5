"""LAMBADA zero-shot cloze accuracy (Shoeybi et al. 2019, Appendix E.2).

Each passage is split into a context and its last word. The model must produce that word, which
may be several BPE tokens:

* strict (the paper's, the default): the target is the last whitespace-separated word, tokenized
  with its leading space as GPT-2 BPE sees it mid-text (`` word``); the context is the text
  before it, stripped. A passage is correct only if the model's arg-max is right at every target
  token, teacher-forced (one forward of context + target[:-1]).
* non-strict: the whole passage is tokenized and only its last BPE token is predicted, the word's
  earlier pieces being given as context.

accuracy = correct / passages.

The arg-max over the vocabulary is vocab-parallel (``zoo.parallel.argmax.vocab_parallel_argmax``):
a local max and index per TP shard and two all-reduces of one scalar per target token, so the
logits are never gathered. Passages longer than the model's context lose the start of their
context (left truncation); ``truncated`` counts them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from zoo.distributed import dp_block, dp_sum
from zoo.errors import UserError
from zoo.eval.wikitext import model_device
from zoo.parallel.argmax import vocab_parallel_argmax
from zoo.parallel.state import ParallelState


@dataclass(frozen=True)
class LambadaExample:
    """Token ids of one passage: the model reads ``context`` and must produce ``target``."""

    context: tuple[int, ...]
    target: tuple[int, ...]


def split_last_word(text: str) -> tuple[str, str]:
    """(context, last word): the word is the last whitespace-separated one, the context the text before it."""
    parts = text.rsplit(maxsplit=1)
    if len(parts) < 2:
        raise UserError(f"the LAMBADA passage {text[:60]!r} has fewer than two words; every passage needs a "
                         "context before its last word.")
    return parts[0].strip(), parts[1]


def build_example(text: str, tokenizer, strict: bool = True) -> LambadaExample:
    """Tokenize one passage into (context, target) as the strict or non-strict task defines them."""
    def encode(string: str) -> list[int]:
        return tokenizer(string, add_special_tokens=False, verbose=False)["input_ids"]

    if strict:
        context, word = split_last_word(text)
        return LambadaExample(tuple(encode(context)), tuple(encode(" " + word)))
    ids = encode(text.strip())
    if len(ids) < 2:
        raise UserError(f"the LAMBADA passage {text[:60]!r} is {len(ids)} BPE token(s); non-strict scoring "
                         "needs at least 2.")
    return LambadaExample(tuple(ids[:-1]), tuple(ids[-1:]))


def fit_to_context(example: LambadaExample, n_positions: int) -> tuple[LambadaExample, bool]:
    """Drop tokens from the start of the context until context + target[:-1] fits the model."""
    overflow = len(example.context) + len(example.target) - 1 - n_positions
    if overflow <= 0:
        return example, False
    if overflow >= len(example.context):
        raise UserError(f"a LAMBADA target of {len(example.target)} BPE tokens leaves no context in the model's "
                         f"n_positions {n_positions}; use a model with a longer context.")
    return LambadaExample(example.context[overflow:], example.target), True


def example_batches(examples: Sequence[LambadaExample],
                    batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]]:
    """(input_ids (b, s), rows (n,), positions (n,), target ids (n,)) per batch; ``n`` = target tokens.

    Row i reads context + target[:-1], right-padded with token 0 (causal, so no mask is needed); the
    logit at position len(context) - 1 + j predicts target token j.
    """
    for first in range(0, len(examples), batch_size):
        chunk = examples[first:first + batch_size]
        width = max(len(e.context) + len(e.target) - 1 for e in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)                     # (b, s)
        rows, positions, targets = [], [], []
        for row, e in enumerate(chunk):
            sequence = e.context + e.target[:-1]
            input_ids[row, :len(sequence)] = torch.tensor(sequence)
            rows += [row] * len(e.target)
            positions += range(len(e.context) - 1, len(e.context) - 1 + len(e.target))
            targets += e.target
        yield input_ids, torch.tensor(rows), torch.tensor(positions), targets


@torch.no_grad()
def count_correct(model, examples: Sequence[LambadaExample], parallel: ParallelState | None = None,
                  batch_size: int = 8, progress: bool = False) -> int:
    """Passages whose every target token is the model's arg-max, on this rank only."""
    device = model_device(model)
    correct = 0
    with tqdm(total=len(examples), desc="lambada passages", unit="ex", disable=not progress) as bar:
        for input_ids, rows, positions, targets in example_batches(examples, batch_size):
            local_logits = model(input_ids.to(device)).logits                            # (b, s, V_pad/p)
            picked = local_logits[rows.to(device), positions.to(device)]                 # (n, V_pad/p)
            predicted = vocab_parallel_argmax(picked, parallel, model.config.vocab_size)  # (n,)
            hit = (predicted.cpu() == torch.tensor(targets)).tolist()
            per_row: dict[int, bool] = {}
            for row, ok in zip(rows.tolist(), hit):
                per_row[row] = per_row.get(row, True) and ok
            correct += sum(per_row.values())
            bar.update(input_ids.shape[0])
    return correct


@dataclass(frozen=True)
class LambadaResult:
    """``accuracy`` = correct / total; ``multi_token_targets`` counts targets of 2+ BPE tokens."""

    task: str
    strict: bool
    accuracy: float
    correct: int
    total: int
    multi_token_targets: int
    truncated: int

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_lambada(model, texts: Sequence[str], tokenizer, *, strict: bool = True,
                     parallel: ParallelState | None = None, batch_size: int = 8,
                     progress: bool = False) -> LambadaResult:
    """Zero-shot LAMBADA accuracy of ``model`` on the passages ``texts``.

    Collective over the grid: passages are split disjointly over DP ranks and the counts
    all-reduced, so every rank returns the same result.
    """
    if batch_size < 1:
        raise UserError(f"batch size {batch_size} is not positive; pass --batch-size 1 or more.")
    if not texts:
        raise UserError("no LAMBADA passages were given; pass a jsonl file with one {\"text\": ...} object per line.")
    fitted = [fit_to_context(build_example(text, tokenizer, strict), model.config.n_positions) for text in texts]
    examples = [example for example, _ in fitted]
    mine = [examples[i] for i in dp_block(len(examples), parallel)]
    local_correct = count_correct(model, mine, parallel, batch_size, progress)
    correct = int(round(dp_sum([local_correct], parallel, model_device(model))[0]))
    return LambadaResult(task="lambada", strict=strict, accuracy=correct / len(examples), correct=correct,
                         total=len(examples), multi_token_targets=sum(len(e.target) > 1 for e in examples),
                         truncated=sum(cut for _, cut in fitted))
