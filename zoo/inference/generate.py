"""Autoregressive generation with a GPT-2 model at any tensor-parallel degree.

One decoding step on a batch of b left-padded sequences:

    prefill  (step 0):  logits = model(prompt ids (b, L), mask, positions, use_cache) -> cache of L keys
    decode   (step t):  logits = model(last token (b, 1), mask (b, L + t), position, cache) -> cache + 1
    choose:             greedy: the arg-max over the vocabulary, taken across the TP shards without
                        gathering the logits (zoo.parallel.argmax.vocab_parallel_argmax);
                        sampling: the full-vocabulary logits of the last position are gathered (identical
                        on every TP rank), filtered (temperature, top-k, top-p) and sampled with the
                        sequence's own generator, seeded identically on every rank from (seed, index)
    sync:               TP rank 0's tokens are broadcast over the TP group and used by every rank, so the
                        ranks can never diverge; a rank whose own choice differed counts a disagreement
    stop:               a sequence finishes at an EOD token (``eod_token_id``: one id or several), at
                        ``max_new_tokens``, at ``max_length`` tokens with its prompt (transformers' max_length),
                        or when it fills the model's ``n_positions``; finished sequences are fed (and padded
                        with) the pad token

Left padding: prompt i of length n_i sits in the last n_i of L columns; the attention mask hides the
pads and positions count real tokens only (position = cumsum(mask) - 1), so each row computes what
it would alone. Because every sequence also has its own sampling stream, a prompt's tokens do not
depend on its batch, the batch size, or the DP layout. Without the cache (``use_cache=False``) each
step recomputes the whole (b, L + t) sequence instead; the tokens are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch
import torch.distributed as dist

from zoo.data.tokenizers import GPT2_EOD_TOKEN_ID
from zoo.distributed import dp_block
from zoo.errors import UserError
from zoo.inference.sampling import check_sampling_settings, filter_logits, sample
from zoo.models.outputs import cache_of
from zoo.parallel.argmax import vocab_parallel_argmax
from zoo.parallel.state import ParallelState, as_state

FINISH_EOD = "eod"            # produced the end-of-document token
FINISH_LENGTH = "length"      # reached max_new_tokens (or max_length, prompt included)
FINISH_CONTEXT = "context"    # filled the model's n_positions


def is_token_id(value) -> bool:
    """An integer >= 0 that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, Integral) and value >= 0


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. ``greedy`` (or ``temperature`` 0) takes the arg-max; otherwise tokens are sampled
    after temperature, top-k (0 = off) and top-p (1 = off).

    A sequence stops at ``max_new_tokens`` new tokens, at ``max_length`` tokens counting its prompt (None:
    no such limit; transformers' ``max_length``), and at any of the ``eod_token_id`` (one id, a tuple of
    ids, or None to never stop early). ``pad_token_id`` fills the left of short prompts and follows a
    finished sequence (None: the first EOD id); it never reaches the completions."""

    max_new_tokens: int = 32
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eod_token_id: int | tuple[int, ...] | None = GPT2_EOD_TOKEN_ID
    use_cache: bool = True
    max_length: int | None = None
    pad_token_id: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def eod_ids(self) -> tuple[int, ...]:
        """Every token id that ends a sequence (none when ``eod_token_id`` is None)."""
        if self.eod_token_id is None:
            return ()
        return tuple(self.eod_token_id) if isinstance(self.eod_token_id, tuple) else (self.eod_token_id,)

    def start_id(self, vocab_size: int) -> int:
        """The prompt of an empty text (unconditional generation): the first EOD id if the model has it, else 0."""
        return next((t for t in self.eod_ids if t < vocab_size), 0)

    def padding_id(self, vocab_size: int) -> int:
        """Fed to (and filling) finished sequences and left of short prompts: ``pad_token_id``, else
        :meth:`start_id`."""
        return self.pad_token_id if self.pad_token_id is not None else self.start_id(vocab_size)

    def validate(self) -> GenerationConfig:
        """Refuse impossible settings with one sentence naming the value and the fix."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, Integral) \
                or self.max_new_tokens < 1:
            raise UserError(f"max new tokens {self.max_new_tokens!r} must be a positive integer.")
        if self.max_length is not None and (isinstance(self.max_length, bool)
                                            or not isinstance(self.max_length, Integral) or self.max_length < 2):
            raise UserError(f"max length {self.max_length!r} must be an integer of at least 2 (the prompt's tokens "
                             "and at least one new one), or None for no limit beyond max new tokens.")
        check_sampling_settings(self.temperature, self.top_k, self.top_p, allow_zero_temperature=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, Integral):
            raise UserError(f"seed {self.seed!r} must be an integer.")
        eod = self.eod_token_id
        if eod is not None and not (is_token_id(eod) or isinstance(eod, tuple) and eod
                                    and all(is_token_id(t) for t in eod)):
            raise UserError(f"eod token id {eod!r} must be a token id (an integer >= 0), a non-empty tuple of "
                             "them, or None to never stop early.")
        if self.pad_token_id is not None and not is_token_id(self.pad_token_id):
            raise UserError(f"pad token id {self.pad_token_id!r} must be a token id (an integer >= 0), or None to "
                             "pad with the EOD token.")
        return self


