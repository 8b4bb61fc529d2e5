"""Every example command that a user reads parses: the ones in each command's ``--help`` (its description and its
flags' help), in each script's docstring and in the README. Each example's flags are flags of that script's own
parser (no abbreviation), each preset it names (``--model``, ``--bert-model``, a ds_config's zoo block, a flag's
"e.g." list) is a preset, and each repository file it names exists. The parsers are built in-process, as
``--help`` builds them."""

from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(path for folder in ("launch", "finetune") for path in (REPO / folder).glob("*.py"))
LAUNCHERS = ("python", "deepspeed", "torchrun")
REPO_FILE = re.compile(r"^(ds_configs|finetune/sweeps|launch|finetune)/[\w.-]+\.(json|yaml|py|sbatch)$")


def known_flags(parser) -> set[str]:
    """Every flag ``parser`` takes, aliases included."""
    return {flag for action in parser._actions for flag in action.option_strings}


def presets() -> set[str]:
    from zoo.models.families import FAMILIES

    return {name for family in FAMILIES for name in family.presets}


def shim_call(script: Path) -> tuple[str, list]:
    """The zoo.cli module a script's shim calls ``main`` from, and the constant arguments of that call."""
    tree = ast.parse(script.read_text())
    module = next(node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zoo.cli"))
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "main")
    return module, [ast.literal_eval(arg) for arg in call.args]


def parser_of(script: str):
    """The parser ``script`` (a path relative to the repository) builds, or None for launch/run.py (DeepSpeed's
    runner's arguments)."""
    if script == "launch/run.py":
        return None
    module, arguments = shim_call(REPO / script)
    return importlib.import_module(module).build_parser(*arguments)


def example_commands(text: str) -> list[list[str]]:
    """The command lines in ``text`` that start a script of launch/ or finetune/ (continuation lines joined,
    comments and ``<placeholders>`` dropped, optional ``[...]`` kept as flags), each as tokens."""
    joined = re.sub(r"\\\n\s*", " ", text.replace("\\\\\n", "\\\n"))
    lines = joined.splitlines() + re.findall(r"`([^`\n]+)`", joined)   # and the inline code of prose
    commands = []
    for line in lines:
        line = re.sub(r"<[^>]*>", "PLACEHOLDER", line.strip().lstrip("$ ")).replace("[", " ").replace("]", " ")
        line = re.sub(r"^(\w+=\S+\s+)+", "", line)   # environment assignments before the command
        if not line.startswith(LAUNCHERS):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        if any(REPO_FILE.match(token) and token.endswith(".py") for token in tokens):
            commands.append(tokens)
    return commands


def help_texts() -> list[tuple[str, str]]:
    """(where, text) of every script's --help (description and every flag's help), its docstring, and the README."""
    texts = [("README.md", (REPO / "README.md").read_text())]
    for script in SCRIPTS:
        name = str(script.relative_to(REPO))
        texts.append((f"{name} docstring", ast.get_docstring(ast.parse(script.read_text())) or ""))
        parser = parser_of(name)
        if parser is not None:
            texts.append((f"{name} --help", parser.format_help()))
            texts.append((f"{name} --help (flags)", "\n".join(a.help or "" for a in parser._actions)))
    return texts


def check_command(tokens: list[str]) -> list[str]:
    """What is wrong with one example: unknown flags of its script, unknown presets, missing files."""
    problems = []
    scripts = [i for i, token in enumerate(tokens) if REPO_FILE.match(token) and token.endswith(".py")]
    first = scripts[0]
    if tokens[first] == "launch/run.py" and len(scripts) > 1:   # zoo's launcher: the script it starts follows
        first = scripts[1]
    script, arguments = tokens[first], tokens[first + 1:]
    if not (REPO / script).is_file():
        return [f"{script} does not exist"]
    parser = parser_of(script)
    flags = set(known_flags(parser)) if parser is not None else set()
    for index, token in enumerate(arguments):
        if token.startswith("--") and token != "--help":
            flag = token.split("=", 1)[0]
            if parser is not None and flag not in flags:
                problems.append(f"{script} takes no flag {flag}")
            value = token.split("=", 1)[1] if "=" in token else (arguments[index + 1] if index + 1 < len(arguments)
                                                                 else "")
            if flag in ("--model", "--bert-model") and value not in presets():
                problems.append(f"{flag} {value} is not a preset")
    for token in tokens:
        if REPO_FILE.match(token) and "PLACEHOLDER" not in token and not (REPO / token).is_file():
            problems.append(f"{token} does not exist")
        if token.startswith("ds_configs/") and (REPO / token).is_file():
            model = json.loads((REPO / token).read_text()).get("zoo", {}).get("model")
            if model is not None and model not in presets():
                problems.append(f"{token} names the preset {model}, which does not exist")
    return problems


def test_every_example_in_the_help_and_the_readme_parses():
    """Each script has examples (a broken extraction would pass the checks vacuously); every example command's
    flags, presets and files exist; every preset a flag's help lists ("e.g. gpt2-medium, ...") exists."""
    texts = help_texts()
    commands = [(where, tokens) for where, text in texts for tokens in example_commands(text)]
    found = {next(t for t in tokens if REPO_FILE.match(t) and t.endswith(".py") and t != "launch/run.py")
             for _, tokens in commands if any(t.endswith(".py") and t != "launch/run.py" for t in tokens)}
    expected = {str(path.relative_to(REPO)) for path in SCRIPTS} - {"launch/run.py", "finetune/sweep.py"}
    assert expected <= found, sorted(expected - found)
    problems = [f"{where}: `{' '.join(tokens)}`: {problem}" for where, tokens in commands
                for problem in check_command(tokens)]
    named = [name.strip() for _, text in texts
             for example in re.findall(r"preset\b[^;]*?e\.g\. ([\w.,\s-]+)", text)
             for name in example.split(",") if name.strip()]
    assert named, "no preset example found in any help text"
    problems += [f"a help text names the preset {name}, which does not exist" for name in sorted(set(named) - presets())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("where", ["pretrain", "reshard"])
def test_layout_change_help_says_what_the_code_does(where):
    """Resuming at another layout writes nothing beside the checkpoint; the conversion's hint names the config
    its own help asks for."""
    from zoo.cli import pretrain, reshard

    if where == "pretrain":
        text = pretrain.build_parser().format_help()
        assert "resharded/" not in text and "pp" in text.split("Resume with --load")[1].split(".")[0]
    else:
        from pathlib import Path as P
        from types import SimpleNamespace

        line = reshard.conversion_line(
            SimpleNamespace(layout=(1, 2, 1), output=P("runs/demo-tp1pp2dp1")),
            {"tag": "iter_0000002", "iteration": 2, "consumed_samples": 16, "layout": "tp=2 x pp=1 x dp=1",
             "precision": "fp32", "seconds": 1.0, "peak_bytes": 2**20})
        assert line.endswith("--load runs/demo-tp1pp2dp1 --deepspeed_config runs/demo-tp1pp2dp1/config.json")
