"""``--help`` puts each flag where a user looks for it: generate's sampling flags under "generation", each
finetune script lists only the flags its task reads, and every ``hub:`` example in a help text names a
dataset the README names."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from zoo.cli.finetune import build_parser as finetune_parser
from zoo.cli.generate import build_parser as generate_parser
from zoo.finetune.config import DEFAULT_MAX_SEQ_LENGTH, FinetuneConfig
from zoo.finetune.hub_names import split_hub_name

REPO = Path(__file__).resolve().parent.parent
TASKS = sorted(DEFAULT_MAX_SEQ_LENGTH)
SQUAD_ONLY = {"--doc-stride", "--max-query-length", "--squad-version"}
GENERATION_FLAGS = {"--prompt", "--prompt-file", "--batch-size", "--max-new-tokens", "--greedy", "--temperature",
                    "--top-k", "--top-p", "--seed", "--no-cache",
                    "--no-generation-config"}
HUB_TASKS = ("mnli", "qqp", "squad", "race")
HUB_NAME = re.compile(r"hub:([a-z0-9][\w.-]*(?:/[\w.-]+)*)")


def flags_by_group(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each --help group's title -> the option strings listed under it."""
    return {group.title: {flag for action in group._group_actions for flag in action.option_strings}
            for group in parser._action_groups}


def all_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_generate_lists_its_sampling_flags_under_generation_only():
    groups = flags_by_group(generate_parser())
    assert groups["generation"] == GENERATION_FLAGS
    assert not any(GENERATION_FLAGS & flags for title, flags in groups.items() if title != "generation")
    assert "training" not in groups and "data" not in groups   # nothing of generate's is training or data


@pytest.mark.parametrize("task", TASKS)
def test_each_finetune_script_accepts_only_its_tasks_flags(task):
    parser = finetune_parser(task)
    flags = all_flags(parser)
    if task == "squad":
        assert SQUAD_ONLY <= flags
    else:
        assert not SQUAD_ONLY & flags
        with pytest.raises(SystemExit):
            parser.parse_args(["--pretrained", "p", "--data-dir", "d", "--doc-stride", "64"])
    help_of = {action.dest: action.help for action in parser._actions}
    assert help_of["max_seq_length"] == f"tokens per example (default: {DEFAULT_MAX_SEQ_LENGTH[task]})"


def _hub_datasets(text: str) -> set[str]:
    """The datasets of the hub: names in ``text``, without a configuration of any task (hub:nyu-mll/glue/mnli ->
    nyu-mll/glue)."""
    return {min((split_hub_name("hub:" + name.rstrip("."), task)[0] for task in HUB_TASKS), key=len)
            for name in HUB_NAME.findall(text)}


def test_hub_examples_in_help_name_the_readmes_datasets():
    readme = (REPO / "README.md").read_text()
    readme_datasets = _hub_datasets(readme)
    assert {"nyu-mll/glue", "rajpurkar/squad_v2", "ehovy/race"} <= readme_datasets
    shown = {}
    for task in HUB_TASKS:
        helps = " ".join(action.help or "" for action in finetune_parser(task)._actions)
        shown[task] = _hub_datasets(helps)
        assert shown[task], f"finetune/{task}.py --help gives no hub: example"
    shown["all"] = _hub_datasets(FinetuneConfig.__dataclass_fields__["data_dir"].metadata["help"])
    assert all(datasets <= readme_datasets for datasets in shown.values()), (shown, readme_datasets)
