"""A model directory's ``generation_config.json`` (transformers' ``GenerationConfig``) as defaults of zoo's generator.

transformers' ``generate`` takes its defaults from this file; launch/generate.py does the same for the settings
zoo's generator has, and its flags override them. The file is read by ``transformers.GenerationConfig``, which
validates it, and zoo checks each value it applies. A key the file states applies; a key it does not state keeps
zoo's default (sampling, top_k 0, 32 new tokens, EOD 50256), not transformers' (greedy, top_k 50, max_length 20):

    do_sample       -> greedy = not do_sample
    temperature, top_k, top_p, max_new_tokens, use_cache, pad_token_id -> the field of the same name
    max_length      -> max_length (tokens with the prompt); applies only where max_new_tokens is not set, as in
                       transformers, where max_new_tokens wins
    eos_token_id    -> eod_token_id (one id or a list of them)

A key stated as null is unset, as transformers treats None. Keys that change nothing zoo's generator produces
(:data:`IGNORED`: bos_token_id, output and cache-implementation options, beam-only options, which need
num_beams > 1) and keys transformers does not know are ignored, as transformers ignores them. Any other key with a
value other than transformers' default asks for decoding zoo's generator does not do (num_beams 4,
repetition_penalty 1.2, ...), and the file is refused; so is a file that is no JSON object, one transformers
refuses, and a value zoo cannot apply: one sentence naming the file, the key, the value and the fix.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.errors import UserError
from zoo.inference.generate import GenerationConfig

GENERATION_CONFIG_FILE = "generation_config.json"
IGNORE_FIX = "or ignore the file with --no-generation-config"

# The keys applied: file key -> (zoo GenerationConfig field, what the value must be).
APPLIED: dict[str, tuple[str, str]] = {
    "do_sample": ("greedy", "true or false"),
    "temperature": ("temperature", "a finite number, 0 (greedy decoding) or more, such as 0.7"),
    "top_k": ("top_k", "an integer >= 0 (0 disables it), such as 50"),
    "top_p": ("top_p", "a number in (0, 1] (1 disables it), such as 0.9"),
    "max_new_tokens": ("max_new_tokens", "a positive integer"),
    "max_length": ("max_length", "an integer of at least 2 (the prompt's tokens and at least one new one)"),
    "eos_token_id": ("eod_token_id", "a token id (an integer >= 0) or a non-empty list of them"),
    "pad_token_id": ("pad_token_id", "a token id (an integer >= 0)"),
    "use_cache": ("use_cache", "true or false"),
}

# Keys that change nothing zoo's generator produces: bookkeeping, special tokens it does not use (bos: a prompt is
# never empty of tokens here; decoder_start: encoder-decoder models), what generate returns besides the tokens,
# the cache's implementation and compilation, assisted decoding's knobs (which need an assistant model), and
# beam-only options (num_beams > 1 is refused).
IGNORED = frozenset({
    "transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash",
    "bos_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
    "return_legacy_cache",
    "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "prefill_chunk_size", "low_memory", "continuous_batching_config",
    "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind",
    "length_penalty", "early_stopping",
})

# What a refused key asks for, in "zoo's generator has no ..." (others: "such setting").
UNSUPPORTED_WHAT = {
    "num_beams": "beam search", "num_beam_groups": "beam search", "diversity_penalty": "beam search",
    "constraints": "constrained beam search", "force_words_ids": "constrained beam search",
    "penalty_alpha": "contrastive search", "dola_layers": "DoLa decoding",
    "repetition_penalty": "repetition penalty", "encoder_repetition_penalty": "repetition penalty",
    "no_repeat_ngram_size": "n-gram blocking", "encoder_no_repeat_ngram_size": "n-gram blocking",
    "num_return_sequences": "several completions per prompt", "min_length": "minimum length",
    "min_new_tokens": "minimum length", "typical_p": "typical sampling", "min_p": "min-p sampling",
    "epsilon_cutoff": "epsilon sampling", "eta_cutoff": "eta sampling", "bad_words_ids": "banned words",
    "suppress_tokens": "token suppression", "begin_suppress_tokens": "token suppression",
    "sequence_bias": "sequence bias", "stop_strings": "stop strings", "max_time": "time limit",
    "forced_bos_token_id": "forced tokens", "forced_eos_token_id": "forced tokens",
    "guidance_scale": "classifier-free guidance", "watermarking_config": "watermarking",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The settings a ``generation_config.json`` states that zoo applies: file key -> value (lists as tuples)."""

    path: Path
    stated: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        """The same settings as zoo GenerationConfig fields (do_sample becomes ``greedy``; max_length is
        dropped where max_new_tokens is set, as transformers lets max_new_tokens win)."""
        out = {}
        for key, value in self.stated.items():
            if key == "max_length" and "max_new_tokens" in self.stated:
                continue
            out[APPLIED[key][0]] = (not value) if key == "do_sample" else value
        return out


