"""WikiText-103 zero-shot perplexity (paper Appendix E.1): the detokenizer, T_o, the sliding windows,
and zoo's numbers against transformers' own GPT-2 computed by brute force, one target at a time.

Tolerance: summed losses agree to 1e-5 relative (fp32 forwards, fp64 sums; every term is a positive
loss, so the sum carries the ~1e-7 relative rounding of one fp32 forward, whatever the CPU). The tiny random
GPT-2s are initialised with std 0.3 so per-token losses vary by nats with the context, and each
window test checks that a different context rule would fail it.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.checks import rel_err
from tests.helpers.tiny_hf_gpt2 import save_tiny_hf_gpt2
from tests.helpers.wikitext_samples import LONG_WIKITEXT, SHORT_WIKITEXT

REL_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_hf_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def zoo_model(hf_dir):
    from zoo.models import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from zoo.data import load_gpt2_tokenizer

    return load_gpt2_tokenizer()


def target_loss(hf_model, context: list[int], target: int) -> float:
    """-log p(target | context) from transformers' model on exactly this context."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([context]), logits_to_keep=1).logits[0, -1].double()
    return (torch.logsumexp(logits, -1) - logits[target]).item()


def brute_force_loss_sum(hf_model, ids: list[int], seq_length: int, overlap: int) -> float:
    """The window rule written as a loop over targets: a window of seq_length inputs starts at
    0, overlap, 2 overlap, ...; each target is scored by the first window that reaches it."""
    total, covered, start = 0.0, 0, 0          # covered = index of the last target predicted so far
    while covered < len(ids) - 1:
        last = min(start + seq_length, len(ids) - 1)
        for t in range(covered + 1, last + 1):
            total += target_loss(hf_model, ids[start:t], ids[t])
        covered, start = last, start + overlap
    return total


# --------------------------------------------------------------------------- detokenizer and T_o
@pytest.mark.parametrize("raw, clean", [
    (" = Robert Boulter = \n \n Robert Boulter is an English actor . \n",
     " = Robert Boulter =\n\nRobert Boulter is an English actor.\n"),
    (" = = Early life = = \n", " == Early life ==\n"),
    (" = = = 2000 – 2005 = = = \n", " === 2000 – 2005 ===\n"),
    ("The 2 @,@ 000 @-@ seat stadium ( built in 1 @.@ 5 years ) opened ; it was the club 's home . \n",
     "The 2,000-seat stadium (built in 1.5 years) opened; it was the club's home.\n"),
    ("Hello , world ! Is it ? Yes : no", "Hello, world! Is it? Yes: no"),
    ('He said " hello there " and left [ see below ] { x }', 'He said "hello there" and left [see below] {x}'),
    ("the players ' union met", "the players' union met"),
    ("it was 30 ° C and N people came", "it was 30°C and 1 people came"),
])
def test_detokenizer_removes_wikitext_artifacts(raw, clean):
    from zoo.eval import wikitext_detokenize

    assert wikitext_detokenize(raw) == clean


def test_original_token_count_of_a_hand_counted_file(tmp_path):
    from zoo.eval import count_original_tokens, read_wikitext

    path = tmp_path / "wiki.test.tokens"
    path.write_text(" \n"                                                            # <eos>: 1
                    " = Valkyria Chronicles = \n"                                   # = Valkyria Chronicles = <eos>: 5
                    " \n"                                                            # 1
                    " The game 's 1 @,@ 000 copies sold ( in Japan ) . \n"          # 13 + 1
                    " \n"                                                            # 1
                    " = = Plot = = \n")                                             # 5 + 1
    assert count_original_tokens(read_wikitext(path)) == 1 + 5 + 1 + 14 + 1 + 6
    # A last line without its newline still ends a line.
    assert count_original_tokens(" = = Plot = = \n The end . ") == 6 + 4


# --------------------------------------------------------------------------- windows
def test_windows_predict_every_target_once():
    from zoo.eval import plan_windows

    for num_tokens in (2, 5, 33, 34, 35, 100, 101):
        for seq_length, overlap in ((32, 8), (32, 32), (32, 1), (7, 3)):
            scored = []
            for w in plan_windows(num_tokens, seq_length, overlap):
                assert 1 <= w.length <= seq_length
                scored += range(w.start + 1 + w.first_scored, w.start + 1 + w.length)
            assert scored == list(range(1, num_tokens)), (num_tokens, seq_length, overlap)


# --------------------------------------------------------------------------- against transformers
def test_one_window_equals_full_context_brute_force(tmp_path, hf_model, zoo_model, tokenizer):
    from zoo.eval import evaluate_wikitext, read_wikitext, wikitext_detokenize

    path = tmp_path / "wiki.test.tokens"
    path.write_text(SHORT_WIKITEXT)
    raw = read_wikitext(path)
    ids = tokenizer(wikitext_detokenize(SHORT_WIKITEXT))["input_ids"]
    assert len(ids) <= 64 + 1, "the document must fit one window of the model's 64 positions"

    result = evaluate_wikitext(zoo_model, raw, tokenizer)                 # seq_length = n_positions = 64
    expected = sum(target_loss(hf_model, ids[:t], ids[t]) for t in range(1, len(ids)))
    assert result.num_windows == 1
    assert result.num_tokens == len(ids) and result.num_predicted == len(ids) - 1
    assert result.num_original_tokens == 4 + 12 + 4       # words of the heading and sentence, 4 line ends
    assert rel_err(result.loss_sum, expected) <= REL_TOL
    assert math.isclose(result.ppl, math.exp(expected / (len(ids) - 1)), rel_tol=1e-4)
    assert math.isclose(result.adjusted_ppl, math.exp(expected / (20 - 1)), rel_tol=1e-4)


