"""The suite's own layout: no Python file under tests/ imports a test module (``tests.test_*``, ``from tests
import test_x``, a relative ``.test_x``) or the benchmarks. Support that several test modules share lives in
tests/helpers/ or tests/conftest.py, so each test module can be collected, run and changed on its own.

Every import counts, function-local ones included, and so does an import line inside a string (the driver
scripts that tests write to disk and launch import from the same places).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FORBIDDEN = re.compile(r"^(tests\.test_\w+|benchmarks)(\.|$)")
IMPORT_LINE = re.compile(r"^\s*(?:from\s+(\S+)\s+import\s+(.+)|import\s+(.+))$", re.MULTILINE)


def forbidden(module: str, names: list[str]) -> set[str]:
    """The test module or benchmark that ``from module import names`` (or ``import module``, ``names`` empty)
    imports: ``module`` itself when it is one, else those of its members that are."""
    if FORBIDDEN.match(module):
        return {module}
    return {f"{module}.{name}" for name in names if FORBIDDEN.match(f"{module}.{name}")}


def absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module of a ``from ... import`` in ``path`` (a relative one resolved from path's package)."""
    if not node.level:
        return node.module or ""
    package = list(path.parent.relative_to(TESTS.parent).parts)
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def names_of(text: str) -> list[str]:
    """The bare names of an import list: ``a as b, (c)`` -> [a, c]."""
    return [part.split(" as ")[0].strip(" ()") for part in text.split(",")]


def imports_in_strings(tree: ast.AST) -> set[str]:
    """Test modules and benchmarks named by import lines inside the string constants of ``tree``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for source, names, plain in IMPORT_LINE.findall(node.value):
                for module, members in ([(m, []) for m in names_of(plain)] if plain else [(source, names_of(names))]):
                    found |= forbidden(module, members)
    return found


def forbidden_imports(text: str, path: Path) -> set[str]:
    """Every test module or benchmark that the Python source ``text`` imports anywhere, read as file ``path``
    (bare ``import test_x`` counts when tests/test_x.py exists)."""
    tree = ast.parse(text, filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found |= forbidden(alias.name, [])
                if alias.name.startswith("test_") and (TESTS / f"{alias.name}.py").is_file():
                    found.add(f"tests.{alias.name}")
        elif isinstance(node, ast.ImportFrom):
            found |= forbidden(absolute(node, path), [alias.name for alias in node.names])
    return found | imports_in_strings(tree)


def test_no_file_under_tests_imports_a_test_module_or_the_benchmarks():
    """This file is left out: its examples below are strings that import test modules."""
    files = sorted(p for p in TESTS.rglob("*.py")
                   if "fixtures" not in p.relative_to(TESTS).parts and p != Path(__file__).resolve())
    assert len(files) > 50, files
    offenders = {str(p.relative_to(TESTS.parent)): sorted(found) for p in files
                 if (found := forbidden_imports(p.read_text(), p))}
    assert offenders == {}, offenders


def test_the_check_catches_every_form_of_the_import():
    """Absolute, from the package, relative (from tests/ and from tests/helpers/), bare, function-local, a
    benchmark, a driver script's string; and lets helpers, the spawn harness and look-alike names through."""
    in_tests, in_helpers = TESTS / "test_case.py", TESTS / "helpers" / "case.py"
    cases = [
        ("from tests.test_zero import MODEL", in_tests, {"tests.test_zero"}),
        ("import tests.test_zero as zero", in_tests, {"tests.test_zero"}),
        ("from tests import test_zero, helpers", in_tests, {"tests.test_zero"}),
        ("from .test_zero import MODEL", in_tests, {"tests.test_zero"}),
        ("from . import test_zero", in_tests, {"tests.test_zero"}),
        ("from .. import test_zero", in_helpers, {"tests.test_zero"}),
        ("import test_zero", in_tests, {"tests.test_zero"}),
        ("def f():\n    from benchmarks.bench_reshard import main", in_tests, {"benchmarks.bench_reshard"}),
        ("from benchmarks import bench_reshard", in_tests, {"benchmarks"}),
        ("DRIVER = '''\nimport sys\nfrom tests.test_pretrain import run_config\n'''", in_tests,
         {"tests.test_pretrain"}),
        ("from tests.helpers.pretraining import run_config\nfrom tests.spawn import spawn", in_tests, set()),
        ("from . import pretraining\nimport testing_tools\nimport benchmarking", in_helpers, set()),
    ]
    for source, path, want in cases:
        assert forbidden_imports(source, path) == want, source
