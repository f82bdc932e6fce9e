"""Watching what was tuned: a PrometheusRule (acceptance drift, decode slowdown) and a Grafana
dashboard in a ConfigMap, for vLLM and SGLang targets.

Every expression reads the series the ServiceMonitor scrapes from this server (its `namespace`
and `service` labels). Live tau follows the load generator's definition (docs/design.md, "tau"):
vLLM's tokens per target forward = generated / (generated - accepted drafts); SGLang exports its
mean accept length per verify step (`sglang:spec_accept_length`) directly.
"""

from __future__ import annotations

import json

from kubernetes import client as k

from deploy.manifests import Plan, _labels, _meta
from tuner.schema.config import Figures

# monitoring.coreos.com/v1: PrometheusRule's version in the Prometheus Operator since v0.29.
RULE_API = "monitoring.coreos.com/v1"
DASHBOARD_LABEL = {"grafana_dashboard": "1"}  # what the Grafana Helm chart's dashboard sidecar watches
DRIFT_ALERT = "SpeculationAcceptanceDrift"
SLOWDOWN_ALERT = "SpeculationDecodeSlowdown"


def selector(p: Plan) -> str:
    """The label matchers of this server's series."""
    d = p.cfg.deploy
    return f'namespace="{d.namespace}",service="{d.name}"'


def tau_expr(p: Plan) -> str:
    """Live tau over deploy.alerts.window."""
    s, w = selector(p), p.cfg.deploy.alerts.window
    if p.cfg.deploy.target == "sglang":
        return f"avg(avg_over_time(sglang:spec_accept_length{{{s}}}[{w}]))"
    gen = f"sum(rate(vllm:generation_tokens_total{{{s}}}[{w}]))"
    acc = f"sum(rate(vllm:spec_decode_num_accepted_tokens_total{{{s}}}[{w}]))"
    return f"{gen} / ({gen} - {acc})"


def decode_rate_expr(p: Plan) -> str:
    """Generated tokens per second per running request over deploy.alerts.window (a server's
    tensor-parallel ranks each report the running count: one per pod is kept)."""
    s, w = selector(p), p.cfg.deploy.alerts.window
    eng = "sglang" if p.cfg.deploy.target == "sglang" else "vllm"
    running = "sglang:num_running_reqs" if eng == "sglang" else "vllm:num_requests_running"
    return (f"sum(rate({eng}:generation_tokens_total{{{s}}}[{w}])) / "
            f"sum(max by (pod) (avg_over_time({running}{{{s}}}[{w}])))")


def tuned_figures(p: Plan) -> tuple[Figures | None, str]:
    """The winner's measured figures the alerts compare with, and which ones: held-out, else the
    tuning prompts' (a study without held-out prompts)."""
    b = p.best
    if b is None or b.projection is not None:  # a projection predicts, it measured nothing
        return None, "none"
    if b.heldout is not None:
        return b.heldout, "held-out"
    return b.metrics, "tuning"


def tuned_tau(p: Plan) -> tuple[float | None, str]:
    """The winner's measured tau the drift alert and the dashboard compare with, and on which prompts:
    the held-out prompts', else the tuning prompts'. A launched server (vLLM, SGLang) counts target
    forwards over a whole pass, and the held-out check's pass plays both sides' prompts in turn, so
    its held-out side has no tau of its own; the trials' passes, one prompt set each, measured it."""
    fig, which = tuned_figures(p)
    if fig is None:
        return None, which
    if fig.tau is None and which == "held-out" and p.best is not None and p.best.metrics is not None:
        return p.best.metrics.tau, "tuning"
    return fig.tau, which


def alert_rules(p: Plan) -> tuple[list[dict], list[str]]:
    """The alerting rules the winner's measurements support, and why any is left out: drift needs
    a measured tau above 1 of the very spec served, slowdown a TPOT p99 measured on this hardware."""
    a, (fig, which) = p.cfg.deploy.alerts, tuned_figures(p)
    if p.cfg.deploy.target not in ("vllm", "sglang"):
        return [], []
    if fig is None:
        return [], ["no PrometheusRule: its alerts compare with the winner's measured tau and TPOT, and this "
                    "render has none (render --from RUN of a measured run)"]
    assert p.best is not None
    rules, skipped = [], []
    same_spec = p.served.spec == p.best.spec
    if not same_spec:
        skipped.append(f"no {DRIFT_ALERT} alert: the served spec '{p.served.spec.key()}' is not the measured winner "
                       f"'{p.best.spec.key()}', whose tau it would be compared with")
    elif (tau := tuned_tau(p))[0] is None and p.served.spec.method != "off":
        skipped.append(f"no {DRIFT_ALERT} alert: the winner has no measured tau to compare with")
    elif tau[0] is not None and tau[0] > 1.0 and p.served.spec.method != "off":
        floor = a.tau_fraction * tau[0]
        rules.append({
            "alert": DRIFT_ALERT,
            "expr": f"{tau_expr(p)} < {floor:.4g}",
            "for": a.for_duration,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{p.cfg.deploy.name}: speculative acceptance fell below "
                           f"{a.tau_fraction:g} x the tuned tau",
                "description": (f"Live tau (tokens per target forward, over {a.window}) is {{{{ $value | printf \"%.2f\" }}}}; "
                                f"the winner measured {tau[0]:.3g} on the {tau[1]} prompts, alert below {floor:.3g} "
                                "(deploy.alerts.tau_fraction). The traffic may have shifted: re-tune on it "
                                "(tuner optimize) or check the served spec."),
            },
        })
    if p.best.provenance.hardware != p.cfg.hardware.name:
        skipped.append(f"no {SLOWDOWN_ALERT} alert: the winner's TPOT was measured on {p.best.provenance.hardware}, "
                       f"not on hardware {p.cfg.hardware.name}")
    elif fig.tpot_p99_ms and same_spec:
        # 1000 / TPOT p99: the per-request decode rate the winner kept at its slowest measured level
        rate = 1000.0 / fig.tpot_p99_ms
        floor = (1.0 - a.throughput_noise) * rate
        rules.append({
            "alert": SLOWDOWN_ALERT,
            "expr": f"{decode_rate_expr(p)} < {floor:.4g}",
            "for": a.for_duration,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{p.cfg.deploy.name}: decode tokens/s per running request below the tuned figure",
                "description": (f"Generated tokens/s per running request over {a.window} is "
                                f"{{{{ $value | printf \"%.1f\" }}}}; the winner decoded {rate:.3g} tokens/s per "
                                f"request (1000 / TPOT p99 {fig.tpot_p99_ms:.3g} ms, {which} prompts), alert below "
                                f"{floor:.3g} (deploy.alerts.throughput_noise={a.throughput_noise:g})."),
            },
        })
    return rules, skipped


