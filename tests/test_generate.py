"""Generation: greedy equals transformers' ``generate`` at tp = 1 and 2, the KV cache changes nothing,
sampled tokens are identical on every TP rank and reproducible from the seed, the sampling filters,
EOD (one id or several), max_length and context stopping, and the launch/generate.py CLI, which takes its
defaults from the model directory's generation_config.json under the flags given.

Tolerance: cached vs full-recompute logits max|a - b| / max|b| <= 1e-5 (fp32); token ids exactly equal.
Exact greedy ids are rounding-proof because the reference's every step picks its token by a margin of
at least 1e-4 of max|logits| (asserted on the data), 10x the logits' tolerance.
All tp = 2 checks share one spawn (imports dominate its cost).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checks import decision_margin, rel_err
from tests.spawn import spawn
from zoo.models.outputs import cache_of

REPO = Path(__file__).resolve().parent.parent
REL_TOL = 1e-5
GREEDY_MARGIN = 10 * REL_TOL   # top-1 minus top-2 logit at every greedy step, relative to max|logits|
VOCAB = 1000            # not a multiple of 128: padded vocab shards at tp = 2
EOD = VOCAB - 1
N_POSITIONS = 48
NEW = 12
PROMPTS = [[5, 17, 300, 42, 7, 11, 600], [9, 8, 123]]      # different lengths: left padding


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny random transformers GPT-2 whose weights are large enough (std 0.3) for varied greedy tokens."""
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=N_POSITIONS, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=EOD, eos_token_id=EOD)
    torch.manual_seed(1234)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3 if param.dim() > 1 else 0.1)
    path = tmp_path_factory.mktemp("gen_gpt2")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_greedy(gpt2_dir):
    """transformers' greedy continuation of each prompt, generated alone (no padding); every step's
    choice must be clear of a near-tie (else fp32 rounding could pick the other token on some CPU)."""
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                   pad_token_id=EOD, eos_token_id=EOD, output_logits=True,
                                   return_dict_in_generate=True)
        margin = decision_margin(torch.cat(generated.logits))
        assert margin >= GREEDY_MARGIN, f"the reference's greedy steps nearly tie ({margin:.1e}): change the model seed"
        out.append(generated.sequences[0, len(prompt):].tolist())
    return out


