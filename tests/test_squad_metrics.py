"""The official SQuAD scores: normalisation, EM/F1 by hand, v2 no-answer thresholds, the CLI.

Every expected number below is worked out by hand in the comment next to it.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.finetune.skips import MalformedExampleWarning
from zoo.finetune.squad import SquadExample
from zoo.finetune.squad_metrics import exact_match_score, f1_score, normalize_answer, squad_scores

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "finetune"
SQUAD_EVAL = ROOT / "finetune" / "squad_eval.py"

# squad2/dev-v2.0.json: v1 gold "in a furnace" | "a furnace", v2 impossible, v3 gold "wooden paddles",
# v4 impossible.
V2_PREDICTIONS = {"v1": "a furnace", "v2": "sand", "v3": "paddles", "v4": ""}
V2_NA_PROBS = {"v1": 0.1, "v2": 0.8, "v3": 0.4, "v4": 0.6}
# raw per question: exact 1, 0, 0, 1; f1 1, 0, 2/3 (P = 1, R = 1/2), 1
V2_EXPECTED = {
    "exact": 50.0, "f1": 100 * (1 + 0 + 2 / 3 + 1) / 4, "total": 4,
    "HasAns_exact": 50.0, "HasAns_f1": 100 * (1 + 2 / 3) / 2, "HasAns_total": 2,
    "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2,
    # best threshold: start from all-null (2 right: v2, v4), add questions by rising na-prob:
    # exact: v1 (0.1) +1 -> 3 (best, 0.1); v3 (0.4) +0; v4 (0.6) +0; v2 (0.8) -1
    "best_exact": 75.0, "best_exact_thresh": 0.1,
    # f1: v1 +1 -> 3 (0.1); v3 +2/3 -> 3.667 (best, 0.4); v4 +0; v2 -1
    "best_f1": 100 * (3 + 2 / 3) / 4, "best_f1_thresh": 0.4,
}


def test_normalize_answer():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Theatre anchor") == "theatre anchor"  # articles only as whole words
    assert normalize_answer(" \t paper\nboats ") == "paper boats"
    assert normalize_answer("U.S.-based") == "usbased"


def test_exact_match_and_f1_by_hand():
    assert exact_match_score("the Eiffel Tower.", "Eiffel tower") == 1
    assert exact_match_score("Eiffel", "Eiffel tower") == 0
    # "big red barn" vs "red barn door": 2 shared of 3 and 3 -> P = R = 2/3
    assert f1_score("the big red barn", "red barn door") == pytest.approx(2 / 3)
    # "x x y" vs "x y": shared min-counts x:1, y:1 = 2 -> P = 2/3, R = 1 -> F1 = 0.8
    assert f1_score("x x y", "x y") == pytest.approx(0.8)
    assert f1_score("moon", "sun") == 0.0
    assert f1_score("", "") == 1.0 and f1_score("the", "") == 1.0 and f1_score("", "moon") == 0.0


def test_v1_scores_take_the_max_over_gold_answers():
    predictions = {"d1": "first new moon", "d2": "Paper boats.", "d3": "granary"}
    scores = squad_scores(FIXTURES / "squad1" / "dev-v1.1.json", predictions)
    # d1 vs "first new moon of spring": P = 1, R = 3/5 -> 0.75 (the 6-token gold gives 2/3)
    # d2: exact; d3 vs "old granary": P = 1, R = 1/2 -> 2/3
    assert scores == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (0.75 + 1 + 2 / 3) / 3})


def test_v2_scores_with_no_answer_probabilities():
    scores = squad_scores(FIXTURES / "squad2" / "dev-v2.0.json", V2_PREDICTIONS, V2_NA_PROBS)
    assert scores == pytest.approx(V2_EXPECTED)
    # threshold 0.5: v2 (0.8) and v4 (0.6) count as "" -> both right; exact 3/4, f1 (1 + 1 + 2/3 + 1)/4
    thresholded = squad_scores(FIXTURES / "squad2" / "dev-v2.0.json", V2_PREDICTIONS, V2_NA_PROBS, na_prob_thresh=0.5)
    assert thresholded["exact"] == pytest.approx(75.0)
    assert thresholded["f1"] == pytest.approx(100 * (3 + 2 / 3) / 4)
    assert thresholded["NoAns_exact"] == 100.0


def test_v1_missing_predictions_score_zero_with_one_warning():
    examples = [SquadExample("a", "q", "c moon", (("moon", 2),)), SquadExample("b", "q", "c sun", (("sun", 2),))]
    expected = r"1 question\(s\) had no prediction \(1 scored 0, as the official v1.1 script does\).*first is id 'b'"
    with pytest.warns(MalformedExampleWarning, match=expected):
        scores = squad_scores(examples, {"a": "moon"})
    assert scores == {"exact_match": 50.0, "f1": 50.0}  # b counts in the total, with 0
    with pytest.raises(ValueError, match="the prediction of question 'a' is 3, not a string"):
        squad_scores(examples, {"a": 3, "b": "sun"})
    with pytest.raises(ValueError, match="predictions must be a JSON object"):
        squad_scores(examples, ["moon"])


def test_best_threshold_counts_any_non_empty_no_answer_prediction_as_wrong():
    # As the official script: "the" normalises to "" (exact 1 on the impossible question b), yet
    # keeping a non-empty prediction on b costs 1 in the threshold search.
    examples = [SquadExample("a", "q", "c moon", (("moon", 2),)), SquadExample("b", "q", "c", (), True)]
    scores = squad_scores(examples, {"a": "moon", "b": "the"}, {"a": 0.2, "b": 0.7})
    assert scores["exact"] == 100.0
    # all null: 1 (b); + a (0.2): 2 -> best 100 at 0.2; + b (0.7): -1
    assert (scores["best_exact"], scores["best_exact_thresh"]) == (100.0, 0.2)
    scores = squad_scores(examples, {"a": "sun", "b": "the"}, {"a": 0.2, "b": 0.7})
    # all null: 1; + a: +0; + b: -1 -> best stays at the start, 50 at threshold 0
    assert (scores["best_exact"], scores["best_exact_thresh"]) == (50.0, 0.0)


def _load_cli():
    spec = importlib.util.spec_from_file_location("squad_eval", SQUAD_EVAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_squad_eval_cli_prints_the_hand_computed_scores(tmp_path):
    predictions, na_probs = tmp_path / "predictions.json", tmp_path / "na_probs.json"
    predictions.write_text(json.dumps(V2_PREDICTIONS))
    na_probs.write_text(json.dumps(V2_NA_PROBS))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(SQUAD_EVAL), str(FIXTURES / "squad2" / "dev-v2.0.json"), str(predictions),
         "--na-prob-file", str(na_probs)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert list(printed) == list(V2_EXPECTED)  # the official script's keys, in its order
    assert printed == pytest.approx(V2_EXPECTED)


def test_squad_eval_cli_user_errors_exit_2(tmp_path, capsys):
    cli = _load_cli()
    dataset = str(FIXTURES / "squad2" / "dev-v2.0.json")
    assert cli.main([dataset, str(tmp_path / "absent.json")]) == 2
    error = capsys.readouterr().err
    assert "predictions file" in error and "does not exist" in error and error.count("\n") == 1
    (tmp_path / "bad.json").write_text("[1, 2")
    assert cli.main([dataset, str(tmp_path / "bad.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[]")
    assert cli.main([dataset, str(tmp_path / "list.json")]) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    (tmp_path / "ok.json").write_text(json.dumps(V2_PREDICTIONS))
    assert cli.main([str(tmp_path / "no-data.json"), str(tmp_path / "ok.json")]) == 2
    assert "no-data.json' does not exist" in capsys.readouterr().err
    out = tmp_path / "scores.json"
    assert cli.main([dataset, str(tmp_path / "ok.json"), "--out-file", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["exact"] == 50.0 and "best_f1" not in written
    assert capsys.readouterr().out == ""  # the official v2.0 script writes the file instead of printing
    assert cli.main([dataset, str(tmp_path / "ok.json"), "--out-file", str(tmp_path / "absent" / "s.json")]) == 2
    assert "is not an existing directory" in capsys.readouterr().err
    assert cli.main([dataset, str(tmp_path / "ok.json"), "--out-file", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli.main([dataset, str(tmp_path / "ok.json"), "--version", "1.1", "--na-prob-file", str(out)]) == 2
    assert "no-answer probabilities are a SQuAD v2.0 input" in capsys.readouterr().err
