"""The package layers form a DAG, and no import cycle exists anywhere in zoo/.

Every import counts, function-local ones included: a function-local upward import is a cycle that
only waits for the function to be called. The layers, lowest first (a package may import its own
layer's package and any package of a lower layer; packages of one layer are independent):

    zoo.errors                                   (imports nothing from zoo: every layer raises its errors)
    zoo.atomic | zoo.dtypes | zoo.assets | zoo.options
    zoo.parallel | zoo.operations                (launching, the ranks' watch on it, stop reports, the run lock)
    zoo.distributed
    zoo.checkpoint.hf                            (transformers' directories, which the models read and write)
    zoo.models | zoo.data
    zoo.checkpoint | zoo.config                  (every other checkpoint kind; its __init__ imports nothing |
                                                  a run's configuration: RunConfig, DeepSpeed-key overrides)
    zoo.planning                                 (does a run fit, how long an iteration takes, FLOPs)
    zoo.training | zoo.eval | zoo.inference
    zoo.finetune | zoo.smoke
    zoo.cli                                      (every entry point's parse-and-run)
    scripts: launch/, finetune/, benchmarks/     (nothing in zoo imports them)

The scripts in launch/ and finetune/ are shims: a docstring, imports of zoo, and one call under
``if __name__ == "__main__":``; their logic lives in zoo, where it is tested.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[set[str]] = [
    {"zoo.errors"},
    {"zoo.atomic", "zoo.dtypes", "zoo.assets", "zoo.options"},
    {"zoo.parallel", "zoo.operations"},
    {"zoo.distributed"},
    {"zoo.checkpoint.hf"},
    {"zoo.models", "zoo.data"},
    {"zoo.checkpoint", "zoo.config"},
    {"zoo.planning"},
    {"zoo.training", "zoo.eval", "zoo.inference"},
    {"zoo.finetune", "zoo.smoke"},
    {"zoo.cli"},
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, as_module: str | None = None) -> set[str]:
    """Absolute names of the zoo modules ``path`` imports (relative imports resolved); ``as_module``
    names the file when it is read from elsewhere."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = as_module or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "zoo" or name.startswith("zoo.")}


