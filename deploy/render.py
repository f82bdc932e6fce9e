"""Write the manifests of a winner to a directory: one stable YAML file per object + kustomization.yaml.

Byte-identical output for the same input (CI diffs it): keys keep the models' fixed order, no
line wrapping, no timestamps except the provenance date that comes from best.yaml.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from deploy.manifests import Plan
from deploy.platforms import build, readme
from deploy.winner import WinnerOverride
from tuner.schema.config import BestResult, Config, UserError

HEADER = "# Rendered by `tuner render` (spectune). Change the config and re-render rather than editing.\n"
KUSTOMIZATION = "kustomization.yaml"
README = "README.md"  # beside the manifests: what they are and what the cluster must already have


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's YAML files) as readable literal blocks."""


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def dump(doc: dict, comments: Mapping[tuple, str] | None = None) -> str:
    """One document as stable YAML (no wrapping: long engine flags stay on one line). `comments`:
    key path (mapping keys, list indices) -> text, written as `# text` at the end of that value's
    line (a mapping or list value: its key's line); the empty path's text goes above the document."""
    text = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=10**6, allow_unicode=True)
    if not comments:
        return text
    lines = text.splitlines()
    root = yaml.compose(text, Loader=yaml.SafeLoader)  # the emitted text's own nodes: their line numbers
    for path, note in comments.items():
        if path:
            line = _line_of(root, path)
            lines[line] += f"  # {note}"
    head = comments.get(())
    top = "".join(f"# {ln}".rstrip() + "\n" for ln in head.splitlines()) if head else ""
    return top + "\n".join(lines) + "\n"


def _line_of(node: yaml.Node, path: tuple) -> int:
    """The line of the value at `path` in a composed document (its key's line for a collection)."""
    line = node.start_mark.line
    for part in path:
        if isinstance(node, yaml.MappingNode):
            pair = next((kv for kv in node.value if kv[0].value == str(part)), None)
            if pair is None:
                raise KeyError(f"no key {part!r} on the path {path}")
            line, node = pair[0].start_mark.line, pair[1]
        elif isinstance(node, yaml.SequenceNode):
            node = node.value[part]
            line = node.start_mark.line
        else:
            raise KeyError(f"{path}: {part!r} under a scalar")
    if isinstance(node, yaml.ScalarNode) and node.end_mark.line == node.start_mark.line:
        return node.start_mark.line
    return line


def load_best(path: Path) -> BestResult:
    """Read and validate a run's best.yaml."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (a run directory of `tuner optimize` holds best.yaml)")
    try:
        return BestResult.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as err:
        e = err.errors()[0]
        raise UserError(f"{path}: {'.'.join(str(x) for x in e['loc'])}: {e['msg']}") from None


def kustomization(files: list[str]) -> dict:
    """kustomization.yaml listing every rendered file, so `kubectl apply -k DIR` works."""
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": files}


def render(cfg: Config, best: BestResult | None, out: Path,
           override: WinnerOverride | None = None) -> tuple[Plan, list[Path]]:
    """Build and write all manifests (deploy.platforms.build) and README.md into `out` (created).
    Files an earlier render wrote that this
    one does not (e.g. hpa.yaml after deploy.hpa.enabled=false) are removed; other files are kept.
    `override`: serve the winner with spec.* overrides applied (deploy.winner.served_spec)."""
    r = build(cfg, best, override)
    new = not out.exists()
    try:
        files = write_docs(r.docs, out, comments=r.comments)
        (out / README).write_text(readme(r, list(r.plan.prerequisites)))
    except BaseException:
        # a render into a new directory that is interrupted (Ctrl-C) or fails while writing leaves
        # nothing: a half-written set of manifests must not be there to `kubectl apply -k`
        if new and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise
    return r.plan, files


def out_arg(text: str | None) -> Path | None:
    """An `--out` value of the command line as a Path (None: not given). An empty one is refused:
    Path('') is the current directory, where a render would land unasked."""
    if text is None:
        return None
    if not text.strip():
        raise UserError(f"--out {text!r}: an empty path; give the output directory, e.g. --out k8s/prod")
    return Path(text)


def make_out_dir(out: Path) -> None:
    """Create the output directory `out` (and its parents), or say in one line why it cannot be."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is an existing file, not a directory; give a directory (created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "a parent is a file, not a directory" if isinstance(exc, (FileExistsError, NotADirectoryError)) \
            else (exc.strerror or type(exc).__name__).lower()
        raise UserError(f"--out {out}: cannot create the output directory ({why})") from None


def write_docs(docs: list[tuple[str, dict]], out: Path, header: str = HEADER,
               comments: Mapping[str, Mapping[tuple, str]] | None = None) -> list[Path]:
    """Write (file name, document) pairs and a kustomization.yaml listing them into `out`, removing
    rendered files (starting with `header`) that are no longer part of the set. `comments`: per
    file name, the YAML comments of dump()."""
    make_out_dir(out)
    files = docs + [(KUSTOMIZATION, kustomization([n for n, _ in docs]))]
    names = {n for n, _ in files}
    for old in out.glob("*.yaml"):
        if old.name not in names and old.read_text().startswith(header):
            old.unlink()
    written = []
    for name, doc in files:
        path = out / name
        try:
            path.write_text(header + dump(doc, (comments or {}).get(name)))
        except OSError as exc:
            raise UserError(f"--out {out}: cannot write {name} ({(exc.strerror or type(exc).__name__).lower()})") from None
        written.append(path)
    return written