@dataclass
class Completion:
    """The new tokens of one prompt; the last one is the EOD token when ``finish_reason`` is "eod".

    ``rank_disagreements`` counts the steps at which this rank's own choice differed from TP rank 0's
    (which every rank used): always 0 unless the ranks' logits or sampling streams diverged.
    """

    tokens: list[int]
    finish_reason: str
    rank_disagreements: int = field(default=0, compare=False)


def sequence_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s sampling stream: a function of (seed, index) only."""
    return (seed * 1_000_003 + index) % (2 ** 63)


def validate_prompts(prompts: Sequence[Sequence[int]], n_positions: int, vocab_size: int,
                     max_length: int | None = None) -> None:
    """One sentence naming the first prompt that is empty, too long (for the model's ``n_positions`` or for
    ``max_length``) or outside the vocabulary."""
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise UserError(f"prompt {index} has no tokens; give at least one (e.g. the EOD token).")
        if len(prompt) >= n_positions:
            raise UserError(f"prompt {index} has {len(prompt)} tokens, which leaves no room for a new token in "
                             f"the model's n_positions={n_positions}; shorten it to at most {n_positions - 1} tokens.")
        if max_length is not None and len(prompt) >= max_length:
            raise UserError(f"prompt {index} has {len(prompt)} tokens, which leaves no room for a new token under "
                             f"max_length={max_length} (prompt included); shorten it to at most {max_length - 1} "
                             "tokens, or limit the new tokens with max_new_tokens instead.")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt {index} holds token id {bad[0]}, outside the model's vocabulary of {vocab_size}; "
                             "encode it with the tokenizer the model was trained with.")


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, keep-mask), both (b, L): prompt i in the last n_i columns, pads (mask False) before it."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)     # (b, L)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)                   # (b, L)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long, device=device)
        mask[row, width - len(prompt):] = True
    return ids, mask


def sync_across_tp(tokens: torch.Tensor, parallel: ParallelState | None) -> tuple[torch.Tensor, torch.Tensor]:
    """TP rank 0's tokens (b,), broadcast over the TP group, and where this rank's own ``tokens`` differed."""
    parallel = as_state(parallel)
    if parallel.tp_size == 1:
        return tokens, torch.zeros_like(tokens, dtype=torch.bool)
    chosen = tokens.clone()
    dist.broadcast(chosen, src=dist.get_global_rank(parallel.tp_group, 0), group=parallel.tp_group)
    return chosen, chosen != tokens


def _next_tokens(logits: torch.Tensor, config: GenerationConfig, generators: list[torch.Generator],
                 parallel: ParallelState | None, vocab_size: int) -> torch.Tensor:
    """Each row's next token from the last position's logits: local shard (greedy) or full vocab (sampling)."""
    if config.is_greedy:
        return vocab_parallel_argmax(logits, parallel, vocab_size)                          # (b,)
    filtered = filter_logits(logits, config.temperature, config.top_k, config.top_p)        # (b, V)
    return sample(filtered, generators)                                                     # (b,)


@torch.no_grad()
def generate_batch(model, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                   parallel: ParallelState | None = None, indices: Sequence[int] | None = None) -> list[Completion]:
    """Decode one left-padded batch; ``indices`` (default 0..b-1) seed each prompt's sampling stream.

    Collective over the TP group when tp > 1: every TP rank calls it with the same prompts.
    """
    config.validate()
    n_positions, vocab_size = model.config.n_positions, model.config.vocab_size
    device = next(model.parameters()).device
    indices = list(range(len(prompts))) if indices is None else list(indices)
    generators = [] if config.is_greedy else [
        torch.Generator(device=device).manual_seed(sequence_seed(config.seed, i)) for i in indices]
    pad = config.padding_id(vocab_size)
    if pad >= vocab_size:
        raise UserError(f"pad token id {pad} is outside the model's vocabulary of {vocab_size}; pad with a token "
                         "id below it (or None: the EOD token).")
    eod_ids = torch.as_tensor(config.eod_ids, dtype=torch.long, device=device)     # (n_eod,)
    # A sequence holds at most `limit` tokens, prompt included: max_length ("length"), else n_positions ("context").
    by_length = config.max_length is not None and config.max_length <= n_positions
    limit = config.max_length if by_length else n_positions
    ids, mask = left_pad(prompts, pad, device)                                  # (b, L)
    lengths = torch.as_tensor([len(p) for p in prompts], device=device)         # (b,)
    b = len(prompts)
    new = torch.full((b, config.max_new_tokens), pad, dtype=torch.long, device=device)   # (b, max_new)
    count = torch.full((b,), config.max_new_tokens, dtype=torch.long, device=device)    # tokens kept per row
    reason = torch.zeros(b, dtype=torch.long, device=device)                    # 0 length, 1 eod, 2 context
    done = torch.zeros(b, dtype=torch.bool, device=device)
    disagreements = torch.zeros(b, dtype=torch.long, device=device)
    padded = not bool(mask.all())     # without pads no mask is needed: SDPA's causal fast path (prefill)
    past = None
    for step in range(config.max_new_tokens):
        positions = (mask.long().cumsum(-1) - 1).clamp(0, n_positions - 1)     # (b, L + step)
        if config.use_cache:
            fresh = slice(None) if past is None else slice(-1, None)           # prefill, then the last token
            out = model(ids[:, fresh], attention_mask=mask if padded else None, position_ids=positions[:, fresh],
                        past_key_values=past, use_cache=True, logits_to_keep=1, gather_output=not config.is_greedy)
            past = cache_of(out)
        else:
            # Active rows hold at most n_positions real tokens, so the columns cut here are pads for them.
            window = slice(-n_positions, None)
            out = model(ids[:, window], attention_mask=mask[:, window] if padded else None,
                        position_ids=positions[:, window], logits_to_keep=1, gather_output=not config.is_greedy)
        chosen = _next_tokens(out.logits[:, -1], config, generators, parallel, vocab_size)   # (b,)
        chosen, differs = sync_across_tp(chosen, parallel)
        disagreements += differs & ~done
        chosen = chosen.masked_fill(done, pad)                                  # finished rows: padding
        new[:, step] = chosen
        ids = torch.cat((ids, chosen[:, None]), dim=1)                          # (b, L + step + 1)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)           # (b, L + step + 1)
        eod = ~done & torch.isin(chosen, eod_ids)
        full = ~done & ~eod & (lengths + step + 1 >= limit)
        reason = reason.masked_fill(eod, 1).masked_fill(full, 0 if by_length else 2)
        count = count.masked_fill(eod | full, step + 1)
        done = done | eod | full
        if bool(done.all()):
            break
    names = (FINISH_LENGTH, FINISH_EOD, FINISH_CONTEXT)
    return [Completion(tokens=new[row, :int(count[row])].tolist(), finish_reason=names[int(reason[row])],
                       rank_disagreements=int(disagreements[row])) for row in range(b)]


def generate(model, prompts: Sequence[Sequence[int]], config: GenerationConfig,
             parallel: ParallelState | None = None, batch_size: int = 8, first_index: int = 0) -> list[Completion]:
    """Complete token-id prompts in left-padded batches of ``batch_size``; prompt j's sampling stream is
    seeded by (config.seed, first_index + j). Collective over the TP group; the model is put in eval
    mode for the call (dropout would make no sense here) and restored afterwards."""
    config.validate()
    if batch_size < 1:
        raise UserError(f"batch size {batch_size} must be a positive integer.")
    validate_prompts(prompts, model.config.n_positions, model.config.vocab_size, config.max_length)
    was_training = model.training
    model.eval()
    try:
        completions = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            indices = range(first_index + start, first_index + start + len(chunk))
            completions.extend(generate_batch(model, chunk, config, parallel, indices))
        return completions
    finally:
        model.train(was_training)


@dataclass
class TextCompletion:
    """One prompt's result in text: ``completion`` is the decoded new tokens without the final EOD."""

    prompt: str
    completion: str
    tokens: list[int]
    finish_reason: str

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "completion": self.completion, "tokens": self.tokens,
                "finish_reason": self.finish_reason}


