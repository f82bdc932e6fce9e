"""tuner apply: server-side apply against a loopback HTTP server that records every request.

An opt-in test dry-runs the same against a real cluster when KUBECONFIG is set.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from deploy.apply import api_client, apply_dir
from deploy.render import render
from tuner.cli import main
from tuner.schema.compose import load_config
from tuner.schema.config import UserError


class FakeApiServer:
    """Records (method, path, query, headers, body); 201 for a new object, 200 after; 422 on demand."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.seen: set[str] = set()
        self.fail_kind: str | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:  # noqa: N802 (http.server's naming)
                url = urlsplit(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                query = parse_qs(url.query)
                outer.requests.append({"method": "PATCH", "path": url.path, "query": query,
                                       "content_type": self.headers["Content-Type"],
                                       "auth": self.headers.get("Authorization"), "body": body})
                if body.get("kind") == outer.fail_kind:
                    self._reply(422, {"kind": "Status", "reason": "Invalid",
                                      "message": f'{body["kind"]} "x" is invalid: spec.foo: Forbidden'})
                    return
                created = url.path not in outer.seen
                if "dryRun" not in query:
                    outer.seen.add(url.path)
                self._reply(201 if created else 200, body)

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeApiServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "loop",
        "clusters": [{"name": "loop", "cluster": {"server": server}}],
        "users": [{"name": "me", "user": {"token": "test-token"}}],
        "contexts": [{"name": "loop", "context": {"cluster": "loop", "user": "me", "namespace": "default"}}],
    }))
    return path


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("k8s")
    render(load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=vllm", "deploy.namespace=serving"]),
           None, out)
    return out


EXPECTED_PATHS = [
    "/api/v1/namespaces/serving",
    "/api/v1/namespaces/serving/configmaps/spectune-winner",
    "/apis/apps/v1/namespaces/serving/deployments/spectune",
    "/api/v1/namespaces/serving/services/spectune",
    "/apis/monitoring.coreos.com/v1/namespaces/serving/servicemonitors/spectune",
    "/apis/policy/v1/namespaces/serving/poddisruptionbudgets/spectune",
    "/apis/autoscaling/v2/namespaces/serving/horizontalpodautoscalers/spectune",
    "/api/v1/namespaces/serving/configmaps/spectune-dashboard",
]


def test_server_side_apply_requests(manifests: Path, tmp_path: Path) -> None:
    with FakeApiServer() as srv:
        api = api_client(str(_kubeconfig(tmp_path / "kc", srv.url)))
        first = apply_dir(manifests, api)
        second = apply_dir(manifests, api)
    assert [r["path"] for r in srv.requests] == EXPECTED_PATHS * 2  # namespace first, then kustomization order
    for r in srv.requests:
        assert r["method"] == "PATCH"
        assert r["content_type"] == "application/apply-patch+yaml"
        assert r["query"]["fieldManager"] == ["spectune"]
        assert r["query"]["force"] == ["true"]
        assert r["query"]["fieldValidation"] == ["Strict"]
        assert "dryRun" not in r["query"]
        assert r["auth"] == "Bearer test-token"
    # The body is the manifest itself (JSON is YAML): the deployment carries the FP8 + speculative flags.
    dep = next(r["body"] for r in srv.requests if r["body"]["kind"] == "Deployment")
    assert dep == yaml.safe_load((manifests / "deployment.yaml").read_text())
    # Idempotent: the second apply sends the same objects and creates nothing new.
    assert [r.status for r in first] == [201] * len(EXPECTED_PATHS)
    assert [r.status for r in second] == [200] * len(EXPECTED_PATHS)
    n = len(EXPECTED_PATHS)
    assert [r["body"] for r in srv.requests[:n]] == [r["body"] for r in srv.requests[n:]]


def test_dry_run_via_cli(manifests: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with FakeApiServer() as srv:
        kc = _kubeconfig(tmp_path / "kc", srv.url)
        assert main(["apply", "--dry-run", "--kubeconfig", str(kc), str(manifests)]) == 0
    assert [r["path"] for r in srv.requests] == EXPECTED_PATHS
    assert all(r["query"]["dryRun"] == ["All"] for r in srv.requests)
    assert all(r["query"]["fieldManager"] == ["spectune"] and r["query"]["force"] == ["true"] for r in srv.requests)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Namespace serving created (dry run)" and len(out) == len(EXPECTED_PATHS)


def test_namespace_created_even_without_a_namespace_document(manifests: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "service.yaml").write_text((manifests / "service.yaml").read_text())
    with FakeApiServer() as srv:
        apply_dir(d, api_client(str(_kubeconfig(tmp_path / "kc", srv.url))))
    assert [r["path"] for r in srv.requests] == ["/api/v1/namespaces/serving", "/api/v1/namespaces/serving/services/spectune"]
    assert srv.requests[0]["body"] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "serving"}}


def test_rejected_object_is_one_line(manifests: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with FakeApiServer() as srv:
        srv.fail_kind = "Deployment"
        kc = _kubeconfig(tmp_path / "kc", srv.url)
        assert main(["apply", "--kubeconfig", str(kc), str(manifests)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['error: apply Deployment/spectune: HTTP 422 Invalid: Deployment "x" is invalid: spec.foo: Forbidden']


def test_unreachable_server_and_missing_kubeconfig(manifests: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37: an API server that is not there is 'connection refused at URL', one line, exit 2."""
    with FakeApiServer() as srv:
        url = srv.url
    kc = _kubeconfig(tmp_path / "kc", url)  # server now closed
    assert main(["apply", "--dry-run", "--kubeconfig", str(kc), str(manifests)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"error: apply: connection refused at {url} (is the cluster up"), captured.err
    assert "MaxRetryError" not in captured.err and "Traceback" not in captured.err
    with pytest.raises(UserError, match="kubeconfig"):
        api_client(str(tmp_path / "missing"))


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="opt-in: set KUBECONFIG to dry-run against a real cluster")
def test_real_cluster_dry_run(tmp_path: Path) -> None:
    # ServiceMonitor needs the prometheus-operator CRD and HPA pods metrics an adapter: leave them out.
    render(load_config(["deploy.service_monitor=false", "deploy.namespace=spectune-e2e"]), None, tmp_path)
    results = apply_dir(tmp_path, api_client(), dry_run=True)
    assert results[0].kind == "Namespace" and all(r.status in (200, 201) for r in results)
