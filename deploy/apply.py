"""Server-side apply of rendered manifests through the `kubernetes` client.

Each object is one PATCH with content type `application/apply-patch+yaml`, `fieldManager=spectune`,
`force=true` (spectune owns the fields it renders) and `fieldValidation=Strict`; `--dry-run` adds
`dryRun=All`. Namespaces go first (created when absent). Applying the same files twice changes
nothing: server-side apply is idempotent by construction.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client as k
from kubernetes import config as kconfig

from deploy.validate import load_dir
from tuner.schema.config import UserError

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
FIELD_MANAGER = "spectune"
# kind -> (plural, namespaced) for every kind spectune renders; other kinds are refused.
KINDS = {
    "Namespace": ("namespaces", False),
    "ConfigMap": ("configmaps", True),
    "PersistentVolumeClaim": ("persistentvolumeclaims", True),
    "Service": ("services", True),
    "Deployment": ("deployments", True),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "HorizontalPodAutoscaler": ("horizontalpodautoscalers", True),
    "ServiceMonitor": ("servicemonitors", True),
    "PrometheusRule": ("prometheusrules", True),
    "LLMInferenceService": ("llminferenceservices", True),
    "LeaderWorkerSet": ("leaderworkersets", True),
    "ScaledObject": ("scaledobjects", True),
    "InferencePool": ("inferencepools", True),
    "HTTPRoute": ("httproutes", True),
    "Job": ("jobs", True),
    "StatefulSet": ("statefulsets", True),
    "Secret": ("secrets", True),
    "ServiceAccount": ("serviceaccounts", True),
}


@dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    namespace: str | None
    status: int  # HTTP status: 201 created, 200 applied to an existing object
    note: str = ""

    def line(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""
        what = "created" if self.status == 201 else "applied"
        return f"{self.kind} {where}{self.name} {what}{f' ({self.note})' if self.note else ''}"


def resource_path(doc: dict) -> str:
    """The REST path of one object: /api/v1/... for the core group, /apis/GROUP/VERSION/... otherwise."""
    kind, api_version = doc.get("kind"), doc.get("apiVersion", "")
    if kind not in KINDS:
        raise UserError(f"kind {kind}: not supported by tuner apply (supported: {', '.join(sorted(KINDS))})")
    plural, namespaced = KINDS[kind]
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise UserError(f"{kind} without metadata.name cannot be applied")
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced:
        ns = meta.get("namespace")
        if not ns:
            raise UserError(f"{kind}/{name}: metadata.namespace is required (namespaced kind)")
        return f"{base}/namespaces/{ns}/{plural}/{name}"
    return f"{base}/{plural}/{name}"


def kubeconfig_files(kubeconfig: str | None) -> tuple[list[Path], str]:
    """The kubeconfig files a client reads and where they were named: --kubeconfig, else
    $KUBECONFIG (a list, like kubectl's), else ~/.kube/config."""
    if kubeconfig is not None:
        return [Path(kubeconfig).expanduser()], "--kubeconfig"
    env = os.environ.get("KUBECONFIG", "")
    if env.strip():
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p], "$KUBECONFIG"
    return [Path("~/.kube/config").expanduser()], "the default"


def api_client(kubeconfig: str | None = None, context: str | None = None) -> k.ApiClient:
    """An ApiClient from a kubeconfig file ($KUBECONFIG / ~/.kube/config) or the pod's service account."""
    files, named = kubeconfig_files(kubeconfig)
    present = [f for f in files if f.is_file()]
    if not present:
        if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ and named == "the default":
            kconfig.load_incluster_config()
            return k.ApiClient()
        missing = ", ".join(str(f) for f in files)
        hint = {"--kubeconfig": "", "$KUBECONFIG": "; correct KUBECONFIG or pass --kubeconfig FILE",
                "the default": "; pass --kubeconfig FILE, set KUBECONFIG, or run inside a pod (its service account)"}[named]
        raise UserError(f"kubeconfig {missing} ({named}): no such file{hint}")
    joined = os.pathsep.join(str(f) for f in present)  # the client merges a list as kubectl does
    try:
        return kconfig.new_client_from_config(config_file=joined, context=context)
    except kconfig.ConfigException as err:
        where = f" --context {context}" if context else ""
        raise UserError(f"kubeconfig {', '.join(map(str, present))}{where}: {str(err).splitlines()[0]}") from None


