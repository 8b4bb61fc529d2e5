"""Finetune task data: GLUE/RACE/SQuAD readers, hub layouts, input encoding, span decoding.

The fixtures under tests/fixtures/finetune are written in the original file formats (GLUE TSV with
its real header, SQuAD v1.1/v2.0 JSON, the RACE directory tree) with sentences made up for them.
Bad inputs are written per test into tmp_path.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from zoo.data import load_bert_tokenizer
from zoo.finetune.glue import (
    MNLI_LABELS,
    PairExample,
    classification_metrics,
    encode_pairs,
    read_mnli,
    read_qqp,
)
from zoo.finetune.race import RaceExample, encode_race, question_with_option, race_accuracy, read_race
from zoo.finetune.skips import MalformedExampleWarning
from zoo.finetune.squad import SquadExample, decode_predictions, featurize_squad, read_squad, read_squad_dir

FIXTURES = Path(__file__).parent / "fixtures" / "finetune"
CONTRADICTION, ENTAILMENT, NEUTRAL = (MNLI_LABELS.index(n) for n in ("contradiction", "entailment", "neutral"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_bert_tokenizer()


def tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens([int(i) for i in ids])


def copy_fixture(name, tmp_path):
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


# ---------------------------------------------------------------- GLUE


def test_read_mnli_fixture_maps_gold_labels_by_header():
    splits = read_mnli(FIXTURES / "mnli")
    assert {k: len(v) for k, v in splits.items()} == {"train": 5, "dev_matched": 3, "dev_mismatched": 3}
    assert MNLI_LABELS == ("contradiction", "entailment", "neutral")
    assert [e.label for e in splits["train"]] == [ENTAILMENT, CONTRADICTION, NEUTRAL, ENTAILMENT, CONTRADICTION]
    assert [e.label for e in splits["dev_mismatched"]] == [ENTAILMENT, CONTRADICTION, NEUTRAL]
    # dev has label1..label5 before gold_label: the gold label wins over the first annotator's
    assert splits["dev_matched"][1].label == NEUTRAL
    quoted = splits["train"][3]
    assert quoted == PairExample(
        guid="train-3",
        text_a='She called the old tram "the rattling snail" and laughed.',
        text_b="She gave the tram a nickname.",
        label=ENTAILMENT,
    )
    assert splits["dev_mismatched"][0].guid == "dev_mismatched-100"


def test_read_qqp_fixture_and_unlabelled_test_is_left_out(tmp_path):
    directory = copy_fixture("qqp", tmp_path)
    (directory / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tWhy?\tHow?\n")
    splits = read_qqp(directory)
    assert sorted(splits) == ["dev", "train"]
    assert [e.label for e in splits["train"]] == [1, 0, 1, 0, 1]
    assert splits["dev"][0].text_a == "Is it safe to swim after eating?" and splits["dev"][0].guid == "dev-500"


def test_mnli_bad_rows_are_counted_and_skipped_with_one_warning(tmp_path):
    lines = (FIXTURES / "mnli" / "train.tsv").read_text().splitlines()
    fields = lines[2].split("\t")
    bad_label = "\t".join(fields[:-1] + ["maybe"]).replace("1\t3101", "7\t3107", 1)
    short_row = "\t".join(fields[:9])  # only 9 of 12 fields
    dash = "\t".join(["8"] + fields[1:-1] + ["-"])
    (tmp_path / "train.tsv").write_text("\n".join([lines[0], lines[1], bad_label, short_row, dash, lines[3]]) + "\n")
    with pytest.warns(MalformedExampleWarning) as caught:
        splits = read_mnli(tmp_path)
    assert [e.guid for e in splits["train"]] == ["train-0", "train-2"]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "train.tsv: skipped 3 malformed example(s)" in message
    assert "2 label(s) outside contradiction/entailment/neutral" in message
    assert "1 row(s) with a field count other than the header's 12" in message
    assert "first is id '7'" in message


def test_qqp_label_outside_0_1_is_skipped(tmp_path):
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    rows = "1\t1\t2\tA?\tB?\t1\n2\t3\t4\tC?\tD?\t2\n3\t5\t6\tE?\tF?\tyes\n4\t7\t8\tG?\tH?\t0\n"
    (tmp_path / "train.tsv").write_text(header + rows)
    with pytest.warns(MalformedExampleWarning, match=r"skipped 2 .*2 label\(s\) outside 0/1.*first is id '2'"):
        splits = read_qqp(tmp_path)
    assert [(e.guid, e.label) for e in splits["train"]] == [("train-1", 1), ("train-4", 0)]


def test_glue_unreadable_inputs_raise_one_sentence(tmp_path):
    (tmp_path / "dev_matched.tsv").write_text("index\tsentence1\tsentence2\tlabel1\n0\ta\tb\tneutral\n")
    with pytest.raises(ValueError, match=r"dev_matched.tsv' has no 'gold_label' column in its header"):
        read_mnli(tmp_path)
    with pytest.raises(ValueError, match=r"no qqp split found in .*train.tsv, dev.tsv"):
        read_qqp(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_mnli(tmp_path / "missing")


def test_encode_pairs_layout_padding_and_truncation(tokenizer):
    short = PairExample("g0", "The cat sat.", "A dog ran", NEUTRAL)
    long = PairExample("g1", "one two three four five six seven eight nine ten", "red green", ENTAILMENT)
    batch = encode_pairs([short, long], tokenizer, max_seq_length=12)
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert batch["input_ids"].shape == batch["token_type_ids"].shape == batch["attention_mask"].shape == (2, 12)
    assert tokens(tokenizer, batch["input_ids"][0]) == [
        "[CLS]", "the", "cat", "sat", ".", "[SEP]", "a", "dog", "ran", "[SEP]", "[PAD]", "[PAD]"]
    assert batch["token_type_ids"][0].tolist() == [0] * 6 + [1] * 4 + [0] * 2
    assert batch["attention_mask"][0].tolist() == [1] * 10 + [0] * 2
    # the longer text loses its end; both [SEP] stay
    assert tokens(tokenizer, batch["input_ids"][1]) == [
        "[CLS]", "one", "two", "three", "four", "five", "six", "seven", "[SEP]", "red", "green", "[SEP]"]
    assert batch["token_type_ids"][1].tolist() == [0] * 9 + [1] * 3
    assert batch["labels"].tolist() == [NEUTRAL, ENTAILMENT]


def test_classification_metrics():
    assert classification_metrics("mnli", [0, 1, 2, 2], [0, 1, 1, 2]) == {"accuracy": 0.75}
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4], [0.2, 0.8]])  # 1, 0, 1, 0, 1
    metrics = classification_metrics("qqp", logits, [1, 1, 0, 0, 1])
    # tp = 2, fp = 1, fn = 1: f1 = 2*2 / (2*2 + 1 + 1)
    assert metrics == pytest.approx({"accuracy": 0.6, "f1": 4 / 6})
    with pytest.raises(ValueError, match="unknown classification task 'sst2'"):
        classification_metrics("sst2", [1], [1])


# ---------------------------------------------------------------- RACE


def test_read_race_fixture_levels_and_labels():
    splits = read_race(FIXTURES / "race")
    assert {k: len(v) for k, v in splits.items()} == {"train": 4, "dev": 3, "test": 2}
    assert [(e.level, e.label) for e in splits["train"]] == [("middle", 1), ("middle", 1), ("high", 0), ("high", 2)]
    first = splits["train"][0]
    assert first.question == "Where does Nadia keep bees?"
    assert first.options == ("In the garden", "On the school roof", "In a barn", "Near the river")
    assert first.article.startswith("Nadia keeps bees")
    assert [e.level for e in splits["dev"]] == ["middle", "middle", "high"]


def test_question_with_option():
    assert question_with_option("The new piers are made of _ .", "concrete") == "The new piers are made of concrete ."
    assert question_with_option("_ and _ both", "x") == "x and x both"
    assert question_with_option("Why were the piers replaced?", "A storm") == "Why were the piers replaced? A storm"


def test_encode_race_four_sequences_article_truncated_first(tokenizer):
    examples = read_race(FIXTURES / "race")["train"]
    blank, plain = examples[3], examples[2]  # "The new piers are made of _ ." / "Why were the piers replaced?"
    batch = encode_race([blank, plain], tokenizer, max_seq_length=20)
    assert batch["input_ids"].shape == (2, 4, 20) and batch["labels"].tolist() == [2, 0]
    for j, option in enumerate(blank.options):
        question = tokenizer.tokenize(f"The new piers are made of {option} .")
        article = tokenizer.tokenize(blank.article)[: 20 - 3 - len(question)]
        assert tokens(tokenizer, batch["input_ids"][0, j]) == ["[CLS]", *question, "[SEP]", *article, "[SEP]"]
        assert batch["token_type_ids"][0, j].tolist() == [0] * (len(question) + 2) + [1] * (len(article) + 1)
        assert batch["attention_mask"][0, j].tolist() == [1] * 20
    assert tokens(tokenizer, batch["input_ids"][1, 0])[:9] == [
        "[CLS]", "why", "were", "the", "piers", "replaced", "?", "salt", "water"]
    short = encode_race([blank], tokenizer, max_seq_length=64)
    assert short["attention_mask"][0, 0].sum() < 64 and tokens(tokenizer, short["input_ids"][0, 0])[-1] == "[PAD]"


def test_race_accuracy_by_level():
    def example(level, label):
        return RaceExample("g", level, "art", "q", ("a", "b", "c", "d"), label)

    examples = [example("middle", 0), example("middle", 1), example("high", 2), example("high", 3), example("high", 0)]
    scores = torch.zeros(5, 4)
    scores[torch.arange(5), torch.tensor([0, 2, 2, 3, 1])] = 1.0
    assert race_accuracy(scores, examples) == pytest.approx({"middle": 0.5, "high": 2 / 3, "all": 0.6})


def test_race_bad_questions_are_counted_and_skipped(tmp_path):
    level_dir = tmp_path / "dev" / "high"
    level_dir.mkdir(parents=True)
    record = {"id": "high9.txt", "article": "A short article.",
              "questions": ["Good?", "Three options?", "Bad letter?"],
              "options": [["a", "b", "c", "d"], ["a", "b", "c"], ["a", "b", "c", "d"]],
              "answers": ["D", "A", "E"]}
    (level_dir / "9.txt").write_text(json.dumps(record))
    with pytest.warns(MalformedExampleWarning) as caught:
        splits = read_race(tmp_path)
    assert [(e.question, e.label) for e in splits["dev"]] == [("Good?", 3)]
    assert len(caught) == 1
    assert "skipped 2 malformed example(s)" in str(caught[0].message)
    assert "1 question(s) without exactly 4 text options; 1 answer letter(s) outside A-D" in str(caught[0].message)
    assert "first is id 'dev-high-high9.txt-1'" in str(caught[0].message)
    (level_dir / "10.txt").write_text("not json")
    with pytest.raises(ValueError, match=r"10.txt' is not a JSON object"):
        read_race(tmp_path)
    with pytest.raises(ValueError, match="no RACE split found"):
        read_race(tmp_path / "dev")


# ---------------------------------------------------------------- SQuAD


def test_read_squad_v1_and_v2():
    train = read_squad(FIXTURES / "squad1" / "train-v1.1.json")
    assert [e.qid for e in train] == ["m1", "m2", "m3", "m4", "k1"]
    assert not any(e.is_impossible for e in train)
    text, start = train[2].answers[0]
    assert text == "1987" and train[2].context[start : start + 4] == "1987"
    dev = read_squad(FIXTURES / "squad1" / "dev-v1.1.json")
    assert len(dev[0].answers) == 3
    v2 = read_squad_dir(FIXTURES / "squad2")
    assert [(e.qid, e.is_impossible, len(e.answers)) for e in v2["train"]] == [
        ("g1", False, 1), ("g2", True, 0), ("g3", False, 1)]
    assert [e.is_impossible for e in v2["dev"]] == [False, True, False, True]


def test_squad_bad_answer_start_is_skipped_and_bad_files_raise(tmp_path):
    record = json.loads((FIXTURES / "squad1" / "dev-v1.1.json").read_text())
    qas = record["data"][0]["paragraphs"][0]["qas"]
    qas[1]["answers"][2]["answer_start"] += 3  # no longer points at "boats"
    qas.append(dict(qas[0]))  # duplicate id d1
    (tmp_path / "dev-v1.1.json").write_text(json.dumps(record))
    with pytest.warns(MalformedExampleWarning) as caught:
        examples = read_squad(tmp_path / "dev-v1.1.json")
    assert [e.qid for e in examples] == ["d1", "d3"]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "skipped 2 malformed example(s)" in message and "first is id 'd2'" in message
    assert "answer_start(s) not pointing at the answer text" in message and "duplicate question id(s)" in message
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken.json' is not JSON"):
        read_squad(tmp_path / "broken.json")
    (tmp_path / "other.json").write_text('{"version": "1.1", "articles": []}')
    with pytest.raises(ValueError, match=r"other.json' is not SQuAD JSON"):
        read_squad(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_squad(tmp_path / "absent.json")


@pytest.fixture(scope="module")
def windows(tokenizer):
    examples = read_squad(FIXTURES / "squad1" / "train-v1.1.json")
    return examples, featurize_squad(examples, tokenizer, max_seq_length=48, doc_stride=16, max_query_length=10)


def test_featurize_squad_windows_layout(tokenizer, windows):
    examples, features = windows
    L = 48
    assert features.tensors["input_ids"].shape == (len(features), L)
    assert features.example_index.count(0) > 3  # the long paragraph spans several windows
    question = tokenizer.tokenize(examples[0].question)[:10]
    first = features.example_index.index(0)
    ids = features.tensors["input_ids"][first]
    assert tokens(tokenizer, ids[: len(question) + 2]) == ["[CLS]", *question, "[SEP]"]
    assert tokens(tokenizer, ids[-1:]) == ["[SEP]"]
    context_tokens = [t for t, o in enumerate(features.offsets[first]) if o is not None]
    assert context_tokens == list(range(len(question) + 2, L - 1))
    prefix = len(question) + 2
    assert features.tensors["token_type_ids"][first].tolist() == [0] * prefix + [1] * (L - prefix)
    # consecutive windows start 16 context tokens apart, and the last one reaches the end of the context
    window_starts = [features.offsets[f][len(question) + 2][0] for f, i in enumerate(features.example_index) if i == 0]
    full = tokenizer(examples[0].context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert window_starts == [full[t][0] for t in range(0, 16 * len(window_starts), 16)]
    last = max(f for f, i in enumerate(features.example_index) if i == 0)
    assert max(o[1] for o in features.offsets[last] if o is not None) == full[-1][1]


def test_featurize_squad_answer_spans_round_trip(windows):
    examples, features = windows
    starts, ends = features.tensors["start_positions"], features.tensors["end_positions"]
    answer_windows = {}
    for f, i in enumerate(features.example_index):
        if starts[f] == 0:
            assert ends[f] == 0
            continue
        offsets = features.offsets[f]
        text, _ = examples[i].answers[0]
        assert examples[i].context[offsets[starts[f]][0] : offsets[ends[f]][1]] == text
        answer_windows.setdefault(i, []).append(f - features.example_index.index(i))
    assert sorted(answer_windows) == list(range(len(examples)))  # every answer lies in some window
    assert min(answer_windows[3]) >= 2  # "four thousand and twelve" is only in later windows


def test_decode_predictions_across_window_boundary(windows):
    examples, features = windows
    L = features.tensors["input_ids"].shape[1]
    start_logits, end_logits = torch.zeros(len(features), L), torch.zeros(len(features), L)
    example_windows = [f for f, i in enumerate(features.example_index) if i == 2]  # "1987", near the end
    positions = features.tensors["start_positions"]
    target_window = next(f for f in example_windows[1:]
                         if positions[f] > 0 and features.max_context[f][int(positions[f])])
    assert positions[example_windows[0]] == 0  # not in the first window
    target = int(positions[target_window])
    # decoys: a valid but lower-scoring span in the first window, and a larger start logit on a
    # question token (no valid span); the best pair is the answer in a later window
    first_context = features.offsets[example_windows[0]].index((0, 3))  # "The" of the context
    start_logits[example_windows[0], first_context], end_logits[example_windows[0], first_context + 1] = 4.0, 4.0
    start_logits[target_window, 1] = 50.0
    start_logits[target_window, target], end_logits[target_window, target] = 5.0, 5.0
    start_logits[target_window, target - 1], end_logits[target_window, target + 2] = 4.0, 4.5  # a worse, longer span
    predictions, na_probs = decode_predictions(examples, features, start_logits, end_logits)
    assert predictions["m3"] == "1987"
    # answer spans are cut from the context: the whole multi-token answer of m4 comes back verbatim
    m4 = [f for f, i in enumerate(features.example_index) if i == 3]
    f = next(f for f in m4 if features.tensors["start_positions"][f] > 0)
    start_logits[f, features.tensors["start_positions"][f]] = 7.0
    end_logits[f, features.tensors["end_positions"][f]] = 7.0
    predictions, _ = decode_predictions(examples, features, start_logits, end_logits, max_answer_length=30)
    assert predictions["m4"] == "four thousand and twelve"
    predictions, _ = decode_predictions(examples, features, start_logits, end_logits, max_answer_length=2)
    assert predictions["m4"] != "four thousand and twelve"  # 4 tokens do not fit in 2


def test_each_context_token_has_one_max_context_window(windows):
    """BERT's rule: a token in several windows is decoded only from the one where it has the most
    context on both sides; a start logit elsewhere is ignored."""
    examples, features = windows
    for i in range(len(examples)):
        rows = [f for f, e in enumerate(features.example_index) if e == i]
        owners = {}
        for f in rows:
            for t, offset in enumerate(features.offsets[f]):
                if offset is not None and features.max_context[f][t]:
                    assert offset not in owners, f"token {offset} of example {i} has two max-context windows"
                    owners[offset] = f
        every = {o for f in rows for o in features.offsets[f] if o is not None}
        assert set(owners) == every
    L = features.tensors["input_ids"].shape[1]
    f = next(f for f in range(len(features)) if not all(
        features.max_context[f][t] for t, o in enumerate(features.offsets[f]) if o is not None))
    t = next(t for t, o in enumerate(features.offsets[f]) if o is not None and not features.max_context[f][t])
    start_logits, end_logits = torch.zeros(len(features), L), torch.zeros(len(features), L)
    start_logits[f, t], end_logits[f, t] = 9.0, 9.0
    predictions, _ = decode_predictions(examples, features, start_logits, end_logits)
    offset = features.offsets[f][t]
    context = examples[features.example_index[f]].context
    assert predictions[examples[features.example_index[f]].qid] != context[offset[0]:offset[1]]


def test_decode_predictions_v2_null_answer(tokenizer):
    examples = read_squad(FIXTURES / "squad2" / "dev-v2.0.json")
    features = featurize_squad(examples, tokenizer, max_seq_length=64, doc_stride=32, max_query_length=16)
    L = features.tensors["input_ids"].shape[1]
    start_logits, end_logits = torch.zeros(len(features), L), torch.zeros(len(features), L)
    for f, i in enumerate(features.example_index):
        offsets = features.offsets[f]
        begin = examples[i].context.index("in a furnace")
        span = [t for t, o in enumerate(offsets) if o is not None and begin <= o[0] < begin + len("in a furnace")]
        start_logits[f, span[0]], end_logits[f, span[-1]] = 3.0, 3.0  # span score 6
        null = 8.0 if examples[i].is_impossible else 2.0
        start_logits[f, 0] = end_logits[f, 0] = null / 2
    predictions, na_probs = decode_predictions(
        examples, features, start_logits, end_logits, version_2_with_negative=True)
    assert predictions == {"v1": "in a furnace", "v2": "", "v3": "in a furnace", "v4": ""}
    assert na_probs["v2"] == pytest.approx(1 / (1 + torch.exp(torch.tensor(-2.0)).item()))
    assert na_probs["v1"] < 0.5 < na_probs["v2"]
    # a threshold above the margin keeps the span
    predictions, _ = decode_predictions(examples, features, start_logits, end_logits,
                                        version_2_with_negative=True, null_score_diff_threshold=2.5)
    assert predictions["v2"] == "in a furnace"
    # v1 decoding never answers ""
    predictions, _ = decode_predictions(examples, features, start_logits, end_logits)
    assert predictions["v4"] == "in a furnace"


# ---------------------------------------------------------------- hub layouts


def _save_both(dataset_dict, root: Path, name: str) -> tuple[Path, Path]:
    """The DatasetDict as a save_to_disk directory and as hub-named parquet files."""
    on_disk, parquet = root / f"{name}_disk", root / f"{name}_parquet"
    dataset_dict.save_to_disk(str(on_disk))
    parquet.mkdir()
    for split, dataset in dataset_dict.items():
        dataset.to_parquet(str(parquet / f"{split}-00000-of-00001.parquet"))
    return on_disk, parquet


def test_hub_layouts_read_into_the_same_dataclasses(tmp_path):
    import datasets

    datasets.disable_progress_bars()

    mnli_features = datasets.Features({
        "premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["entailment", "neutral", "contradiction"]), "idx": datasets.Value("int32")})
    mnli = datasets.DatasetDict({
        "validation_matched": datasets.Dataset.from_dict(
            {"premise": ["P0", "P1"], "hypothesis": ["H0", "H1"], "label": [0, 2], "idx": [0, 1]},
            features=mnli_features),
        "validation_mismatched": datasets.Dataset.from_dict(
            {"premise": ["P2"], "hypothesis": ["H2"], "label": [1], "idx": [0]}, features=mnli_features),
        "test_matched": datasets.Dataset.from_dict(
            {"premise": ["P3"], "hypothesis": ["H3"], "label": [-1], "idx": [0]}, features=mnli_features),
    })
    qqp = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"question1": ["A?", "B?", "C?"], "question2": ["a?", "b?", "c?"],
                                             "label": [1, 0, 5], "idx": [0, 1, 2]}),
        "test": datasets.Dataset.from_dict({"question1": ["T?"], "question2": ["t?"], "label": [-1], "idx": [0]}),
    })
    context = "Glassblowers in Venrow heat sand and ash in a furnace."
    assert context.index("in a furnace") == 41
    squad_v2 = datasets.DatasetDict({"validation": datasets.Dataset.from_dict({
        "id": ["v1", "v2"], "title": ["Venrow", "Venrow"], "context": [context, context],
        "question": ["Where?", "Who?"],
        "answers": [{"text": ["in a furnace", "a furnace"], "answer_start": [41, 44]},
                    {"text": [], "answer_start": []}]})})
    race = datasets.DatasetDict({"test": datasets.Dataset.from_dict({
        "example_id": ["high7.txt", "high7.txt", "middle3.txt"], "article": ["Art one.", "Art one.", "Art two."],
        "answer": ["C", "A", "B"], "question": ["Q1 _ .", "Q2?", "Q3?"],
        "options": [["a", "b", "c", "d"], ["e", "f", "g", "h"], ["i", "j", "k", "l"]]})})

    for directory in _save_both(mnli, tmp_path, "mnli"):
        splits = read_mnli(directory)
        assert splits == {
            "dev_matched": [PairExample("dev_matched-0", "P0", "H0", ENTAILMENT),
                            PairExample("dev_matched-1", "P1", "H1", CONTRADICTION)],
            "dev_mismatched": [PairExample("dev_mismatched-0", "P2", "H2", NEUTRAL)],
        }
    for directory in _save_both(qqp, tmp_path, "qqp"):
        with pytest.warns(MalformedExampleWarning, match=r"skipped 1 .*label\(s\) outside 0..1.*first is id '2'"):
            splits = read_qqp(directory)
        assert splits == {"train": [PairExample("train-0", "A?", "a?", 1), PairExample("train-1", "B?", "b?", 0)]}
    for directory in _save_both(squad_v2, tmp_path, "squad_v2"):
        dev = read_squad_dir(directory)["dev"]
        assert dev == read_squad(directory, split="dev") == [
            SquadExample("v1", "Where?", context, (("in a furnace", 41), ("a furnace", 44)), False),
            SquadExample("v2", "Who?", context, (), True)]
    converted = tmp_path / "race_converted" / "test"  # the hub's refs/convert/parquet naming
    converted.mkdir(parents=True)
    race["test"].to_parquet(str(converted / "0000.parquet"))
    for directory in (*_save_both(race, tmp_path, "race"), converted.parent):
        test = read_race(directory)["test"]
        assert test == [
            RaceExample("test-high-high7.txt-0", "high", "Art one.", "Q1 _ .", ("a", "b", "c", "d"), 2),
            RaceExample("test-high-high7.txt-1", "high", "Art one.", "Q2?", ("e", "f", "g", "h"), 0),
            RaceExample("test-middle-middle3.txt-0", "middle", "Art two.", "Q3?", ("i", "j", "k", "l"), 1)]
    wrong = datasets.DatasetDict({"validation_matched": datasets.Dataset.from_dict(
        {"question1": ["A?"], "question2": ["a?"], "label": [1]})})
    wrong.save_to_disk(str(tmp_path / "wrong"))
    with pytest.raises(ValueError, match="split 'validation_matched' of .* has no 'premise' column"):
        read_mnli(tmp_path / "wrong")