# ---------------------------------------------------------------------------- model-level checks
def _cache_logits_errors(model, parallel) -> dict[str, float]:
    """Logits of a left-padded batch computed in pieces through the cache (prefill 4, a 3-token chunk
    after the cache -- the offset causal mask --, then single tokens) vs one full forward; and the same
    without any mask (one row, positions implied by the cache length)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 10), generator=gen)                   # (b, T)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False                                                     # row 1: three left pads
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    errors = {}
    for name, (m, pos, rows) in {"padded": (mask, positions, slice(None)), "unmasked": (None, None, slice(0, 1))}.items():
        x = ids[rows]
        full = model(x, attention_mask=m, position_ids=pos, gather_output=True).logits   # (b, T, V)
        pieces, past = [], None
        for lo, hi in ((0, 4), (4, 7), (7, 8), (8, 9), (9, 10)):
            out = model(x[:, lo:hi], attention_mask=None if m is None else m[:, :hi],
                        position_ids=None if pos is None else pos[:, lo:hi], past_key_values=past,
                        use_cache=True, gather_output=True)
            past = cache_of(out)
            pieces.append(out.logits)
        cached = torch.cat(pieces, dim=1)                                  # (b, T, V)
        real = torch.ones_like(x, dtype=torch.bool) if m is None else m    # pad queries are not compared
        errors[name] = rel_err(cached[real], full[real])
        assert past[0][0].shape == (x.shape[0], 4 // parallel.tp_size, 10, 16)   # (b, heads_local, s, d)
    return errors


class _IdTokenizer:
    """Text is space-separated token ids (the test model's vocabulary has no BPE)."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(t) for t in ids)


def _dp_texts(world_size, directory):
    """generate_text at tp = 1 x dp = world_size: each DP rank decodes its block, every rank gets all."""
    from zoo.inference import GenerationConfig, generate_text
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(1)
    model = GPT2LMHeadModel.from_pretrained(directory, parallel=ps).eval()
    texts = [" ".join(map(str, PROMPTS[i % 2])) for i in range(3)]
    greedy = GenerationConfig(max_new_tokens=NEW, greedy=True, eod_token_id=EOD)
    return [(r.prompt, r.tokens) for r in generate_text(model, _IdTokenizer(), texts, greedy, ps, batch_size=2)]


def _generation_worker(rank, world_size, directory):
    from zoo.inference import GenerationConfig, generate
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(world_size)
    model = GPT2LMHeadModel.from_pretrained(directory, parallel=ps).eval()

    def run(config, prompts=PROMPTS, **kwargs):
        return [c.tokens for c in generate(model, prompts, config, ps, **kwargs)]

    greedy = GenerationConfig(max_new_tokens=NEW, greedy=True, eod_token_id=EOD)
    sampled = GenerationConfig(max_new_tokens=NEW, temperature=0.7, top_k=20, top_p=0.9, seed=11, eod_token_id=EOD)
    with torch.no_grad():
        logits_errors = _cache_logits_errors(model, ps)
    completions = generate(model, PROMPTS, sampled, ps)
    return {
        "logits_errors": logits_errors,
        "greedy_batched": run(greedy),
        "greedy_alone": [run(greedy, [p])[0] for p in PROMPTS],
        "greedy_no_cache": run(dataclasses.replace(greedy, use_cache=False)),
        "greedy_batch_of_one": run(greedy, batch_size=1),
        "sampled": [c.tokens for c in completions],
        "disagreements": sum(c.rank_disagreements for c in completions),
        "sampled_again": run(sampled),
        "sampled_no_cache": run(dataclasses.replace(sampled, use_cache=False)),
        "sampled_alone": [run(sampled, [p], first_index=i)[0] for i, p in enumerate(PROMPTS)],
        "sampled_other_seed": run(dataclasses.replace(sampled, seed=12)),
        "dp_texts": _dp_texts(world_size, directory),
    }


@pytest.fixture(scope="module")
def results(gpt2_dir):
    """world size -> the worker's results on every rank: 1 in this process, 2 in one spawn."""
    return {1: [_generation_worker(0, 1, gpt2_dir)], 2: spawn(_generation_worker, 2, gpt2_dir)}


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers_generate(results, hf_greedy, tp):
    """Batched (left-padded), alone, batch size 1 and without the cache: all equal transformers' ids."""
    assert any(len(set(tokens)) > 3 for tokens in hf_greedy), "the reference is degenerate"
    for rank, res in enumerate(results[tp]):
        for key in ("greedy_batched", "greedy_alone", "greedy_no_cache", "greedy_batch_of_one"):
            assert res[key] == hf_greedy, f"{key} at tp={tp} rank {rank}: {res[key]} != {hf_greedy}"


@pytest.mark.parametrize("dp", [1, 2])
def test_text_generation_over_data_parallel_ranks(results, hf_greedy, dp):
    """generate_text at tp = 1: prompts split over the DP ranks, all results gathered on every rank."""
    expected = [(" ".join(map(str, PROMPTS[i % 2])), hf_greedy[i % 2]) for i in range(3)]
    for rank, res in enumerate(results[dp]):
        assert res["dp_texts"] == expected, f"dp={dp} rank {rank}"


@pytest.mark.parametrize("tp", [1, 2])
def test_cached_logits_equal_full_recompute(results, tp):
    for rank, res in enumerate(results[tp]):
        for name, err in res["logits_errors"].items():
            assert err <= REL_TOL, f"{name}: cached vs full logits {err:.3e} at tp={tp} rank {rank}"


def test_sampling_identical_across_tp_ranks_and_reproducible(results):
    tp2 = results[2]
    assert tp2[0]["sampled"] == tp2[1]["sampled"], "TP ranks sampled different tokens"
    assert all(res["disagreements"] == 0 for res in tp2), "a rank's own draw differed from TP rank 0's"
    for res in results[1] + tp2:
        assert res["sampled_again"] == res["sampled"], "the same seed gave different tokens"
        assert res["sampled_no_cache"] == res["sampled"], "the KV cache changed the sampled tokens"
        assert res["sampled_alone"] == res["sampled"], "a prompt's tokens depend on its batch"
        assert res["sampled_other_seed"] != res["sampled"], "the seed has no effect"
    # One sampling stream per (seed, prompt): tp = 1 and tp = 2 draw the same tokens from the same seed.
    assert tp2[0]["sampled"] == results[1][0]["sampled"]


# ---------------------------------------------------------------------------- sampling filters
def test_temperature():
    from zoo.inference import apply_temperature

    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(apply_temperature(logits, 0.5), torch.tensor([[2.0, 4.0, 6.0]]))
    assert apply_temperature(logits, 1.0) is logits
    sharp, flat = (torch.softmax(apply_temperature(logits, t), -1)[0, -1] for t in (0.5, 2.0))
    assert sharp > torch.softmax(logits, -1)[0, -1] > flat
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, 0.0)