def encode_prompts(tokenizer, texts: Sequence[str], eod_token_id: int = GPT2_EOD_TOKEN_ID) -> list[list[int]]:
    """Token ids of each text; an empty text becomes the lone EOD token (unconditional generation)."""
    return [tokenizer.encode(text) or [eod_token_id] for text in texts]


def generate_text(model, tokenizer, texts: Sequence[str], config: GenerationConfig,
                  parallel: ParallelState | None = None, batch_size: int = 8) -> list[TextCompletion]:
    """Text in, text out on the tp x dp grid: each DP rank completes its contiguous block of the
    prompts (its TP group decoding together) and the blocks are all-gathered over the DP group, so
    every rank returns all results, in prompt order. Collective over the whole world."""
    parallel = as_state(parallel)
    prompts = encode_prompts(tokenizer, texts, config.start_id(model.config.vocab_size))
    validate_prompts(prompts, model.config.n_positions, model.config.vocab_size,  # on every rank, before any work
                     config.max_length)
    block = dp_block(len(prompts), parallel)
    completions = generate(model, prompts[block.start:block.stop], config, parallel, batch_size,
                           first_index=block.start)
    if parallel.dp_size > 1:
        blocks = [None] * parallel.dp_size
        dist.all_gather_object(blocks, completions, group=parallel.dp_group)
        completions = [c for part in blocks for c in part]
    results = []
    for text, done in zip(texts, completions):
        body = done.tokens[:-1] if done.finish_reason == FINISH_EOD else done.tokens
        results.append(TextCompletion(prompt=text, completion=tokenizer.decode(body), tokens=done.tokens,
                                      finish_reason=done.finish_reason))
    return results