def zoo_files() -> list[Path]:
    return sorted((ROOT / "zoo").rglob("*.py"))


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, the layer package) of a zoo module, or None for the root package itself."""
    for index, layer in enumerate(LAYERS):
        for package in layer:
            if module == package or module.startswith(package + "."):
                return index, package
    return None


def violations_of(path: Path, as_module: str | None = None) -> list[str]:
    """The imports of one file that do not go to a lower layer (or its own package)."""
    name = as_module or module_name(path)
    mine = layer_of(name)
    if mine is None:
        return []
    problems = []
    for imported in sorted(imports_of(path, as_module=name)):
        theirs = layer_of(imported)
        if theirs is not None and theirs[1] != mine[1] and theirs[0] >= mine[0]:
            problems.append(f"{name} imports {imported} ({theirs[1]} is not below {mine[1]})")
    return problems


def layer_violations(files: list[Path]) -> list[str]:
    return [problem for path in files for problem in violations_of(path)]


def import_cycle(files: list[Path], root: Path = ROOT) -> list[str] | None:
    """One import cycle among the modules of ``files`` (function-local imports count), or None."""
    known = {module_name(path, root) for path in files}
    graph = {}
    for path in files:
        me = module_name(path, root)
        targets = set()
        for name in imports_of(path, as_module=me):
            # "from zoo.x import y" names zoo.x.y: a module if it exists, else an attribute of zoo.x.
            while name not in known and "." in name:
                name = name.rpartition(".")[0]
            if name in known and name != me:
                targets.add(name)
        graph[me] = targets
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_zoo_package_has_a_layer():
    packages = {module_name(p).split(".")[1] for p in zoo_files() if module_name(p) != "zoo"}
    assert all(layer_of(f"zoo.{package}") for package in packages), packages


def test_layers_import_only_lower_layers():
    problems = layer_violations(zoo_files())
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    cycle = import_cycle(zoo_files())
    assert cycle is None, " -> ".join(cycle)


SCRIPT_DIRS = ("launch", "finetune", "benchmarks")
THIN_SCRIPT_DIRS = ("launch", "finetune")


def imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports, function-local imports included (relative ones as written)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def script_imports(path: Path) -> list[str]:
    """The imports of ``path`` that reach into a script folder (launch/, finetune/, benchmarks/)."""
    return sorted(name for name in imported_names(path) if name.split(".")[0] in SCRIPT_DIRS)


def thickness(path: Path) -> list[str]:
    """What makes a script more than a shim: a shim is a docstring, imports of ``sys`` and of zoo, and an
    ``if __name__ == "__main__":`` block of one call (``main(...)`` or ``sys.exit(main(...))``)."""
    problems = []
    body = ast.parse(path.read_text(), filename=str(path)).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for node in body:
        if isinstance(node, ast.Import) and all(alias.name in ("sys",) or alias.name.startswith("zoo.")
                                                for alias in node.names):
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("zoo", "__future__"):
            continue
        if (isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'" and not node.orelse
                and len(node.body) == 1 and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Call)):
            continue
        problems.append(f"{path.parent.name}/{path.name}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return problems


def test_zoo_never_imports_the_scripts():
    problems = {str(path.relative_to(ROOT)): script_imports(path) for path in zoo_files() if script_imports(path)}
    assert problems == {}


def test_launch_and_finetune_scripts_are_thin():
    scripts = [path for folder in THIN_SCRIPT_DIRS for path in sorted((ROOT / folder).glob("*.py"))]
    assert len(scripts) >= 10, scripts
    assert [problem for path in scripts for problem in thickness(path)] == []


@pytest.mark.parametrize("text, reaches", [("from finetune.squad import x\n", ["finetune.squad"]),
                                           ("def f():\n    import launch.pretrain\n", ["launch.pretrain"]),
                                           ("from zoo.finetune import finetune_job\n", [])])
def test_the_script_check_parses_imports(tmp_path, text, reaches):
    """A script import is found wherever it is written, and zoo.finetune is not the finetune/ folder."""
    path = tmp_path / "module.py"
    path.write_text(text)
    assert script_imports(path) == reaches


@pytest.mark.parametrize("extra", ["def helper():\n    return 1\n", "import argparse\n", "ARGS = 3\n",
                                   "if __name__ == '__main__':\n    print(1)\n    main()\n"])
def test_the_thinness_check_catches_logic(tmp_path, extra):
    """The thinness check is not vacuous: a function, an unrelated import, a constant or a second statement
    under ``__main__`` added to a shim is reported."""
    original = ROOT / "launch" / "pretrain.py"
    copy = tmp_path / "pretrain.py"
    copy.write_text(original.read_text() + "\n" + extra)
    assert thickness(original) == [] and thickness(copy) != [], extra


@pytest.mark.parametrize("upward", ["from zoo.training.pretrain import pretrain",
                                    "def f():\n    from zoo.finetune import finetune_job\n"])
def test_the_contract_catches_an_upward_import(tmp_path, upward):
    """The check is not vacuous: an upward import added to a checkpoint module is reported."""
    original = ROOT / "zoo" / "checkpoint" / "files.py"
    copy = tmp_path / "files.py"
    copy.write_text(original.read_text() + "\n" + upward + "\n")
    problems = violations_of(copy, as_module=module_name(original))
    assert any("is not below zoo.checkpoint" in problem for problem in problems), problems


def test_the_cycle_check_catches_a_cycle(tmp_path):
    """The cycle search is not vacuous: two modules importing each other at top level are found."""
    package = tmp_path / "zoo" / "pkg"
    package.mkdir(parents=True)
    (package / "a.py").write_text("from zoo.pkg import b\n")
    (package / "b.py").write_text("def f():\n    import zoo.pkg.a\n")
    files = sorted(package.glob("*.py"))
    cycle = import_cycle(files, root=tmp_path)
    assert cycle is not None and set(cycle) == {"zoo.pkg.a", "zoo.pkg.b"}


def unresolved_imports(path: Path) -> list[str]:
    """The modules ``path`` imports from zoo (``from zoo.x import y``, ``import zoo.x``, function-local ones
    included) that are no module or package under zoo/: an import left behind by a move fails only when run."""
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "zoo":
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "zoo"]
        else:
            continue
        for name in names:
            target = ROOT.joinpath(*name.split("."))
            if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    return missing


def test_every_zoo_import_names_a_module():
    files = zoo_files() + [path for folder in (*SCRIPT_DIRS, "tests") for path in sorted((ROOT / folder).rglob("*.py"))]
    problems = [problem for path in files for problem in unresolved_imports(path)]
    assert not problems, "\n".join(problems)
