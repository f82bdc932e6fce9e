"""Strict offline validation of manifests: Kubernetes kinds with kubernetes-validate, CRDs with vendored schemas.

Every problem becomes one line `FILE: Kind/name: path: message`, so CI output points at the field.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, VersionNotSupportedError

from tuner.schema.config import UserError

# (apiVersion, kind) -> JSON schema under deploy/schemas/ (CRDs kubernetes-validate does not know). No
# package on PyPI ships these CRDs' schemas: each file is written for spectune from the fields its
# CRD documents (named in its description), strict (unknown fields rejected).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("serving.kserve.io/v1alpha2", "LLMInferenceService"): "llminferenceservice.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.json",
}
# Pod specs inside CRD objects: checked, strictly, by the Kubernetes schema of the version (as a
# PodTemplate's template), as the API server checks the core types a CRD embeds.
EMBEDDED: dict[tuple[str, str], list[tuple[tuple[str, ...], str]]] = {
    ("serving.kserve.io/v1alpha2", "LLMInferenceService"): [(("spec", "template"), "PodSpec"),
                                                            (("spec", "worker"), "PodSpec")],
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): [
        (("spec", "leaderWorkerTemplate", "leaderTemplate"), "PodTemplateSpec"),
        (("spec", "leaderWorkerTemplate", "workerTemplate"), "PodTemplateSpec")],
}
KUSTOMIZATION = "kustomization.yaml"


@cache
def _crd_validator(file: str) -> jsonschema.protocols.Validator:
    schema = json.loads(resources.files("deploy").joinpath("schemas", file).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _where(err: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path).lstrip(".")
    return f"{path or '(root)'}: {err.message}"


def doc_error(doc: object, version: str) -> str | None:
    """Why `doc` is not a valid object for Kubernetes `version` (strict), or None when it is."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return "not a Kubernetes object (needs apiVersion and kind)"
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        errors = sorted(_crd_validator(crd).iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            return _where(errors[0])
        return _embedded_error(doc, version)
    return _core_error(doc, version)


def _embedded_error(doc: dict, version: str) -> str | None:
    """Why a pod spec embedded in a CRD object is invalid for Kubernetes `version`, or None."""
    for path, kind in EMBEDDED.get((doc["apiVersion"], doc["kind"]), []):
        node: object = doc
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        template = {"spec": node} if kind == "PodSpec" else node
        err = _core_error({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "embedded"},
                           "template": template}, version)
        if err is not None:  # the PodTemplate's path, said as the CRD object's
            where, _, message = err.partition(": ")
            inner = where.removeprefix("template.spec" if kind == "PodSpec" else "template").lstrip(".")
            return f"{'.'.join(path)}{'.' + inner if inner else ''}: {message}"
    return None


def _core_error(doc: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except VersionNotSupportedError:
        raise UserError(f"deploy.k8s_version={version}: not supported by kubernetes-validate") from None
    except SchemaNotFoundError:
        return f"no schema for {doc['apiVersion']} {doc['kind']} in Kubernetes {version}"
    except jsonschema.ValidationError as err:
        return _where(err)
    return server_rule_error(doc)


def server_rule_error(doc: dict) -> str | None:
    """What the API server refuses although the OpenAPI schema allows it: a name that is no DNS name
    (a Service's must be a DNS-1035 label, other objects' a DNS-1123 subdomain), and a
    PodDisruptionBudget with both minAvailable and maxUnavailable."""
    from tuner.schema.config import name_error

    name = (doc.get("metadata") or {}).get("name")
    if isinstance(name, str):
        error = (name_error("metadata.name", name, "service") if doc["kind"] == "Service"
                 else name_error("metadata.name", name, "subdomain", 253))
        if error:
            return error
    spec = doc.get("spec") or {}
    if doc["kind"] == "PodDisruptionBudget" and "minAvailable" in spec and "maxUnavailable" in spec:
        return "spec: minAvailable and maxUnavailable are mutually exclusive (a PodDisruptionBudget takes one)"
    return None


def _ident(doc: object) -> str:
    if isinstance(doc, dict):
        name = (doc.get("metadata") or {}).get("name", "?")
        return f"{doc.get('kind', '?')}/{name}"
    return "?"


def check_docs(docs: list[tuple[str, dict]], version: str) -> list[str]:
    """One line per invalid document: `FILE: Kind/name: path: message`."""
    lines = []
    for file, doc in docs:
        err = doc_error(doc, version)
        if err is not None:
            lines.append(f"{file}: {_ident(doc)}: {err}")
    return lines


def load_dir(directory: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """Documents of a manifest directory and the problems reading them.

    With a kustomization.yaml, its `resources` in their order (what `kubectl apply -k` applies);
    without one, every .yaml / .yml file in name order.
    """
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory}: a file, not a directory of manifests (give the directory `tuner render` wrote)")
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    docs, problems = [], []
    kust = directory / KUSTOMIZATION
    if kust.is_file():
        try:
            listed = (yaml.safe_load(kust.read_text()) or {}).get("resources", [])
        except yaml.YAMLError as err:
            return [], [yaml_problem(KUSTOMIZATION, err)]
        problems += [f"{KUSTOMIZATION}: resource {r} does not exist" for r in listed if not (directory / r).is_file()]
        files = [directory / r for r in listed if (directory / r).is_file()]
    else:
        files = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml"))
    if not files and not problems:
        raise UserError(f"{directory}: no .yaml manifests to check")
    for path in files:
        try:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    docs.append((path.name, doc))
        except yaml.YAMLError as err:
            problems.append(yaml_problem(path.name, err))
    return docs, problems


def yaml_problem(name: str, err: yaml.YAMLError) -> str:
    """One line for a file PyYAML cannot read: where (line and column, 1-based) and what, with the
    cause a hand edit most often has (a tab, which YAML never allows for indentation)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is not None and mark.buffer and mark.pointer < len(mark.buffer) and mark.buffer[mark.pointer] == "\t":
        problem += " (a tab: YAML indents with spaces only)"
    return f"{name}: not valid YAML{where}: {problem}"


def check_dir(directory: Path, version: str) -> list[str]:
    """Validate every manifest in `directory` strictly for Kubernetes `version`; return error lines."""
    docs, problems = load_dir(directory)
    return problems + check_docs(docs, version)
