"""LAMBADA accuracy counted with transformers' own GPT-2, one passage at a time, and passages in
lambada_test.jsonl's form that the model gets partly right.

An accuracy compared exactly is rounding-proof when every scored position decides "is the target the
arg-max?" by at least ``DECISION_MARGIN`` of max|logits| (``reference_margin`` measures it on the data),
far above fp32 rounding of the logits (~1e-7 relative)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.checks import decision_margin

DECISION_MARGIN = 1e-4              # 10x the 1e-5 logits tolerance of the parity tests


def write_jsonl(path: Path, texts) -> Path:
    """``texts`` as lambada_test.jsonl holds them: one {"text": ...} object a line."""
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def greedy_passages(hf_model, tokenizer) -> list[str]:
    """Passages in lambada_test.jsonl's form; some end in the model's own greedy word (so the model
    gets them right), some in a fixed word (so it gets them wrong)."""
    prompts = ["In my palm is a clear stone, and inside it is a small ivory", "She opened the door and saw the",
               "After the long winter the farmers went back to their", "He could not remember where he had left his",
               "The children sang a song about the old", "Nobody in the village had ever seen such a",
               "The captain ordered the crew to lower the", "Her favourite book was a story about a"]
    texts = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            greedy = tokenizer.decode([int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())])
        word = greedy.strip() if i % 2 == 0 and greedy.startswith(" ") and greedy.strip().isalpha() else "Heisenberg"
        texts.append(f"{prompt} {word}")
    return texts


def reference_scores(hf_model, tokenizer, text: str, strict: bool) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits at the positions that predict the target word's tokens, and those tokens."""
    if strict:
        last = text.split()[-1]
        context = tokenizer(text[:text.rindex(last)].strip())["input_ids"]
        target = tokenizer(" " + last)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
        context, target = ids[:-1], ids[-1:]
    sequence = context + target[:-1]
    with torch.no_grad():
        logits = hf_model(torch.tensor([sequence])).logits[0]
    return logits[len(context) - 1:], target


def reference_correct(hf_model, tokenizer, texts, strict: bool) -> int:
    """Accuracy counted with transformers' model, one passage at a time."""
    correct = 0
    for text in texts:
        logits, target = reference_scores(hf_model, tokenizer, text, strict)
        correct += logits.argmax(-1).tolist() == target
    return correct


def reference_margin(hf_model, tokenizer, texts, strict: bool) -> float:
    """The smallest margin by which any scored position decides whether its target is the arg-max
    (tests.checks.decision_margin): an accuracy can change under rounding only if this is tiny."""
    return min(decision_margin(logits, torch.tensor(target))
               for logits, target in (reference_scores(hf_model, tokenizer, t, strict) for t in texts))