def read_generation_defaults(directory: str | Path) -> GenerationDefaults | None:
    """The applied settings of ``directory``'s generation_config.json; None when it has none (one sentence
    for a file zoo cannot apply: see the module docstring)."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); correct "
                         f"it, {IGNORE_FIX}.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read as UTF-8 text ({err}); make it readable, {IGNORE_FIX}.") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a JSON {type(raw).__name__}, not an object of generation settings such as "
                         f'{{"do_sample": true, "temperature": 0.7}}; correct it, {IGNORE_FIX}.')
    stated = {key: value for key, value in raw.items() if key in APPLIED and value is not None}
    for key, value in stated.items():
        check_applied(path, key, value)
    library_config(path)
    check_supported(path, raw)
    return GenerationDefaults(path, {key: tuple(value) if isinstance(value, list) else value
                                     for key, value in stated.items()})


def check_applied(path: Path, key: str, value: Any) -> None:
    """One sentence for a value of an applied key that zoo's generator cannot run with."""
    field, requirement = APPLIED[key]
    if key in ("do_sample", "use_cache"):
        ok = isinstance(value, bool)
    else:
        value_as_field = tuple(value) if key == "eos_token_id" and isinstance(value, list) else value
        try:
            GenerationConfig(**{field: value_as_field}).validate()
            ok = True
        except UserError:
            ok = False
    if not ok:
        raise UserError(f"{path} sets {key} to {json.dumps(value)}, but it must be {requirement}; correct it in the "
                         f"file, {IGNORE_FIX}.")


def library_config(path: Path):
    """``transformers.GenerationConfig.from_pretrained`` of the file's directory: transformers' own checks, one
    sentence for what it refuses. Its warnings about flags that "may be ignored" (e.g. a temperature without
    do_sample) are silenced: which settings apply here is zoo's to say (the command prints them)."""
    import transformers  # local: transformers' import cost, only where a file is read

    library_logger = logging.getLogger("transformers.generation.configuration_utils")
    level = library_logger.level
    library_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():   # transformers 4 says the same through warnings.warn
            warnings.simplefilter("ignore", UserWarning)
            return transformers.GenerationConfig.from_pretrained(path.parent)
    except (OSError, ValueError, TypeError, AttributeError) as err:
        detail = re.sub(r"\s+", " ", str(err)).strip().rstrip(".")
        raise UserError(f"{path} is refused by transformers' GenerationConfig ({detail}); correct it, "
                         f"{IGNORE_FIX}.") from None
    finally:
        library_logger.setLevel(level)


def transformers_default(key: str) -> Any:
    """transformers' default of generation setting ``key``: a fresh GenerationConfig's value, else (transformers 5,
    where unset attributes are None) the default ``generate`` applies."""
    import transformers  # local: transformers' import cost, only where a file is read

    value = getattr(transformers.GenerationConfig(), key, None)
    if value is None:
        defaults = getattr(transformers.GenerationConfig, "_get_default_generation_params", dict)()
        value = defaults.get(key)
    return value


def is_default(value: Any, default: Any) -> bool:
    """Whether a stated value asks for nothing beyond transformers' default (False, [] and {} count as unset)."""
    if value is None or value is False or value == [] or value == {}:
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    number = (int, float)
    return value == default and (type(value) is type(default) or isinstance(value, number)
                                 and isinstance(default, number))


def check_supported(path: Path, raw: dict[str, Any]) -> None:
    """One sentence for the first key of transformers' generation settings that is neither applied nor ignored
    and holds a value other than its default."""
    import transformers  # local: transformers' import cost, only where a file is read

    blank = transformers.GenerationConfig()
    defaults = getattr(transformers.GenerationConfig, "_get_default_generation_params", dict)()
    applied = ", ".join(APPLIED)
    for key, value in raw.items():
        if key in APPLIED or key in IGNORED or not (hasattr(blank, key) or key in defaults):
            continue   # applied, changes nothing here, or unknown to transformers (which ignores it too)
        default = transformers_default(key)
        if is_default(value, default):
            continue
        what = UNSUPPORTED_WHAT.get(key, "such setting")
        reset = "" if default is None else f" or set it to {json.dumps(default)}"
        raise UserError(f"{path} sets {key} to {json.dumps(value)}, but zoo's generator has no {what} (it applies "
                         f"only {applied}); remove {key} from the file{reset}, {IGNORE_FIX}.")