@pytest.mark.parametrize("seq_length, overlap, batch_size", [(32, 8, 3), (32, 32, 2), (64, 32, 4)])
def test_sliding_windows_equal_brute_force_loop(hf_model, zoo_model, tokenizer, seq_length, overlap, batch_size):
    from zoo.eval import evaluate_wikitext, wikitext_detokenize

    ids = tokenizer(wikitext_detokenize(LONG_WIKITEXT))["input_ids"]
    assert len(ids) > 2 * seq_length
    result = evaluate_wikitext(zoo_model, LONG_WIKITEXT, tokenizer, seq_length=seq_length, overlap=overlap,
                               batch_size=batch_size)
    expected = brute_force_loss_sum(hf_model, ids, seq_length, overlap)
    assert result.num_tokens == len(ids)
    assert result.num_original_tokens == len(LONG_WIKITEXT.split()) + LONG_WIKITEXT.count("\n")
    assert rel_err(result.loss_sum, expected) <= REL_TOL
    # The test can fail: another context rule changes the sum by far more than the tolerance.
    other = brute_force_loss_sum(hf_model, ids, seq_length, seq_length if overlap != seq_length else 4)
    assert rel_err(other, expected) > 100 * REL_TOL


def test_saved_dataset_gives_the_file_result(tmp_path, zoo_model, tokenizer):
    import datasets

    from zoo.eval import evaluate_wikitext, read_wikitext

    path = tmp_path / "wiki.test.tokens"
    path.write_text(LONG_WIKITEXT)
    # wikitext-103-raw-v1 style: one row per line of the file, in a DatasetDict with a test split.
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": LONG_WIKITEXT.splitlines(keepends=True)})}
                         ).save_to_disk(str(tmp_path / "dict"))
    # datasets' text loader style: newline-stripped rows, a plain Dataset.
    datasets.Dataset.from_dict({"text": LONG_WIKITEXT.splitlines()}).save_to_disk(str(tmp_path / "plain"))

    assert read_wikitext(tmp_path / "dict") == read_wikitext(tmp_path / "plain") == read_wikitext(path)
    from_file = evaluate_wikitext(zoo_model, read_wikitext(path), tokenizer, seq_length=32, overlap=16)
    from_dataset = evaluate_wikitext(zoo_model, read_wikitext(tmp_path / "dict"), tokenizer, seq_length=32,
                                     overlap=16)
    assert from_dataset == from_file


# --------------------------------------------------------------------------- user errors
def _one_sentence(err) -> str:
    message = str(err.value)
    assert "\n" not in message and message.endswith("."), message
    return message


def test_missing_and_empty_files(tmp_path):
    from zoo.eval import read_wikitext

    with pytest.raises(FileNotFoundError, match="nowhere.tokens does not exist; pass --data") as err:
        read_wikitext(tmp_path / "nowhere.tokens")
    _one_sentence(err)
    (tmp_path / "empty.tokens").write_text(" \n \n")
    with pytest.raises(ValueError, match="empty.tokens holds no text") as err:
        read_wikitext(tmp_path / "empty.tokens")
    _one_sentence(err)
    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(FileNotFoundError, match="not a saved dataset") as err:
        read_wikitext(tmp_path / "not_a_dataset")
    _one_sentence(err)


def test_window_larger_than_the_model(zoo_model, tokenizer):
    from zoo.eval import evaluate_wikitext

    with pytest.raises(ValueError, match=r"sequence length 128 exceeds the model's n_positions 64; "
                                         r"pass --seq-length 64 or less") as err:
        evaluate_wikitext(zoo_model, LONG_WIKITEXT, tokenizer, seq_length=128)
    _one_sentence(err)
    with pytest.raises(ValueError, match=r"overlap 40 is outside 1..32") as err:
        evaluate_wikitext(zoo_model, LONG_WIKITEXT, tokenizer, seq_length=32, overlap=40)
    _one_sentence(err)


# --------------------------------------------------------------------------- the cost, said at start
def test_cost_line_names_windows_tokens_per_window_and_total(zoo_model, tokenizer, capsys):
    from zoo.eval import evaluate_wikitext, wikitext_detokenize

    num_tokens = len(tokenizer(wikitext_detokenize(LONG_WIKITEXT))["input_ids"])
    result = evaluate_wikitext(zoo_model, LONG_WIKITEXT, tokenizer, seq_length=32, overlap=8, progress=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wikitext:")]
    windows = 1 + math.ceil((num_tokens - 1 - 32) / 8)
    positions = 32 * (windows - 1) + min(32, num_tokens - 1 - 8 * (windows - 1))
    assert result.num_windows == windows
    assert lines == [f"wikitext: {windows:,} window(s) of up to 32 tokens (the first scores 32, the others their "
                     f"last 8): {num_tokens - 1:,} tokens scored, {positions:,} token positions run "
                     f"({positions / (num_tokens - 1):.1f} per scored token; a larger --overlap runs fewer windows "
                     "with less context)"]


def test_no_cost_line_off_the_writer(zoo_model, tokenizer, capsys):
    from zoo.eval import evaluate_wikitext

    evaluate_wikitext(zoo_model, LONG_WIKITEXT, tokenizer, seq_length=32, overlap=8, progress=False)
    assert "wikitext:" not in capsys.readouterr().out
