"""The layering of the three packages, read from the source with `ast` (nothing is imported):

- no import cycle among the modules of tuner, engine and deploy (function-local imports count);
- no library module imports a command-line module (`tuner.cli`, `tuner.cli_*`): the CLI is thin
  over the library, never the other way round;
- deploy never imports engine (manifests render without torch);
- engine imports nothing of tuner but tuner.schema (the one config schema).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tuner", "engine", "deploy")


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the packages under root."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # `from pkg import mod` imports the submodule; `from mod import name` the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a non-module attribute: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


def is_cli(mod: str) -> bool:
    return mod == "tuner.cli" or mod.startswith("tuner.cli_")


def violations(g: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layering rules of the module docstring."""
    bad = []
    for mod, deps in sorted(g.items()):
        for dep in sorted(deps):
            if is_cli(dep) and not is_cli(mod):
                bad.append(f"{mod} -> {dep}: library code imports the command line")
            if mod.split(".")[0] == "deploy" and dep.split(".")[0] == "engine":
                bad.append(f"{mod} -> {dep}: deploy imports engine")
            if mod.split(".")[0] == "engine" and dep.split(".")[0] == "tuner" and dep != "tuner.schema":
                bad.append(f"{mod} -> {dep}: engine imports tuner beyond tuner.schema")
    return bad


def test_no_import_cycle() -> None:
    g = graph()
    assert {"tuner.optimize", "engine.loop", "deploy.render"} <= set(g)  # the walk saw the packages
    assert cycles(g) == []


def test_layering() -> None:
    assert violations(graph()) == []


def test_the_checks_catch_a_cycle_and_each_forbidden_import(tmp_path: Path) -> None:
    files = {
        "tuner/__init__.py": "",
        "tuner/schema.py": "",
        "tuner/a.py": "def f():\n    from tuner import b\n",  # function-local imports count
        "tuner/b.py": "from tuner.a import f\nimport tuner.cli_x\n",
        "tuner/cli_x.py": "from tuner import a\n",
        "engine/__init__.py": "",
        "engine/m.py": "from tuner.schema import X\nfrom tuner.a import f\n",
        "engine/sub/__init__.py": "from .n import y\n",
        "engine/sub/n.py": "from . import y\n",
        "deploy/__init__.py": "",
        "deploy/r.py": "import engine.m\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = graph(tmp_path)
    assert g["engine.sub.n"] == {"engine.sub"} and g["engine.sub"] == {"engine.sub.n"}
    assert cycles(g) == [["engine.sub", "engine.sub.n"], ["tuner.a", "tuner.b", "tuner.cli_x"]]
    assert violations(g) == [
        "deploy.r -> engine.m: deploy imports engine",
        "engine.m -> tuner.a: engine imports tuner beyond tuner.schema",
        "tuner.b -> tuner.cli_x: library code imports the command line",
    ]


def test_no_file_cites_a_design_file_users_do_not_get() -> None:
    """The project's design doc is docs/design.md; nothing may point elsewhere."""
    import subprocess

    import pytest

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    needles = [("DESIGN" + ".md").encode(), ("../" + "shared").encode()]
    hits = [name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).is_file()
            and any(n in (ROOT / name).read_bytes() for n in needles)]
    assert hits == []
