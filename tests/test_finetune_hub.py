"""Task data by hub name: ``--data-dir hub:NAME[/CONFIG]`` through ``datasets.load_dataset``.

Without network: the fixtures (original layouts) are rewritten here, with plain csv/json code, as
local dataset repositories in the hub's layout (parquet split files plus the dataset card's
``configs:`` front matter, as glue, squad, squad_v2 and race are stored on the hub). ``hub:<repo
path>/<config>`` reaches them through the same ``datasets.load_dataset(path, name)`` call that
``hub:glue/mnli`` makes, and every task's examples must equal those of the original layout.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from zoo.finetune.glue import read_mnli, read_qqp
from zoo.finetune.hub_names import split_hub_name
from zoo.finetune.race import read_race
from zoo.finetune.squad import read_squad_dir

FIXTURES = Path(__file__).parent / "fixtures" / "finetune"
MNLI_HUB_LABELS = ["entailment", "neutral", "contradiction"]
QQP_HUB_LABELS = ["not_duplicate", "duplicate"]


def _tsv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))


def _card(configs: dict[str, dict[str, str]]) -> str:
    """A dataset card whose front matter maps each configuration's splits to their files."""
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {path}" for split, path in splits.items()]
    return "\n".join(lines + ["---", ""])


def _write_repo(repo: Path, tables: dict[str, dict[str, tuple[dict, object]]]) -> None:
    """{config: {split: (columns, features)}} as <config>/<split>-00000-of-00001.parquet + README.md."""
    import datasets

    configs = {}
    for config, splits in tables.items():
        (repo / config).mkdir(parents=True)
        for split, (columns, features) in splits.items():
            name = f"{config}/{split}-00000-of-00001.parquet"
            datasets.Dataset.from_dict(columns, features=features).to_parquet(str(repo / name))
        configs[config] = {split: f"{config}/{split}-*" for split in splits}
    (repo / "README.md").write_text(_card(configs))


def _glue_tables() -> dict:
    import datasets

    def pair_features(text_a, text_b, names):
        return datasets.Features({text_a: datasets.Value("string"), text_b: datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=names), "idx": datasets.Value("int32")})

    mnli, qqp = {}, {}
    for split, hub_split in (("train", "train"), ("dev_matched", "validation_matched"),
                             ("dev_mismatched", "validation_mismatched")):
        rows = _tsv_rows(FIXTURES / "mnli" / f"{split}.tsv")
        mnli[hub_split] = ({"premise": [r["sentence1"] for r in rows], "hypothesis": [r["sentence2"] for r in rows],
                            "label": [MNLI_HUB_LABELS.index(r["gold_label"]) for r in rows],
                            "idx": [int(r["index"]) for r in rows]},
                           pair_features("premise", "hypothesis", MNLI_HUB_LABELS))
    for split, hub_split in (("train", "train"), ("dev", "validation")):
        rows = _tsv_rows(FIXTURES / "qqp" / f"{split}.tsv")
        qqp[hub_split] = ({"question1": [r["question1"] for r in rows], "question2": [r["question2"] for r in rows],
                           "label": [int(r["is_duplicate"]) for r in rows], "idx": [int(r["id"]) for r in rows]},
                          pair_features("question1", "question2", QQP_HUB_LABELS))
    return {"mnli": mnli, "qqp": qqp}


