"""The layering of the three packages, read from the source with `ast` (nothing is imported).

Layers, bottom up: the ground (`tuner.schema`: the config schema, its composition, the method
registry, fit and flags) imports nothing else of the project; `engine` and `deploy` import only
the ground (deploy never imports engine, so manifests render without torch); the tuner library
(`tuner.search`, `tuner.study`, `tuner.projection`, `tuner.report`) imports the ground, engine and
deploy; the command line (`tuner.cli`) sits on top and nothing imports it. Function-local imports
count, and no import cycle is allowed among modules. The engine reads only its own settings: no
engine module names the whole `Config` or reads a config's `search` / `deploy` sections (the tuner
turns those into explicit arguments).

`python tests/test_architecture.py` prints the package-level import arrows.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def layer(mod: str) -> str:
    """The layer a module belongs to: ground, engine, deploy, tuner (the library) or cli."""
    if mod == "tuner.schema" or mod.startswith("tuner.schema."):
        return "ground"
    if mod == "tuner.cli" or mod.startswith("tuner.cli."):
        return "cli"
    return mod.split(".")[0]


# layer -> the layers it may import (besides itself)
ALLOWED = {"ground": set(), "engine": {"ground"}, "deploy": {"ground"},
           "tuner": {"ground", "engine", "deploy"}, "cli": {"ground", "engine", "deploy", "tuner"}}


def violations(g: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layering rules of the module docstring."""
    bad = []
    for mod, deps in sorted(g.items()):
        for dep in sorted(deps):
            a, b = layer(mod), layer(dep)
            if a != b and b not in ALLOWED.get(a, set()):
                bad.append(f"{mod} -> {dep}: {a} imports {b}")
    return bad


def arrows(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package-level import arrows: unit -> the other units it imports. A unit is a subpackage
    (tuner.study, engine.decode), or the top package for its own top-level modules (engine.api)."""
    pkgs = {m.rpartition(".")[0] for m in g}

    def unit(mod: str) -> str:
        two = ".".join(mod.split(".")[:2])
        return two if two in pkgs else mod.split(".")[0]

    out: dict[str, set[str]] = {}
    for mod, deps in g.items():
        out.setdefault(unit(mod), set()).update(unit(d) for d in deps if unit(d) != unit(mod))
    return out


# What only the tuner may read: the whole config, and the sections about the search and the deployment.
WHOLE_CONFIG = "Config"
TUNER_SECTIONS = ("search", "deploy")
CONFIG_NAMES = ("cfg", "config")


def config_reads(root: Path = ROOT, package: str = "engine") -> list[str]:
    """Every place in `package` that names the top-level Config type (imported, annotated, called)
    or reads cfg.search / cfg.deploy: 'module:line: what'."""
    found = []
    for name, path in modules(root, (package,)).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tuner"):
                hit = [a.name for a in node.names if a.name == WHOLE_CONFIG]
            elif isinstance(node, ast.Name):
                hit = [node.id] if node.id == WHOLE_CONFIG else []
            elif isinstance(node, ast.Attribute) and node.attr in TUNER_SECTIONS:
                base = node.value
                hit = [f"{base.id}.{node.attr}"] if isinstance(base, ast.Name) and base.id in CONFIG_NAMES else []
            else:
                hit = []
            found += [f"{name}:{node.lineno}: {h}" for h in hit]
    return sorted(found)


def write_tree(root: Path, files: dict[str, str]) -> None:
    """A made-up source tree under root: path -> text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_no_import_cycle() -> None:
    g = graph()
    assert {"tuner.run.session", "engine.decode.loop", "deploy.render"} <= set(g)  # the walk saw the packages
    assert cycles(g) == []


def test_layering() -> None:
    assert violations(graph()) == []


def test_no_cycle_among_packages() -> None:
    """The subpackages form a one-way graph too (engine.decode -> engine.drafters -> engine.trees)."""
    assert cycles(arrows(graph())) == []


def test_the_checks_catch_a_cycle_and_each_forbidden_import(tmp_path: Path) -> None:
    files = {
        "tuner/__init__.py": "",
        "tuner/schema/__init__.py": "",
        "tuner/schema/config.py": "",
        "tuner/schema/s.py": "import engine.m\n",
        "tuner/a.py": "def f():\n    from tuner import b\n",  # function-local imports count
        "tuner/b.py": "from tuner.a import f\nimport tuner.cli.x\n",
        "tuner/cli/__init__.py": "",
        "tuner/cli/x.py": "from tuner import a\n",
        "engine/__init__.py": "",
        "engine/m.py": "from tuner.schema.config import X\nfrom tuner.a import f\n",
        "engine/sub/__init__.py": "from .n import y\n",
        "engine/sub/n.py": "from . import y\n",
        "deploy/__init__.py": "",
        "deploy/r.py": "import engine.m\n",
    }
    write_tree(tmp_path, files)
    g = graph(tmp_path)
    assert g["engine.sub.n"] == {"engine.sub"} and g["engine.sub"] == {"engine.sub.n"}
    assert cycles(g) == [["engine.sub", "engine.sub.n"], ["tuner.a", "tuner.b", "tuner.cli.x"]]
    assert violations(g) == [
        "deploy.r -> engine.m: deploy imports engine",
        "engine.m -> tuner.a: engine imports tuner",
        "tuner.b -> tuner.cli.x: tuner imports cli",
        "tuner.schema.s -> engine.m: ground imports engine",
    ]
    assert arrows(g)["engine"] == {"tuner", "tuner.schema"}


def test_the_engine_reads_only_its_own_settings() -> None:
    """Entry points of the engine take its sub-configs and explicit arguments (the prompts, the
    precision, the seed), never the whole Config: which prompts and which precision is the tuner's call."""
    assert config_reads() == []


def test_the_config_check_catches_each_kind_of_read(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": "",
        "engine/a.py": "from tuner.schema.config import Config, ModelConfig\n",
        "engine/b.py": "def f(cfg: 'x', model: ModelConfig) -> Config:\n    return cfg.search.n + cfg.deploy.port\n",
        "engine/c.py": "import re\nimport uvicorn\nre.search('a', 'b')\nuvicorn.Config(app)\ncfg.model.name\n",
    }
    write_tree(tmp_path, files)
    assert config_reads(tmp_path) == ["engine.a:1: Config", "engine.b:1: Config", "engine.b:2: cfg.deploy",
                                      "engine.b:2: cfg.search"]


def test_no_two_modules_share_a_name() -> None:
    """One concept, one module name: an `eagle.py` directly in engine/ beside `engine/drafters/eagle.py` is what this stops."""
    names = [p.name for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []


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


if __name__ == "__main__":
    for src, dsts in sorted(arrows(graph()).items()):
        print(f"{src:<18} -> {', '.join(sorted(dsts)) or '-'}")