def prometheus_rule(p: Plan) -> dict | None:
    """The PrometheusRule of the alerts (None when there is no rule to write)."""
    rules, _ = alert_rules(p)
    if not rules:
        return None
    meta = _meta(p).to_dict()
    return {
        "apiVersion": RULE_API, "kind": "PrometheusRule",
        # deploy.monitor_labels: what the Prometheus Operator's ruleSelector matches
        "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                     "labels": {**meta["labels"], **p.cfg.deploy.monitor_labels}},
        "spec": {"groups": [{"name": f"spectune-{p.cfg.deploy.name}", "rules": rules}]},
    }


def k_band_expr(p: Plan) -> str:
    """The draft length in force per pod: vLLM's K schedule picks K from the running batch size;
    without one (and on SGLang) it is the spec's depth."""
    spec = p.served.spec
    sched = spec.k_per_batch_size if p.cfg.deploy.target == "vllm" else None
    if spec.method == "off":
        return "vector(0)"
    if not sched:
        return f"vector({spec.depth})"
    running = f"sum by (pod) (vllm:num_requests_running{{{selector(p)}}})"
    return " + ".join(f"{k} * ({running} >= bool {lo}) * ({running} <= bool {hi})" for lo, hi, k in sched)


def _panel(i: int, title: str, targets: list[tuple[str, str]], unit: str = "short") -> dict:
    return {
        "id": i, "type": "timeseries", "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(65 + j), "expr": e, "legendFormat": leg} for j, (e, leg) in enumerate(targets)],
    }


def dashboard(p: Plan) -> dict:
    """The Grafana dashboard: tau live and tuned, acceptance per draft position, TPOT, running and
    waiting requests, and the K band in force."""
    d, s, w = p.cfg.deploy, selector(p), p.cfg.deploy.alerts.window
    tuned, which = tuned_tau(p)
    tau = [(tau_expr(p), "live tau")]
    if tuned is not None:
        tau.append((f"vector({tuned:.4g})", f"tuned tau ({which})"))
    if d.target == "sglang":
        accept = [(f"avg(sglang:spec_accept_rate{{{s}}})", "accepted / drafted tokens (SGLang has no per-position counts)")]
        tpot = [(f"histogram_quantile({q}, sum by (le) (rate(sglang:inter_token_latency_seconds_bucket{{{s}}}[{w}])))",
                 f"p{int(q * 100)}") for q in (0.5, 0.99)]
        queue = [(f"sum(max by (pod) (sglang:num_running_reqs{{{s}}}))", "running"),
                 (f"sum(max by (pod) (sglang:num_queue_reqs{{{s}}}))", "waiting")]
    else:
        accept = [(f"sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{s}}}[{w}])) / "
                   f"scalar(sum(rate(vllm:spec_decode_num_drafts_total{{{s}}}[{w}])))", "position {{position}}")]
        tpot = [(f"histogram_quantile({q}, sum by (le) (rate(vllm:request_time_per_output_token_seconds_bucket{{{s}}}[{w}])))",
                 f"p{int(q * 100)}") for q in (0.5, 0.99)]
        queue = [(f"sum(vllm:num_requests_running{{{s}}})", "running"),
                 (f"sum(vllm:num_requests_waiting{{{s}}})", "waiting")]
    panels = [
        _panel(0, "tau: tokens per target forward", tau),
        _panel(1, "acceptance per draft position", accept, "percentunit"),
        _panel(2, "time per output token", tpot, "s"),
        _panel(3, "requests running and waiting", queue),
        _panel(4, "draft length K in force", [(k_band_expr(p), "K")]),
    ]
    return {
        "uid": f"spectune-{d.name}"[:40], "title": f"spectune {d.name} ({d.target}, {p.served.spec.key()})",
        "schemaVersion": 39, "tags": ["spectune", d.target], "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


def dashboard_configmap(p: Plan) -> dict:
    """The dashboard as a ConfigMap the Grafana sidecar loads (label grafana_dashboard=1)."""
    d = p.cfg.deploy
    cm = k.V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=k.V1ObjectMeta(
        name=f"{d.name}-dashboard", namespace=d.namespace, labels={**_labels(p), **DASHBOARD_LABEL}),
        data={f"spectune-{d.name}.json": json.dumps(dashboard(p), indent=1, sort_keys=True)})
    return k.ApiClient().sanitize_for_serialization(cm)