def test_top_k_keeps_k():
    from zoo.inference import top_k_filter

    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, 2.0, 2.0, 1.0]])
    kept = torch.isfinite(top_k_filter(logits, 2))
    assert kept.tolist() == [[False, True, False, True, False], [False, False, True, True, False]]
    assert torch.equal(top_k_filter(logits, 2)[kept], logits[kept])                 # kept values untouched
    assert torch.isfinite(top_k_filter(torch.tensor([[3.0, 1.0, 3.0]]), 1)).tolist() == [[True, False, True]]  # ties
    assert top_k_filter(logits, 0) is logits and top_k_filter(logits, 5) is logits
    with pytest.raises(ValueError, match="top-k"):
        top_k_filter(logits, -1)


def test_top_p_keeps_smallest_set_with_mass_p():
    from zoo.inference import top_p_filter

    probs = torch.tensor([0.1, 0.5, 0.05, 0.2, 0.15])        # sorted: 0.5, 0.2, 0.15, 0.1, 0.05
    logits = probs.log()[None] + 3.0                         # any shift: softmax recovers probs
    expected = {0.3: {1}, 0.5: {1}, 0.6: {1, 3}, 0.84: {1, 3, 4}, 0.86: {0, 1, 3, 4}, 0.99: {0, 1, 2, 3, 4},
                1.0: {0, 1, 2, 3, 4}}
    for p, keep in expected.items():
        kept = torch.isfinite(top_p_filter(logits, p))[0].nonzero().flatten().tolist()
        assert set(kept) == keep, f"top-p {p}: kept {kept}, expected {sorted(keep)}"
        assert probs[kept].sum() >= p - 1e-6
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="top-p"):
            top_p_filter(logits, bad)


def test_filters_compose_and_sample_follows_the_distribution():
    from zoo.inference import filter_logits, sample

    logits = torch.tensor([[0.0, math.log(3.0), -50.0, -60.0]])          # probs ~ 0.25, 0.75, 0, 0
    # temperature first: T = 0.5 squares the odds to 1:9, so top-p 0.85 keeps only the top token
    assert torch.isfinite(filter_logits(logits, 0.5, top_p=0.85)).tolist() == [[False, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 1.0, top_k=3, top_p=0.85)).tolist() == [[True, True, False, False]]
    draws = sample(logits.expand(4000, -1), [torch.Generator().manual_seed(0)] * 4000)
    assert set(draws.tolist()) <= {0, 1}
    assert abs((draws == 1).float().mean().item() - 0.75) < 0.03
    again = sample(logits.expand(4000, -1), [torch.Generator().manual_seed(0)] * 4000)
    assert torch.equal(draws, again)


