"""WikiText-103 zero-shot perplexity (Shoeybi et al. 2019, Appendix E.1).

The paper's procedure, step by step:

1. Count the tokens of the original word-level test file, T_o, before any processing: its
   whitespace-separated tokens plus one end-of-line (``<eos>``) token per line, as WikiText's
   statistics count them (245,566 in the paper for wiki.test.tokens).
2. Detokenize: undo WikiText's tokenization artifacts (`` @-@ ``, `` @,@ ``, `` @.@ ``, spaces
   before punctuation and inside brackets and quotes, ``= = Heading = =``, `` 's``), so the text
   looks like the web text GPT-2 was trained on.
3. Tokenize the whole detokenized text as one stream with GPT-2 BPE: T tokens x_1 .. x_T, so
   T - 1 tokens are predicted.
4. Slide a window of L tokens (the model's context, 1024) over the stream with stride o (the
   overlap, 32): window k feeds x_{ko+1} .. x_{ko+L} and predicts the next token at each position.
   Window 0 scores all its L targets; window k > 0 scores only its last o targets, which are the
   ones no earlier window predicted. Every token is predicted exactly once, and each one after the
   first window sees at least L - o tokens of context.
5. Report the token-level loss  l = sum(loss) / (T - 1)  and perplexity  exp(l), and the paper's
   adjusted perplexity, normalized by the original word count so it is comparable across
   tokenizers:

       PPL = exp( sum(loss) / (T_o - 1) ) = exp( l * (T - 1) / (T_o - 1) ).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from zoo.distributed import dp_block, dp_sum
from zoo.errors import UserError
from zoo.parallel import vocab_parallel_cross_entropy
from zoo.parallel.state import ParallelState

IGNORE_INDEX = -100
DEFAULT_OVERLAP = 32

# Detokenization rules, applied in this order (the effective rules of Megatron-LM's
# tasks/zeroshot_gpt/detokenizer.py, so token counts match the paper's pipeline). Tuples: immutable.
_LITERAL_RULES_BEFORE_BRACKETS = (
    ("s '", "s'"),                       # plural possessive: "players ' union" -> "players' union"
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),  # split numbers and hyphenated words
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
)
_BRACKET_PAIRS = (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'"))
_LITERAL_RULES_AFTER_BRACKETS = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),   # section headings
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"), ("\n ", "\n"),                             # line-boundary spaces
    (" N ", " 1 "),                                           # the number placeholder
    (" 's", "'s"),                                            # possessive
)


def count_original_tokens(raw_text: str) -> int:
    """T_o: the tokens of the original word-level file, before any processing.

    These are its whitespace-separated tokens plus one end-of-line token per line: WikiText's own
    statistics count every line end as an ``<eos>`` token (245,569 for the test set), and the
    paper's T_o = 245,566 is the same count as Megatron-LM computes it (``split(" ")`` of the
    stripped text, where each line end is a ``"\n"`` piece). Words alone (about 241k) would raise
    the adjusted log-perplexity by 1.8%.
    """
    line_ends = raw_text.count("\n") + (0 if raw_text.endswith("\n") else 1)
    return len(raw_text.split()) + line_ends


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's word-level tokenization (Megatron-LM's rules, see the module docstring).

    Bracketed and quoted spans lose the spaces just inside their delimiters:
    ``( built in 1 @.@ 5 years )`` -> ``(built in 1.5 years)``.
    """
    for old, new in _LITERAL_RULES_BEFORE_BRACKETS:
        text = text.replace(old, new)
    for opening, closing in _BRACKET_PAIRS:
        inside = rf"{re.escape(opening)}\s*([^{re.escape(closing)}]*?)\s*{re.escape(closing)}"
        text = re.sub(inside, opening + r"\1" + closing, text)
    for old, new in _LITERAL_RULES_AFTER_BRACKETS:
        text = text.replace(old, new)
    return text


# ---------------------------------------------------------------------------------------- windows
@dataclass(frozen=True)
class Window:
    """One forward over the token stream: inputs x[start : start + length], targets shifted by one.

    Targets ``first_scored .. length - 1`` (window-relative) are scored, the rest only give context.
    """

    start: int
    length: int
    first_scored: int


