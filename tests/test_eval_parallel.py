"""Zero-shot evaluation on the tp x dp grid: tp=2 (world 2) and dp=2 (world 2) give one process's
numbers, and the vocab-parallel arg-max equals torch.argmax over the full, unpadded vocabulary.

Tolerance: summed WikiText losses agree to 1e-5 relative (the TP all-reduces and DP split change
the fp32 summation order; the losses are positive, so the sum's relative rounding is that of its terms,
~1e-7); token and passage counts and LAMBADA accuracy agree exactly, which is rounding-proof because the
passages decide every prediction by at least 1e-4 of max|logits| (asserted in ``files``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lambada_reference import DECISION_MARGIN, greedy_passages, reference_margin, write_jsonl
from tests.helpers.tiny_hf_gpt2 import save_tiny_hf_gpt2
from tests.helpers.wikitext_samples import LONG_WIKITEXT
from tests.spawn import spawn

REL_TOL = 1e-5
SEQ_LENGTH, OVERLAP = 24, 8       # 19 windows over LONG_WIKITEXT: an odd count splits unevenly over dp=2
NUM_PASSAGES = 7                  # odd, for the same reason


def evaluate_all(model, raw_text, texts, tokenizer, ps) -> dict:
    from zoo.eval import evaluate_lambada, evaluate_wikitext

    return {
        "wikitext": evaluate_wikitext(model, raw_text, tokenizer, seq_length=SEQ_LENGTH, overlap=OVERLAP,
                                      parallel=ps, batch_size=2).to_dict(),
        "strict": evaluate_lambada(model, texts, tokenizer, strict=True, parallel=ps, batch_size=2).to_dict(),
        "loose": evaluate_lambada(model, texts, tokenizer, strict=False, parallel=ps, batch_size=2).to_dict(),
    }


def _grid_worker(rank, world_size, hf_dir, wiki_path, lambada_path):
    from zoo.data import load_gpt2_tokenizer
    from zoo.eval import read_lambada, read_wikitext
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import ParallelState, pad_vocab_size
    from zoo.parallel.argmax import vocab_parallel_argmax

    tokenizer = load_gpt2_tokenizer()
    raw_text, texts = read_wikitext(wiki_path), read_lambada(lambada_path)
    results = {}
    for name, tp in (("tp2", 2), ("dp2", 1)):
        ps = ParallelState.initialize(tp)
        model = GPT2LMHeadModel.from_pretrained(hf_dir, parallel=ps).eval()
        results[name] = evaluate_all(model, raw_text, texts, tokenizer, ps)

    # The arg-max on its own at tp=2: padding columns hold the largest values and must never win,
    # and a tie across the two shards goes to the lower index, as torch.argmax does.
    ps = ParallelState.initialize(2)
    vocab = 1000
    padded = pad_vocab_size(vocab, 2)                                # 1024: 24 padding columns
    full = torch.randn(6, padded, generator=torch.Generator().manual_seed(5))
    full[:, vocab:] = 100.0
    full[0, 3] = full[0, 700] = 50.0                                         # tie across shards
    shard = full.chunk(2, dim=-1)[ps.tp_rank]
    results["argmax"] = (vocab_parallel_argmax(shard, ps, vocab).tolist(), full[:, :vocab].argmax(-1).tolist())
    return results


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import transformers

    from zoo.data import load_gpt2_tokenizer

    root = tmp_path_factory.mktemp("eval_grid")
    hf_dir = save_tiny_hf_gpt2(root / "model", seed=3)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    texts = greedy_passages(hf_model, load_gpt2_tokenizer())[:NUM_PASSAGES]
    for strict in (True, False):
        assert reference_margin(hf_model, load_gpt2_tokenizer(), texts, strict) >= DECISION_MARGIN, "a near-tie"
    (root / "wiki.test.tokens").write_text(LONG_WIKITEXT)
    return hf_dir, str(root / "wiki.test.tokens"), str(write_jsonl(root / "lambada_test.jsonl", texts))


def test_tp2_and_dp2_equal_one_process(files):
    from zoo.data import load_gpt2_tokenizer
    from zoo.eval import read_lambada, read_wikitext
    from zoo.models import GPT2LMHeadModel

    hf_dir, wiki_path, lambada_path = files
    single = evaluate_all(GPT2LMHeadModel.from_pretrained(hf_dir).eval(), read_wikitext(wiki_path),
                          read_lambada(lambada_path), load_gpt2_tokenizer(), ps=None)
    assert single["wikitext"]["num_windows"] == 19 and single["strict"]["total"] == NUM_PASSAGES
    assert 0 < single["strict"]["correct"] < NUM_PASSAGES

    per_rank = spawn(_grid_worker, 2, hf_dir, wiki_path, lambada_path)
    for rank, results in enumerate(per_rank):
        predicted, expected = results["argmax"]
        assert predicted == expected and expected[0] == 3
        for grid in ("tp2", "dp2"):
            got, want = results[grid], single
            for key in ("loss_sum", "loss", "ppl", "adjusted_ppl"):
                assert got["wikitext"][key] == pytest.approx(want["wikitext"][key], rel=REL_TOL), (rank, grid, key)
            for key in ("num_tokens", "num_original_tokens", "num_predicted", "num_windows"):
                assert got["wikitext"][key] == want["wikitext"][key], (rank, grid, key)
            assert got["strict"] == want["strict"] and got["loose"] == want["loose"], (rank, grid)
