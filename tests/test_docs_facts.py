"""Facts the docs state, checked against the repository (issue 37): every repository path named in
the docs, in comments, docstrings and config files exists, and the lists of methods, config groups
and options that README.md and docs/ give equal the method registry and conf/."""

from __future__ import annotations

import ast
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


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / f for f in out.split() if (REPO / f).is_file()]


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
            if not any(c in ref for c in "*{}<>$") and not re.search(r"/[A-Z_]+(/|$)", ref):  # globs, NAME placeholders
                found.setdefault(ref, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_named_repository_path_exists() -> None:
    paths = named_paths()
    assert len(paths) > 50  # the scan finds the paths the docs name (a broken pattern would find none)
    stale = {p: sorted(by) for p, by in paths.items() if p not in NOT_REPOSITORY and not (REPO / p).exists()}
    assert not stale, "\n".join(f"{p}: named in {', '.join(by)}" for p, by in sorted(stale.items()))