def validate_window(seq_length: int, overlap: int, n_positions: int) -> None:
    """One-sentence errors for a window the model cannot run or a stride that skips tokens."""
    if seq_length < 1:
        raise UserError(f"sequence length {seq_length} is not positive; pass --seq-length between 1 and the "
                         f"model's n_positions {n_positions}.")
    if seq_length > n_positions:
        raise UserError(f"sequence length {seq_length} exceeds the model's n_positions {n_positions}; pass "
                         f"--seq-length {n_positions} or less.")
    if not 1 <= overlap <= seq_length:
        raise UserError(f"overlap {overlap} is outside 1..{seq_length}; pass --overlap between 1 and the "
                         f"sequence length {seq_length} (equal to it means disjoint windows).")


def plan_windows(num_tokens: int, seq_length: int, overlap: int) -> list[Window]:
    """The sliding windows that predict each of the ``num_tokens - 1`` targets exactly once.

    With L = seq_length and o = overlap, window k starts at k*o and covers targets up to
    k*o + L; there are 1 + ceil((T - 1 - L) / o) windows when T - 1 > L, else one (shorter) window.
    Window k > 0 scores its targets from L - o on: those after window k-1's last one.
    """
    if num_tokens < 2:
        raise UserError(f"the text tokenizes to {num_tokens} token(s) and at least 2 are needed to predict "
                         "one; pass a longer text.")
    num_targets = num_tokens - 1
    count = 1 if num_targets <= seq_length else 1 + math.ceil((num_targets - seq_length) / overlap)
    windows = []
    for k in range(count):
        start = k * overlap
        windows.append(Window(start=start, length=min(seq_length, num_targets - start),
                              first_scored=0 if k == 0 else seq_length - overlap))
    return windows


