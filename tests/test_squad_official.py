"""The scorer equals the official evaluate-v1.1.py / evaluate-v2.0.py on the inputs where a scorer easily
departs from them. Each expected number is worked out by hand from the official definitions in the
comment next to it; the scripts themselves are not run.

The definitions used: normalize_answer (lower, strip punctuation, drop a/an/the, collapse spaces);
v1.1: every gold text counts, f1 = 0 when no token is shared, total counts every question of the
file (missing predictions 0); v2.0: gold texts normalising to "" are dropped ([""] if none is left),
f1 = (gold_toks == pred_toks) when either is empty, HasAns = bool(qa["answers"]), scores kept in a
dict keyed by id (a duplicate id counts once, its last occurrence's answers).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.finetune.squad_metrics import exact_match_score, f1_score, f1_score_v1, squad_scores

ROOT = Path(__file__).resolve().parent.parent
SQUAD_EVAL = ROOT / "finetune" / "squad_eval.py"
FIXTURES = ROOT / "tests" / "fixtures" / "finetune"


CONTEXT = "sun moon star"


def squad_file(directory: Path, qas: list[dict], version: str | None, name: str = "dev.json") -> Path:
    """A SQuAD file with one paragraph holding ``qas`` ({"id", "answers": [texts] or dicts, ...}); a
    text answer gets the answer_start of its first occurrence in the context."""
    questions = [{"question": "?", **qa, "answers": [
        a if isinstance(a, dict) else {"text": a, "answer_start": max(CONTEXT.find(a), 0)} for a in qa["answers"]]}
        for qa in qas]
    record = {"data": [{"title": "t", "paragraphs": [{"context": CONTEXT, "qas": questions}]}]}
    if version is not None:
        record["version"] = version
    path = directory / name
    path.write_text(json.dumps(record))
    return path


def has_ans_only(exact: float, f1: float, total: int) -> dict:
    return {"exact": exact, "f1": f1, "total": total, "HasAns_exact": exact, "HasAns_f1": f1, "HasAns_total": total}


def test_answer_start_not_pointing_at_the_text_is_still_scored(tmp_path):
    bad_start = {"id": "q1", "answers": [{"text": "moon", "answer_start": 99}]}
    qas = [bad_start, {"id": "q2", "answers": ["sun"]}]
    predictions = {"q1": "moon", "q2": "star"}
    # q1 right (1, 1), q2 wrong (0, 0), over 2 questions (not 0 over 1: q1 counts)
    assert squad_scores(squad_file(tmp_path, qas, "1.1"), predictions) == {"exact_match": 50.0, "f1": 50.0}
    assert squad_scores(squad_file(tmp_path, qas, "v2.0"), predictions) == has_ans_only(50.0, 50.0, 2)


def test_empty_gold_text_is_still_scored(tmp_path):
    qas = [{"id": "q1", "answers": ["", "moon"]}, {"id": "q2", "answers": [""]}, {"id": "q3", "answers": ["sun"]}]
    predictions = {"q1": "moon", "q2": "", "q3": "star"}
    # v1.1: q1 max(EM("moon", ""), EM("moon", "moon")) = 1, f1 1; q2 EM("", "") = 1 but f1 0 (no
    # shared token); q3 0, 0 -> EM 2/3, F1 1/3
    assert squad_scores(squad_file(tmp_path, qas, "1.1"), predictions) == pytest.approx(
        {"exact_match": 200 / 3, "f1": 100 / 3})
    # v2.0: q1 gold ["moon"] -> 1, 1; q2 gold [""] (its only text normalises to "") vs "" -> 1, 1,
    # and it is HasAns (its answers list is not empty); q3 0, 0 -> 2/3 everywhere, all HasAns
    assert squad_scores(squad_file(tmp_path, qas, "v2.0"), predictions) == pytest.approx(
        has_ans_only(200 / 3, 200 / 3, 3))


def test_answers_empty_without_is_impossible_is_a_no_answer_question(tmp_path):
    qas = [{"id": "q1", "answers": []}, {"id": "q2", "answers": ["moon"]}]
    # No "version" field: the empty answers list makes it v2.0. q1 NoAns, gold [""] vs "" -> 1, 1;
    # q2 HasAns, right -> 1, 1 (q1 counts: total 2, with the NoAns keys)
    path = squad_file(tmp_path, qas, None)
    assert squad_scores(path, {"q1": "", "q2": "moon"}) == {
        "exact": 100.0, "f1": 100.0, "total": 2, "HasAns_exact": 100.0, "HasAns_f1": 100.0, "HasAns_total": 1,
        "NoAns_exact": 100.0, "NoAns_f1": 100.0, "NoAns_total": 1}
    # v1.1 takes max over no gold texts and fails on such a question once it is predicted; unpredicted it is 0
    with pytest.raises(ValueError, match="question 'q1' has no gold answer, which SQuAD v1.1 scoring cannot score"):
        squad_scores(path, {"q1": "", "q2": "moon"}, version="1.1")
    with pytest.warns(UserWarning, match="1 question\\(s\\) had no prediction"):
        assert squad_scores(path, {"q2": "moon"}, version="1.1") == {"exact_match": 50.0, "f1": 50.0}


def test_duplicate_ids_count_per_occurrence_in_v1_and_once_last_wins_in_v2(tmp_path):
    qas = [{"id": "d", "answers": ["moon"]}, {"id": "e", "answers": ["star"]}, {"id": "d", "answers": ["sun"]}]
    predictions = {"d": "moon", "e": "star"}
    # v1.1 loops over the file: d vs "moon" 1, e 1, d vs "sun" 0 -> 2/3 over 3
    assert squad_scores(squad_file(tmp_path, qas, "1.1"), predictions) == pytest.approx(
        {"exact_match": 200 / 3, "f1": 200 / 3})
    # v2.0 keys by id: d's last occurrence (gold "sun") overwrites -> d 0, e 1 over 2 unique ids
    assert squad_scores(squad_file(tmp_path, qas, "v2.0"), predictions) == has_ans_only(50.0, 50.0, 2)


def test_v1_gold_normalising_to_nothing_keeps_v1_semantics(tmp_path):
    assert exact_match_score("the", "a") == 1 and f1_score_v1("the", "a") == 0 and f1_score("the", "a") == 1
    qas = [{"id": "q1", "answers": ["a"]}, {"id": "q2", "answers": ["moon"]}]
    # v1.1: q1 EM 1 ("" == ""), F1 0 (no shared token); q2 1, 1 -> EM 100, F1 50 (zoo gave 100/100)
    path = squad_file(tmp_path, qas, "1.1")
    assert squad_scores(path, {"q1": "the", "q2": "moon"}) == {"exact_match": 100.0, "f1": 50.0}


def test_v2_missing_prediction_is_an_error_not_a_zero(tmp_path):
    # evaluate-v2.0.py skips the question in its raw scores, then looks it up for HasAns/NoAns and fails
    path = squad_file(tmp_path, [{"id": "q1", "answers": ["moon"]}, {"id": "q2", "answers": []}], "v2.0")
    with pytest.raises(ValueError, match="1 question\\(s\\) have no prediction, the first is 'q2'"):
        squad_scores(path, {"q1": "moon"})
    with pytest.raises(ValueError, match="no entry for question 'q2'"):
        squad_scores(path, {"q1": "moon", "q2": ""}, {"q1": 0.5})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SQUAD_EVAL), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_output_keys_follow_the_version(tmp_path):
    predictions = tmp_path / "pred.json"
    predictions.write_text(json.dumps({"d1": "first new moon", "d2": "Paper boats.", "d3": "granary"}))
    printed = run_cli(str(FIXTURES / "squad1" / "dev-v1.1.json"), str(predictions))
    assert printed.returncode == 0, printed.stderr
    # v1.1 prints one line with exact_match and f1 only (d1 f1 0.75, d2 1, d3 2/3; only d2 exact)
    assert printed.stdout.count("\n") == 1
    scores = json.loads(printed.stdout)
    assert list(scores) == ["exact_match", "f1"]
    assert scores == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (0.75 + 1 + 2 / 3) / 3})


def test_cli_accepts_the_official_flags(tmp_path):
    predictions, na_probs = tmp_path / "pred.json", tmp_path / "na.json"
    predictions.write_text(json.dumps({"v1": "a furnace", "v2": "sand", "v3": "paddles", "v4": ""}))
    na_probs.write_text(json.dumps({"v1": 0.1, "v2": 0.8, "v3": 0.4, "v4": 0.6}))
    out, images = tmp_path / "eval.json", tmp_path / "images"
    done = run_cli(str(FIXTURES / "squad2" / "dev-v2.0.json"), str(predictions), "-n", str(na_probs), "-t", "0.5",
                   "-o", str(out), "-p", str(images), "-v")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # -o replaces stdout
    scores = json.loads(out.read_text())
    # -t 0.5: v2 (0.8) and v4 (0.6) count as "" (both NoAns: right); v1 1/1; v3 0/(2/3)
    assert scores["exact"] == 75.0 and scores["f1"] == pytest.approx(100 * (3 + 2 / 3) / 4)
    # Curves by rising probability v1 (HasAns, exact 1, f1 1), v3 (HasAns, 0, 2/3), v4, v2; 2 HasAns:
    # exact: p/r after v1 1/0.5 -> AP += 0.5; then recall stays -> AP 50
    # f1: v1 0.5; v3 tp 5/3, p 5/6, r 5/6 -> += 5/6 * 1/3 -> 100 * (1/2 + 5/18); oracle: 0.5 + 0.5 -> 100
    assert scores["pr_exact_ap"] == pytest.approx(50.0)
    assert scores["pr_f1_ap"] == pytest.approx(100 * (1 / 2 + 5 / 18))
    assert scores["pr_oracle_ap"] == pytest.approx(100.0)
    assert sorted(p.name for p in images.iterdir()) == [
        "na_prob_hist_hasAns.png", "na_prob_hist_noAns.png", "pr_exact.png", "pr_f1.png", "pr_oracle.png"]