# ---------------------------------------------------------------------------- stopping
def test_eod_stops_one_sequence_while_others_continue(gpt2_dir):
    from zoo.inference import GenerationConfig, generate
    from zoo.models import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    free = GenerationConfig(max_new_tokens=NEW, greedy=True, eod_token_id=None)
    unstopped = [c.tokens for c in generate(model, PROMPTS, free)]
    # Call "EOD" a token that row 0 produces before row 1 does (if row 1 does at all).
    def first(tokens, t):
        return tokens.index(t) if t in tokens else NEW

    stop = next(t for t in unstopped[0] if first(unstopped[0], t) < min(first(unstopped[1], t), NEW - 1) - 1)
    cuts = [first(tokens, stop) + 1 for tokens in unstopped]                 # tokens kept, EOD included
    for use_cache in (True, False):
        got = generate(model, PROMPTS, dataclasses.replace(free, eod_token_id=stop, use_cache=use_cache))
        assert got[0].tokens == unstopped[0][:cuts[0]] and got[0].finish_reason == "eod"
        assert len(got[1].tokens) > len(got[0].tokens) + 1, "row 1 did not continue after row 0 stopped"
        assert got[1].tokens == unstopped[1][:cuts[1]]
        assert got[1].finish_reason == ("eod" if cuts[1] <= NEW else "length")
    # The context limit: a prompt 3 short of n_positions gets 3 tokens; its short batch-mate goes on.
    long_prompt = [(7 * i) % VOCAB for i in range(N_POSITIONS - 3)]
    for use_cache in (True, False):
        got = generate(model, [long_prompt, PROMPTS[1]], dataclasses.replace(free, use_cache=use_cache))
        assert [c.finish_reason for c in got] == ["context", "length"]
        assert len(got[0].tokens) == 3 and got[1].tokens == unstopped[1]
    with pytest.raises(ValueError, match="prompt 1 has 48 tokens"):
        generate(model, [[1], [2] * N_POSITIONS], free)


def test_max_length_counts_the_prompt_and_any_of_several_eos_ids_stops(gpt2_dir):
    """transformers' max_length: prompt plus new tokens; eos_token_id as a list: any of them ends a sequence;
    the pad token never changes the tokens."""
    from zoo.inference import GenerationConfig, generate
    from zoo.models import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    free = GenerationConfig(max_new_tokens=NEW, greedy=True, eod_token_id=None)
    unstopped = [c.tokens for c in generate(model, PROMPTS, free)]
    got = generate(model, PROMPTS, dataclasses.replace(free, max_length=10))        # prompts of 7 and 3 tokens
    assert [c.tokens for c in got] == [unstopped[0][:3], unstopped[1][:7]]
    assert [c.finish_reason for c in got] == ["length", "length"]
    stops = (unstopped[0][2], unstopped[1][0])
    got = generate(model, PROMPTS, dataclasses.replace(free, eod_token_id=stops))
    for row, completion in enumerate(got):
        cut = next(i for i, t in enumerate(unstopped[row]) if t in stops) + 1
        assert completion.tokens == unstopped[row][:cut] and completion.finish_reason == "eod", row
    assert [c.tokens for c in generate(model, PROMPTS, dataclasses.replace(free, pad_token_id=3))] == unstopped
    with pytest.raises(ValueError, match="prompt 0 has 7 tokens, which leaves no room for a new token under "
                                         "max_length=7"):
        generate(model, PROMPTS, dataclasses.replace(free, max_length=7))
    with pytest.raises(ValueError, match=f"pad token id {VOCAB + 5} is outside the model's vocabulary"):
        generate(model, PROMPTS, dataclasses.replace(free, pad_token_id=VOCAB + 5))


# ---------------------------------------------------------------------------- CLI
def test_generate_cli_error_exits_2_with_one_sentence(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "generate.py"), "--load", str(tmp_path),
                           "--prompt-file", str(tmp_path / "missing.txt")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip()
    assert message.startswith("error: prompt file") and "missing.txt" in message
    assert message.count("\n") == 0 and message.endswith(".")