def _order(docs: list[tuple[str, dict]]) -> list[dict]:
    """Namespaces first (plus one for every namespace used without its own document), then as loaded."""
    objs = [d for _, d in docs]
    have = {(d.get("metadata") or {}).get("name") for d in objs if d.get("kind") == "Namespace"}
    used = sorted({(d.get("metadata") or {}).get("namespace") for d in objs} - {None} - have)
    implicit = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in used]
    namespaces = implicit + [d for d in objs if d.get("kind") == "Namespace"]
    return namespaces + [d for d in objs if d.get("kind") != "Namespace"]


def unreachable_why(err: BaseException) -> str:
    """What a user understands of a connection error (urllib3 wraps the cause in MaxRetryError)."""
    reason = getattr(err, "reason", None) or err
    text = f"{type(reason).__name__} {reason}".lower()
    for needle, why in (("refused", "connection refused"), ("name or service not known", "host not found"),
                        ("nodename nor servname", "host not found"), ("name resolution", "host not found"),
                        ("timed out", "connection timed out"), ("timeout", "connection timed out"),
                        ("certificate", "TLS certificate not accepted"), ("ssl", "TLS handshake failed"),
                        ("unreachable", "network unreachable"), ("reset", "connection reset")):
        if needle in text:
            return why
    return f"cannot connect ({type(reason).__name__})"


def _patch(api: k.ApiClient, doc: dict, dry_run: bool) -> tuple[int, dict]:
    query = [("fieldManager", FIELD_MANAGER), ("force", "true"), ("fieldValidation", "Strict")]
    if dry_run:
        query.append(("dryRun", "All"))
    method, url, headers, body, _ = api.param_serialize(
        method="PATCH", resource_path=resource_path(doc), query_params=query,
        header_params={"Content-Type": APPLY_CONTENT_TYPE, "Accept": "application/json"},
        body=doc, auth_settings=["BearerToken"])
    try:
        resp = api.call_api(method, url, header_params=headers, body=body, _request_timeout=(10, 60))
        resp.read()
        status, raw = resp.status, resp.data
    except k.ApiException as err:
        status, raw = err.status, err.body
    except Exception as err:  # urllib3 connection errors: the cluster is unreachable
        raise UserError(f"apply: {unreachable_why(err)} at {api.configuration.host} (is the cluster up, and is "
                        "the kubeconfig's context the right one?)") from None
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        payload = {"message": (raw or b"").decode(errors="replace")[:200]}
    return status, payload if isinstance(payload, dict) else {}


def apply_docs(docs: list[dict], api: k.ApiClient, *, dry_run: bool = False) -> list[Applied]:
    """Server-side apply each document in order; a failure raises UserError naming the object."""
    done: list[Applied] = []
    new_namespaces: set[str] = set()
    for doc in docs:
        meta = doc.get("metadata") or {}
        kind, name, ns = doc["kind"], meta.get("name", "?"), meta.get("namespace")
        status, payload = _patch(api, doc, dry_run)
        if status == 404 and dry_run and ns in new_namespaces:
            # A dry run does not create the namespace, so the server cannot admit objects inside it.
            done.append(Applied(kind, name, ns, 201, f"dry run: namespace {ns} is created on a real apply"))
            continue
        if status >= 400:
            msg = str(payload.get("message", "")).splitlines()[0] if payload.get("message") else ""
            raise UserError(f"apply {kind}/{name}: HTTP {status} {payload.get('reason', '')}: {msg}".rstrip(": "))
        if kind == "Namespace" and status == 201:
            new_namespaces.add(name)
        done.append(Applied(kind, name, ns, status, "dry run" if dry_run else ""))
    return done


def manifests_to_apply(directory: Path) -> list[dict]:
    """The documents of a rendered directory in apply order; UserError when it is missing or unreadable
    (checked before any cluster is contacted)."""
    docs, problems = load_dir(directory)
    if problems:
        raise UserError(problems[0])
    return _order(docs)


def apply_dir(directory: Path, api: k.ApiClient, *, dry_run: bool = False) -> list[Applied]:
    """Apply every manifest of a rendered directory (see module doc)."""
    return apply_docs(manifests_to_apply(directory), api, dry_run=dry_run)