def _squad_columns(path: Path) -> tuple[dict, None]:
    columns = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    for article in json.loads(path.read_text())["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa["answers"]
                columns["id"].append(qa["id"])
                columns["title"].append(article.get("title", ""))
                columns["context"].append(paragraph["context"])
                columns["question"].append(qa["question"])
                columns["answers"].append({"text": [a["text"] for a in answers],
                                           "answer_start": [a["answer_start"] for a in answers]})
    return columns, None


def _race_tables() -> dict:
    """race/all, race/middle and race/high from the directory tree, in the tree reader's order."""
    tables = {"all": {}, "middle": {}, "high": {}}
    for split, hub_split in (("train", "train"), ("dev", "validation"), ("test", "test")):
        rows = {name: {"example_id": [], "article": [], "answer": [], "question": [], "options": []}
                for name in tables}
        for level in ("middle", "high"):
            for path in sorted((FIXTURES / "race" / split / level).glob("*.txt")):
                record = json.loads(path.read_text())
                for question, options, answer in zip(record["questions"], record["options"], record["answers"]):
                    for name in ("all", level):
                        for column, value in (("example_id", record["id"]), ("article", record["article"]),
                                              ("answer", answer), ("question", question), ("options", options)):
                            rows[name][column].append(value)
        for name in tables:
            tables[name][hub_split] = (rows[name], None)
    return tables


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    """Local dataset repositories glue, squad, squad_v2 and race; the datasets cache in a temp dir."""
    import datasets

    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("hub")
    saved_cache = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = root / "cache"
    _write_repo(root / "glue", _glue_tables())
    _write_repo(root / "squad", {"plain_text": {"train": _squad_columns(FIXTURES / "squad1" / "train-v1.1.json"),
                                                "validation": _squad_columns(FIXTURES / "squad1" / "dev-v1.1.json")}})
    _write_repo(root / "squad_v2", {"squad_v2": {
        "train": _squad_columns(FIXTURES / "squad2" / "train-v2.0.json"),
        "validation": _squad_columns(FIXTURES / "squad2" / "dev-v2.0.json")}})
    _write_repo(root / "race", _race_tables())
    yield root
    datasets.config.HF_DATASETS_CACHE = saved_cache


def test_hub_names_split_into_dataset_and_configuration():
    assert split_hub_name("hub:glue/mnli", "mnli") == ("glue", "mnli")
    assert split_hub_name("hub:nyu-mll/glue/qqp", "qqp") == ("nyu-mll/glue", "qqp")
    assert split_hub_name("hub:race/all", "race") == ("race", "all")
    assert split_hub_name("hub:squad_v2", "squad") == ("squad_v2", None)
    assert split_hub_name("hub:rajpurkar/squad", "squad") == ("rajpurkar/squad", None)   # owner/name, no config
    assert split_hub_name("hub:/data/repos/glue/mnli/", "mnli") == ("/data/repos/glue", "mnli")
    with pytest.raises(ValueError, match="names no dataset; pass hub:NAME"):
        split_hub_name("hub:", "race")


def test_every_task_reads_the_hub_repository_as_its_original_layout(hub_root):
    assert read_mnli(f"hub:{hub_root}/glue/mnli") == read_mnli(FIXTURES / "mnli")
    assert read_qqp(f"hub:{hub_root}/glue/qqp") == read_qqp(FIXTURES / "qqp")
    squad1 = read_squad_dir(FIXTURES / "squad1")
    assert read_squad_dir(f"hub:{hub_root}/squad") == squad1 == read_squad_dir(f"hub:{hub_root}/squad/plain_text")
    squad2 = read_squad_dir(FIXTURES / "squad2")
    assert any(e.is_impossible for e in squad2["dev"])
    assert read_squad_dir(f"hub:{hub_root}/squad_v2") == squad2
    race = read_race(FIXTURES / "race")
    assert set(race) == {"train", "dev", "test"}
    assert read_race(f"hub:{hub_root}/race/all") == race
    assert read_race(f"hub:{hub_root}/race/high") == {
        split: [e for e in examples if e.level == "high"] for split, examples in race.items()}


def test_hub_errors_are_one_sentence(hub_root, tmp_path, capsys, monkeypatch):
    """Offline and not cached: one sentence naming the dataset and how to fetch it, exit 2; a
    configuration the dataset lacks, or none where it has several, names the dataset."""
    import datasets
    import huggingface_hub

    from zoo.cli.finetune import main

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pretrained = tmp_path / "bert"   # only its config is read before the data
    pretrained.mkdir()
    (pretrained / "config.json").write_text(json.dumps({
        "model_type": "megatron-bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}))
    with pytest.raises(SystemExit) as exit_:
        main("mnli", ["--deepspeed_config", str(Path(__file__).parent.parent / "ds_configs" / "finetune_cpu.json"),
                      "--pretrained", str(pretrained), "--data-dir", "hub:zoo-test-absent/glue/mnli",
                      "--save", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: hub dataset zoo-test-absent/glue/mnli is not in the local Hugging Face cache "
                          "and offline mode is on (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE); fetch it once"), err
    assert "datasets.load_dataset('zoo-test-absent/glue', 'mnli')" in err and err.count("\n") == 0
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=f"hub dataset {hub_root}/race has no configuration 'mnli'"):
        read_mnli(f"hub:{hub_root}/race/mnli")
    with pytest.raises(ValueError, match=f"hub dataset {hub_root}/glue needs a configuration .*; pass "
                                         f"hub:{hub_root}/glue/CONFIG"):
        read_mnli(f"hub:{hub_root}/glue")
