"""Facts the docs state, checked against the repository (issue 37): every repository path named in
the docs, in comments, docstrings and config files exists, and the lists of methods, config groups
and options that README.md and docs/ give equal the method registry and conf/."""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from tuner.schema.compose import GROUPS, available, default_groups
from tuner.schema.methods import METHOD_NAMES

REPO = Path(__file__).resolve().parents[1]
TOP = ("tuner", "engine", "deploy", "conf", "docs", "tests", "benchmarks", "scripts", "k8s")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[A-Za-z0-9_./-]*[A-Za-z0-9_])")
# Named paths that are not files of this repository: conf/ as an installed wheel holds it, and the
# output directories that examples render into.
NOT_REPOSITORY = {"tuner/conf", "k8s/prod", "k8s/chat", "deploy/manifests/production"}
TEXT_FILES = (".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".txt")


@functools.cache
def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / f for f in out.split() if (REPO / f).is_file()]


@functools.cache
def prose_of_python(source: str) -> str:
    """A Python file's comments and docstrings (its code strings may name paths that tests create)."""
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def named_paths() -> dict[str, set[str]]:
    """Repository paths named in prose, and the files naming them."""
    found: dict[str, set[str]] = {}
    for path in tracked():
        name = path.name
        if path.suffix == ".py":
            text = prose_of_python(path.read_text())
        elif path.suffix in TEXT_FILES or name == "Makefile" or name.startswith("Dockerfile"):
            text = path.read_text()
        else:
            continue
        for m in PATH.finditer(text):
            ref = m.group(1).rstrip(".")
            if not any(c in ref for c in "*{}<>$") and not re.search(r"/[A-Z_]+(\.\w+)?(/|$)", ref):  # globs, NAME placeholders
                found.setdefault(ref, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_named_repository_path_exists() -> None:
    paths = named_paths()
    assert len(paths) > 50  # the scan finds the paths the docs name (a broken pattern would find none)
    stale = {p: sorted(by) for p, by in paths.items() if p not in NOT_REPOSITORY and not (REPO / p).exists()}
    assert not stale, "\n".join(f"{p}: named in {', '.join(by)}" for p, by in sorted(stale.items()))


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_method_list_names_the_registry() -> None:
    """A list of methods (`off | ngram | ...` in the docs, `# off | ngram | ...` in conf/) names every
    method of tuner.schema.methods; a list without `off` is of searched methods (off is trial 0)."""
    lists = []
    for page in doc_pages():
        lists += [(page, m.group(1)) for m in re.finditer(r"`([a-z_0-9]+(?:\s*\|\s*[a-z_0-9]+)+)`", page.read_text())]
    for conf in sorted((REPO / "conf").rglob("*.yaml")):
        lists += [(conf, m.group(1)) for m in re.finditer(r"#\s*([a-z_0-9]+(?: \| [a-z_0-9]+)+)", conf.read_text())]
    methods = [(where, [w.strip() for w in text.split("|")]) for where, text in lists if "ngram" in text]
    assert len(methods) >= 4, methods
    for where, names in methods:
        want = set(METHOD_NAMES) if "off" in names else set(METHOD_NAMES) - {"off"}
        assert set(names) == want, f"{where.relative_to(REPO)}: {' | '.join(names)} (registry: {', '.join(METHOD_NAMES)})"


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of a Markdown table's rows, below the header row that starts with `header`."""
    lines = text[text.index(header):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_readme_groups_and_options_are_conf() -> None:
    """README's table of config groups lists every group of conf/ with exactly its options, and marks
    the option conf/config.yaml selects by default."""
    import yaml

    rows = _table((REPO / "README.md").read_text(), "| group | options |")
    table = {re.sub(r"[`+]", "", group): cell for group, cell in rows}
    assert set(table) == set(GROUPS)
    defaults = {next(iter(d)): next(iter(d.values())) for d in
                yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["defaults"] if isinstance(d, dict)}
    assert set(defaults) == default_groups()
    for group, cell in table.items():
        names = [n for n in re.findall(r"`([^`]+)`", cell) if "=" not in n]
        assert sorted(names) == available(group), f"README, group {group}: {names} (conf/{group}: {available(group)})"
        marked = re.findall(r"`([^`]+)` \(default", cell)
        assert marked == ([defaults[group]] if group in defaults else []), f"README, group {group}: default {marked}"


@pytest.mark.parametrize("option", ["default", "quick", "grid"])
def test_optimize_search_table_is_conf(option: str) -> None:
    """docs/optimize.md's table of the packaged searches states each option's composed values."""
    from tuner.schema.compose import load_config

    rows = _table((REPO / "docs" / "optimize.md").read_text(), "| key | default | quick | grid |")
    column = ["default", "quick", "grid"].index(option) + 1
    search = load_config([f"search={option}"]).search
    assert len(rows) >= 8
    for row in rows:
        key, cell = row[0].strip("`"), row[column].strip("`")
        value = getattr(search, key)
        if key == "depth":
            assert cell == f"{value.min}-{value.max}", (option, key, cell)
        elif isinstance(value, list):
            assert cell == f"[{', '.join(map(str, value))}]", (option, key, cell, value)
        elif isinstance(value, bool):
            assert cell == str(value).lower(), (option, key, cell, value)
        else:
            assert float(cell) == float(value) if not isinstance(value, str) else cell == value, (option, key, cell, value)


# A measured figure: a time, a rate or a before -> after.
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|us|µs|GB/s|MB/s|tok/s)\b|\b\d+(?:\.\d+)?\s*(?:->|→)\s*\d")


def test_no_measured_figures_in_docstrings_or_comments() -> None:
    """Figures go to docs/results.md, where their machine and date are; code says why without them."""
    found = []
    for path in tracked():
        rel = str(path.relative_to(REPO))
        if path.suffix != ".py" or rel.startswith(("tests/", "benchmarks/")):
            continue
        for line in prose_of_python(path.read_text()).splitlines():
            if FIGURE.search(line):
                found.append(f"{rel}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_group_option_the_docs_name_exists() -> None:
    """`hardware=h100x8`, `+workload=code`, ... in README.md and docs/: each names an option conf/ has."""
    named = re.compile(rf"(?<![\w.])\+?({'|'.join(GROUPS)})=([a-z0-9][a-z0-9.-]*[a-z0-9])")
    wrong, seen = [], 0
    for page in doc_pages():
        for m in named.finditer(page.read_text()):
            group, option = m.groups()
            seen += 1
            if option not in available(group):
                wrong.append(f"{page.relative_to(REPO)}: {group}={option} (conf/{group}: {', '.join(available(group))})")
    assert seen > 30 and not wrong, "\n".join(wrong)