def window_batches(tokens: torch.Tensor, windows: Sequence[Window],
                   batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, targets), each (b, s): right-padded with token 0 and target -100.

    Right padding needs no attention mask: a causal model's position t never sees later positions.
    """
    for first in range(0, len(windows), batch_size):
        chunk = windows[first:first + batch_size]
        width = max(w.length for w in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)                       # (b, s)
        targets = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)          # (b, s)
        for row, w in enumerate(chunk):
            input_ids[row, :w.length] = tokens[w.start:w.start + w.length]
            targets[row, w.first_scored:w.length] = tokens[w.start + 1 + w.first_scored:w.start + 1 + w.length]
        yield input_ids, targets


@torch.no_grad()
def score_windows(model, tokens: torch.Tensor, windows: Sequence[Window], parallel: ParallelState | None = None,
                  batch_size: int = 4, progress: bool = False) -> tuple[float, int]:
    """(sum of per-token losses, number of scored tokens) over ``windows``, on this rank only.

    The loss of each target comes from the fused vocab-parallel cross-entropy on the local logit
    shard (no logit gathering), evaluated only from the batch's first scored position on; it is
    summed in fp64.
    """
    device = model_device(model)
    loss_sum, count = 0.0, 0
    batches = window_batches(tokens, windows, batch_size)
    with scoring_bar(sum(scored_targets(w) for w in windows), progress) as bar:
        for input_ids, targets in batches:
            input_ids, targets = input_ids.to(device), targets.to(device)
            local_logits = model(input_ids).logits                                        # (b, s, V_pad/p)
            # Later windows score only their last o positions: skip the softmax of the leading ones.
            first = int((targets != IGNORE_INDEX).any(dim=0).nonzero()[0])
            token_loss = vocab_parallel_cross_entropy(                                    # (b, s - first)
                local_logits[:, first:], targets[:, first:], parallel, vocab_size=model.config.vocab_size)
            loss_sum += token_loss.double().sum().item()
            scored = int((targets != IGNORE_INDEX).sum())
            count += scored
            bar.update(scored)
    return loss_sum, count


def scored_targets(window: Window) -> int:
    return window.length - window.first_scored


def scoring_bar(total_tokens: int, progress: bool) -> tqdm:
    """A progress bar over the tokens scored, so its rate reads as tokens/s; shown only where ``progress``
    (the writer rank) and stderr is a terminal (tqdm's ``disable=None``), so a redirected log never gets
    its carriage returns. :func:`cost_line` says the same cost in one line wherever the bar is off."""
    return tqdm(total=total_tokens, desc="wikitext", unit="tok", unit_scale=True, disable=None if progress else True)


def cost_line(windows: Sequence[Window], seq_length: int, overlap: int) -> str:
    """What the evaluation will compute, in one line: the windows, the tokens each scores, the tokens scored
    in all and the token positions run through the model (every window runs all its positions, the
    context included, so the cost grows as seq_length / overlap per scored token)."""
    scored = sum(scored_targets(w) for w in windows)
    positions = sum(w.length for w in windows)
    later = f", the others their last {overlap}" if len(windows) > 1 else ""
    return (f"wikitext: {len(windows):,} window(s) of up to {seq_length} tokens (the first scores "
            f"{scored_targets(windows[0])}{later}): {scored:,} tokens scored, {positions:,} token positions run "
            f"({positions / scored:.1f} per scored token; a larger --overlap runs fewer windows with less context)")


@dataclass(frozen=True)
class WikitextResult:
    """Paper metrics: ``loss`` = sum/(T-1), ``ppl`` = exp(loss), ``adjusted_ppl`` = exp(sum/(T_o-1))."""

    task: str
    loss: float
    ppl: float
    adjusted_ppl: float
    num_tokens: int               # T, GPT-2 BPE tokens of the detokenized stream
    num_original_tokens: int      # T_o, tokens of the original word-level file (words + line ends)
    num_predicted: int            # T - 1
    loss_sum: float
    num_windows: int
    seq_length: int
    overlap: int

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_wikitext(model, raw_text: str, tokenizer, *, seq_length: int | None = None,
                      overlap: int = DEFAULT_OVERLAP, parallel: ParallelState | None = None,
                      batch_size: int = 4, progress: bool = False) -> WikitextResult:
    """Zero-shot WikiText perplexity of ``model`` on ``raw_text`` (the original file's text).

    ``seq_length`` defaults to the model's n_positions. Collective over the grid: every rank calls
    it; the windows are split disjointly over DP ranks and the sums all-reduced, so every rank
    returns the same result. ``progress`` (the writer rank only): print the cost first
    (:func:`cost_line`), then show a bar of this rank's scored tokens with their rate (tokens/s).
    """
    n_positions = model.config.n_positions
    seq_length = n_positions if seq_length is None else seq_length
    validate_window(seq_length, overlap, n_positions)
    if batch_size < 1:
        raise UserError(f"batch size {batch_size} is not positive; pass --batch-size 1 or more.")
    num_original = count_original_tokens(raw_text)
    if num_original < 2:
        raise UserError(f"the WikiText text has {num_original} original token(s) and the adjusted perplexity "
                         "needs at least 2; pass the full wiki.test.tokens file.")
    ids = tokenizer(wikitext_detokenize(raw_text), add_special_tokens=False, verbose=False)["input_ids"]
    tokens = torch.tensor(ids, dtype=torch.long)
    windows = plan_windows(len(tokens), seq_length, overlap)
    if progress:
        print(cost_line(windows, seq_length, overlap), flush=True)
    mine = [windows[i] for i in dp_block(len(windows), parallel)]
    local_sum, local_count = score_windows(model, tokens, mine, parallel, batch_size, progress)
    loss_sum, count = dp_sum([local_sum, local_count], parallel, model_device(model))
    count = int(round(count))
    if count != len(tokens) - 1:   # the windows' contract; a violation is a bug, not a user error
        raise RuntimeError(f"scored {count} targets, expected {len(tokens) - 1}")
    loss = loss_sum / count
    return WikitextResult(task="wikitext", loss=loss, ppl=safe_exp(loss),
                          adjusted_ppl=safe_exp(loss_sum / (num_original - 1)), num_tokens=len(tokens),
                          num_original_tokens=num_original, num_predicted=count, loss_sum=loss_sum,
                          num_windows=len(windows), seq_length=seq_length, overlap=overlap)


def safe_exp(value: float) -> float:
    """exp, with +inf instead of OverflowError for a hopeless model."""
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf


def model_device(model) -> torch.device:
    """The device of the model's parameters (CPU for a parameter-free model)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")