@pytest.fixture(scope="module")
def gpt2_bpe_dir(tmp_path_factory):
    """A tiny transformers GPT-2 with the real 50257-token vocabulary (no tokenizer files: the CLI falls
    back to the bundled GPT-2 BPE)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=1, n_head=2))
    path = tmp_path_factory.mktemp("gen_gpt2_bpe")
    model.save_pretrained(path)
    return str(path)


def test_generate_cli_writes_jsonl_and_refuses_bad_input(gpt2_bpe_dir, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("launch_generate", REPO / "launch" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello world\n\nThe quick brown fox\n")
    out = tmp_path / "out.jsonl"
    results = cli.main(["--load", gpt2_bpe_dir, "--prompt", "One", "--prompt-file", str(prompts), "--greedy",
                        "--max-new-tokens", "4", "--output", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["One", "Hello world", "The quick brown fox"]
    assert all(1 <= len(r["tokens"]) <= 4 and isinstance(r["completion"], str) for r in rows)
    assert [r.tokens for r in results] == [r["tokens"] for r in rows]
    assert "--- [2]" in capsys.readouterr().out
    for argv, needle in ((["--prompt", "word " * 20], "n_positions=16"), (["--prompt", "x", "--top-p", "1.5"], "top-p"),
                         (["--prompt", "x", "--tensor-parallel-size", "2"], "tensor-parallel size 2")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--load", gpt2_bpe_dir, *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and needle in err and err.count("\n") == 0, err


# ---------------------------------------------------------------------------- CLI: generation_config.json
def _launch_generate():
    spec = importlib.util.spec_from_file_location("launch_generate", REPO / "launch" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def _model_with_generation_config(source, directory, content) -> str:
    """A copy of the model directory ``source`` whose generation_config.json is ``content`` (a dict as JSON,
    a str as it is; None: no file)."""
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(source) / name, directory / name)
    if content is not None:
        text = content if isinstance(content, str) else json.dumps(content)
        (directory / "generation_config.json").write_text(text)
    return str(directory)


def _settings_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("generation settings: ")]
    assert len(lines) == 1, lines
    return lines[0]


CLI_PROMPTS = ["--prompt", "Hello world", "--prompt", "The"]   # 2 and 1 tokens


def test_generate_cli_applies_generation_config_json(gpt2_bpe_dir, tmp_path, capsys):
    """The file's do_sample, temperature, top_k, top_p, max_new_tokens, max_length and eos_token_id apply where no
    flag is given: each run equals the same settings given as flags to the same model without the file."""
    cli = _launch_generate()
    plain = _model_with_generation_config(gpt2_bpe_dir, tmp_path / "plain", None)

    def run(directory, *flags):
        return [(r.tokens, r.finish_reason) for r in cli.main(["--load", directory, *CLI_PROMPTS, *flags])]

    greedy = run(plain, "--greedy", "--max-new-tokens", "4")
    capsys.readouterr()
    from_file = _model_with_generation_config(gpt2_bpe_dir, tmp_path / "greedy", {"do_sample": False,
                                                                                    "max_new_tokens": 3})
    assert run(from_file) == [(tokens[:3], "length") for tokens, _ in greedy]
    line = _settings_line(capsys)
    assert "greedy (generation_config.json)" in line and "max_new_tokens 3 (generation_config.json)" in line, line

    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_new_tokens": 4}
    sampled = run(_model_with_generation_config(gpt2_bpe_dir, tmp_path / "sampling", sampling))
    assert sampled == run(plain, "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--max-new-tokens", "4")
    assert sampled != run(plain, "--max-new-tokens", "4"), "the file's sampling settings changed nothing"
    capsys.readouterr()

    # max_length counts the prompt: "Hello world" (2 tokens) gets 3 new tokens, "The" (1 token) 4.
    limited = run(_model_with_generation_config(gpt2_bpe_dir, tmp_path / "length", {"do_sample": False,
                                                                                      "max_length": 5}))
    assert limited == [(greedy[0][0][:3], "length"), (greedy[1][0][:4], "length")]
    assert "max_length 5 (generation_config.json)" in _settings_line(capsys)

    stop = greedy[0][0][0]   # the first greedy token of "Hello world", one of two eos ids
    eos = run(_model_with_generation_config(gpt2_bpe_dir, tmp_path / "eos", {"do_sample": False, "max_new_tokens": 4,
                                                                               "eos_token_id": [50256, stop]}))
    for (tokens, reason), (expected, _) in zip(eos, greedy):
        cut = expected.index(stop) + 1 if stop in expected else len(expected)
        assert (tokens, reason) == (expected[:cut], "eod" if stop in expected else "length")
    assert eos[0] == ([stop], "eod")


def test_generate_cli_flags_override_generation_config_json(gpt2_bpe_dir, tmp_path, capsys):
    """A flag given wins over the file; --temperature, --top-k and --top-p sample even where the file says
    do_sample false, --greedy decodes greedily where it says true, and --no-generation-config ignores the file."""
    cli = _launch_generate()
    plain = _model_with_generation_config(gpt2_bpe_dir, tmp_path / "plain", None)
    greedy_file = _model_with_generation_config(gpt2_bpe_dir, tmp_path / "greedy", {
        "do_sample": False, "max_new_tokens": 3, "temperature": 0.5})
    sampling_file = _model_with_generation_config(gpt2_bpe_dir, tmp_path / "sampling", {
        "do_sample": True, "temperature": 0.7, "max_new_tokens": 3})

    def run(directory, *flags):
        return [r.tokens for r in cli.main(["--load", directory, *CLI_PROMPTS, *flags])]

    assert run(greedy_file, "--max-new-tokens", "5") == run(plain, "--greedy", "--max-new-tokens", "5")
    capsys.readouterr()
    overridden = run(greedy_file, "--temperature", "0.9", "--seed", "7")
    line = _settings_line(capsys)
    assert overridden == run(plain, "--temperature", "0.9", "--seed", "7", "--max-new-tokens", "3")
    for part in ("sampling (--temperature)", "temperature 0.9 (--temperature)", "seed 7 (--seed)",
                 "max_new_tokens 3 (generation_config.json)"):
        assert part in line, line
    assert run(greedy_file, "--top-k", "5") == run(plain, "--temperature", "0.5", "--top-k", "5",
                                                  "--max-new-tokens", "3")
    assert run(sampling_file, "--greedy") == run(plain, "--greedy", "--max-new-tokens", "3")
    capsys.readouterr()
    ignored = run(sampling_file, "--no-generation-config", "--max-new-tokens", "2")
    assert "generation_config.json ignored (--no-generation-config)" in _settings_line(capsys)
    assert ignored == run(plain, "--max-new-tokens", "2")


@pytest.mark.parametrize("content,needle", [
    ('{"do_sample": tru', "is not valid JSON"),
    ("[1, 2]", "holds a JSON list"),
    ({"temperature": -1.0}, "sets temperature to -1.0, but it must be a finite number"),
    ({"max_new_tokens": "ten"}, 'sets max_new_tokens to "ten", but it must be a positive integer'),
    ({"early_stopping": "x"}, "is refused by transformers' GenerationConfig (`early_stopping` must be"),
    ({"num_beams": 4}, "sets num_beams to 4, but zoo's generator has no beam search"),
    ({"do_sample": True, "repetition_penalty": 1.3}, "sets repetition_penalty to 1.3, but zoo's generator has no"),
])
def test_generate_cli_refuses_a_generation_config_json_it_cannot_apply(gpt2_bpe_dir, tmp_path, capsys, content,
                                                                       needle):
    directory = _model_with_generation_config(gpt2_bpe_dir, tmp_path / "model", content)
    with pytest.raises(SystemExit) as exit_info:
        _launch_generate().main(["--load", directory, "--prompt", "Hello", "--max-new-tokens", "2"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"error: {directory}/generation_config.json ") and err.count("\n") == 0, err
    assert needle in err and err.endswith("or ignore the file with --no-generation-config."), err
    assert "--- [0]" not in captured.out
