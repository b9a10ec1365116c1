"""The deployment files: the Kubernetes objects (deployment/k8s/, built as `kubectl apply -k` would) validate against
the current Kubernetes schemas and keep the serving rules (probes, drain, GPU, non-root, read-only weights, an
autoscaler on seat demand, a disruption budget); the alert rules and compose's Prometheus config pass promtool; every
metric name the dashboard, the alerts and the autoscalers query is one the running service exposes; the Dockerfile is
hadolint-clean."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version
from prometheus_client.parser import text_string_to_metric_families

from tests.service_harness import TLS, live_server

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deployment" / "k8s"
ALTERNATIVES = K8S / "alternatives"
COMPOSE = ROOT / "deployment" / "compose.yaml"
PROMETHEUS_CONFIG = ROOT / "deployment" / "compose" / "prometheus.yml"
DASHBOARD = K8S / "voxcpm-serve-dashboard.json"
STARTUP_BUDGET_S = 600  # a cold load: weights from the volume, kernels compiled on a cache miss
KUBE_STATE_METRICS = {"kube_pod_container_status_restarts_total"}  # kube-prometheus-stack's: the restart alert
STOP_AFTER_DRAIN_S = 20  # after the drain: uvicorn's graceful stop (10 s), then the workers' (10 s)

# The custom resources' fields this repository uses, from their CRDs (KEDA keda.sh/v1alpha1 ScaledObject,
# Prometheus Operator monitoring.coreos.com/v1 ServiceMonitor and PrometheusRule): kubernetes-validate has schemas
# for the built-in kinds only, so a misspelt field here would otherwise pass unseen.
CRD_SCHEMAS: dict[str, dict] = {
    "ScaledObject": {"type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                     "properties": {
                         "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                            "properties": {k: {"type": "string"} for k in
                                                           ("apiVersion", "kind", "name", "envSourceContainerName")}},
                         **{k: {"type": "integer", "minimum": 0} for k in
                            ("pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
                             "minReplicaCount", "maxReplicaCount")},
                         "advanced": {"type": "object", "additionalProperties": False, "properties": {
                             "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                               "properties": {"name": {"type": "string"},
                                                                              "behavior": {"type": "object"}}},
                             "restoreToOriginalReplicaCount": {"type": "boolean"},
                             "scalingModifiers": {"type": "object"}}},
                         "fallback": {"type": "object"},
                         "triggers": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                             "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                            "useCachedMetrics": {"type": "boolean"},
                                            "authenticationRef": {"type": "object"},
                                            "metadata": {"type": "object",
                                                         "additionalProperties": {"type": "string"}}}}}}},
    "ServiceMonitor": {"type": "object", "required": ["selector", "endpoints"], "properties": {
        "selector": {"type": "object"}, "namespaceSelector": {"type": "object"}, "jobLabel": {"type": "string"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False,
            "properties": {**{k: {"type": "string"} for k in ("port", "path", "scheme", "interval", "scrapeTimeout")},
                           "honorLabels": {"type": "boolean"}, "bearerTokenSecret": {"type": "object"},
                           "authorization": {"type": "object"}, "relabelings": {"type": "array"},
                           "metricRelabelings": {"type": "array"}}}}}},
    "PrometheusRule": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
        "groups": {"type": "array", "items": {
            "type": "object", "required": ["name", "rules"], "properties": {
                "name": {"type": "string"}, "interval": {"type": "string"},
                "rules": {"type": "array", "items": {
                    "type": "object", "required": ["expr"], "additionalProperties": False,
                    "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                   "expr": {"type": "string"}, "for": {"type": "string"},
                                   "keep_firing_for": {"type": "string"},
                                   "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "annotations": {"type": "object",
                                                   "additionalProperties": {"type": "string"}}}}}}}}}},
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def build(directory: Path = K8S) -> list[dict]:
    """What `kubectl apply -k` applies: the resources (one object per file) and the generated ConfigMaps, with the
    kustomization's common labels (the fields this kustomization uses; anything else fails here)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "labels", "resources", "configMapGenerator"}, kustomization
    objects = []
    for name in kustomization["resources"]:
        docs = documents(directory / name)
        assert len(docs) == 1, f"{name}: one object per file, found {len(docs)}"
        objects.append(docs[0])
    for generator in kustomization.get("configMapGenerator", []):
        options = generator.get("options", {})
        assert options.get("disableNameSuffixHash"), "the dashboard's ConfigMap keeps its name (the sidecar finds it)"
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"], "labels": dict(options.get("labels", {}))},
                        "data": data})
    for entry in kustomization.get("labels", []):
        assert not entry.get("includeSelectors"), "selectors stay as written"
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objects


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build()}


def kind(objects: dict[str, dict], name: str) -> dict:
    matches = [o for o in objects.values() if o["kind"] == name]
    assert len(matches) == 1, f"expected one {name}, found {len(matches)}"
    return matches[0]


def test_kustomization_lists_every_file_once():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"]) | {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    present = {p.name for p in K8S.iterdir() if p.is_file() and p.name != "kustomization.yaml"}
    assert listed == present, f"not listed: {present - listed}; missing: {listed - present}"


def validation_error(obj: dict, version: str) -> str | None:
    """What is wrong with `obj` for Kubernetes `version` (None: nothing): built-in kinds by kubernetes-validate's
    strict schemas; custom resources by their CRD's fields, and the built-in types they embed by the schemas."""
    try:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except SchemaNotFoundError:
            if obj["kind"] not in CRD_SCHEMAS:
                return f"no schema for {obj['apiVersion']} {obj['kind']}"
            jsonschema.validate(obj["spec"], CRD_SCHEMAS[obj["kind"]])
            behavior = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
            if behavior is not None:  # KEDA hands it to the HPA it makes: autoscaling/v2's type
                hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
                       "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 1,
                                "behavior": behavior}}
                kubernetes_validate.validate(hpa, version, strict=True)
    except jsonschema.ValidationError as e:  # kubernetes-validate's errors are of this type too
        return f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
    return None


def test_every_object_validates_against_the_current_kubernetes():
    version = latest_version()
    checked = build() + [d for p in sorted(ALTERNATIVES.glob("*.yaml")) for d in documents(p) if "kind" in d]
    errors = {f"{o['kind']}/{o['metadata']['name']}": e for o in checked if (e := validation_error(o, version))}
    assert not errors, f"against Kubernetes {version}: {errors}"
    assert {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject", "ServiceMonitor", "PrometheusRule",
            "ConfigMap", "StatefulSet", "HorizontalPodAutoscaler", "NetworkPolicy"} <= {o["kind"] for o in checked}
    deployment = next(o for o in checked if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5  # a misspelt field
    assert "periodSecond" in (validation_error(deployment, version) or ""), "strict validation let a typo through"


def test_no_beta_apis_and_the_serving_rules(objects):
    for name, obj in objects.items():
        assert not re.search(r"/v\d+beta", obj["apiVersion"]), f"{name}: {obj['apiVersion']} is a beta API"
    hpa = documents(ALTERNATIVES / "horizontalpodautoscaler.yaml")[0]
    assert hpa["apiVersion"] == "autoscaling/v2"

    deployment = kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the ScaledObject owns the replica count: a count here would be set back by every apply
    assert "replicas" not in deployment["spec"]
    # a pod that shares its node's cores (not Guaranteed with whole cores) sees all of them: pinning its engine worker
    # to the last two would pin every pod's to the same two
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    guaranteed = limits.get("cpu") == requests.get("cpu") and str(requests.get("cpu", "")).isdigit() and \
        limits.get("memory") == requests.get("memory")
    assert guaranteed or (env.get("NANOVLLM_WORKER_CPUS") == "0" and env.get("NANOVLLM_API_PROCESSES"))
    startup, liveness, readiness = (container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    assert startup["httpGet"]["path"] == "/ready", "/health answers while the model loads: the budget would be void"
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= STARTUP_BUDGET_S
    assert liveness["httpGet"]["path"] == "/health" and readiness["httpGet"]["path"] == "/ready"
    # the drain: preStop, then NANOVLLM_SHUTDOWN_GRACE_S for what is in flight, then the processes stop
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + float(env["NANOVLLM_SHUTDOWN_GRACE_S"]) + \
        STOP_AFTER_DRAIN_S
    # the systemd unit: the same drain before it kills (40 s cut it short), and the warm-up's wait within its start
    unit = dict(line.split("=", 1) for line in (ROOT / "deployment" / "voxcpm-serve.service").read_text()
                .splitlines() if "=" in line and not line.startswith("#"))
    assert int(unit["TimeoutStopSec"]) > float(env["NANOVLLM_SHUTDOWN_GRACE_S"]) + STOP_AFTER_DRAIN_S
    assert int(unit["TimeoutStartSec"]) > STARTUP_BUDGET_S and "post_start_warmup.sh" in unit["ExecStartPost"]
    assert unit["KillMode"] == "mixed", "SIGTERM to every process at once kills the engine under the streams"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    weights = next(n for n, m in mounts.items() if env["NANOVLLM_MODEL_PATH"].startswith(m["mountPath"] + "/"))
    assert mounts[weights]["readOnly"] and volumes[weights]["persistentVolumeClaim"]["readOnly"]
    cache = next(n for n, m in mounts.items() if m["mountPath"] == env["NANOVLLM_CACHE_DIR"])
    assert "emptyDir" in volumes[cache] or "persistentVolumeClaim" in volumes[cache]
    redis_url = urlsplit(env["NANOVLLM_REDIS_URL"])
    redis_set = kind(objects, "StatefulSet")
    assert redis_url.hostname == redis_set["spec"]["serviceName"]
    # the store needs the password the service sends (both from one Secret), and only the service's pods reach it
    (redis,) = redis_set["spec"]["template"]["spec"]["containers"]
    password = next(e["valueFrom"]["secretKeyRef"] for e in redis["env"] if e["name"] == "REDIS_PASSWORD")
    assert "$(REDIS_PASSWORD)" in redis["args"][redis["args"].index("--requirepass") + 1]
    assert redis_url.password == "$(REDIS_PASSWORD)"
    assert next(e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "REDIS_PASSWORD") == password
    policy = kind(objects, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= redis_set["spec"]["template"]["metadata"]["labels"].items()
    (allowed,) = policy["ingress"]
    assert [f["podSelector"]["matchLabels"] for f in allowed["from"]] == [
        deployment["spec"]["template"]["metadata"]["labels"]]
    assert [port["port"] for port in allowed["ports"]] == [6379] == [
        port["containerPort"] for port in redis["ports"]]

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = kind(objects, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = objects["Service/voxcpm-serve"]
    assert service["spec"]["selector"].items() <= labels.items()
    monitor = kind(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    scaled = kind(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # the disruption budget lets a drain take one replica: two at least, so that one serves meanwhile
    assert scaled["spec"]["minReplicaCount"] >= 2 and hpa["spec"]["minReplicas"] >= 2
    assert pdb["spec"]["maxUnavailable"] == 1
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus", "scale on seat demand, not cpu or memory"
        assert {"voxcpm_running_sequences", "voxcpm_queue_depth"} <= metric_names(trigger["metadata"]["query"])
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert all(m["type"] != "Resource" for m in hpa["spec"]["metrics"]), "the alternative HPA must not scale on CPU"

    alerts = {r["alert"]: r["expr"] for g in kind(objects, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    for watched in ("voxcpm_ready", "voxcpm_engine_steps", 'status=~"5..', "voxcpm_time_to_first_audio_byte",
                    "voxcpm_requests_overloaded", "voxcpm_queue_depth", "voxcpm_voice_store_up"):
        assert any(watched in expr for expr in alerts.values()), f"no alert watches {watched}"

    dashboard = kind(objects, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"][DASHBOARD.name])["uid"] == "voxcpm-serve"


def test_compose_runs_the_service_redis_prometheus_and_grafana_with_the_same_dashboard():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"voxcpm-serve", "redis", "prometheus", "grafana"}
    serve = services["voxcpm-serve"]
    assert serve["environment"]["NANOVLLM_REDIS_URL"].startswith("redis://redis:")
    assert serve["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "/ready" in " ".join(serve["healthcheck"]["test"])
    mounted = {}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source == "./models":  # the operator's weights, beside compose.yaml
                assert target == "/models" and volume.endswith(":ro")
            elif source.startswith("."):
                path = (COMPOSE.parent / source).resolve()
                assert path.is_file(), f"{name} mounts {source}, which is missing"
                mounted[target] = path
            else:
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
    assert mounted["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    assert mounted["/var/lib/grafana/dashboards/voxcpm-serve.json"] == DASHBOARD  # one dashboard for both
    providers = yaml.safe_load(mounted["/etc/grafana/provisioning/dashboards/voxcpm.yaml"].read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    sources = yaml.safe_load(mounted["/etc/grafana/provisioning/datasources/voxcpm.yaml"].read_text())
    assert sources["datasources"][0]["url"].startswith("http://prometheus:9090")
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert scrape[0]["metrics_path"] == "/metrics"
    assert scrape[0]["static_configs"][0]["targets"] == ["voxcpm-serve:" + serve["ports"][0].split(":")[1]]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: install Debian's prometheus package (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_alert_rules_and_prometheus_config_pass_promtool(objects, tmp_path):
    spec = kind(objects, "PrometheusRule")["spec"]
    rules = tmp_path / "voxcpm-serve.rules.yml"
    rules.write_text(yaml.safe_dump(spec))  # a PrometheusRule's spec is a Prometheus rule file
    count = sum(len(g["rules"]) for g in spec["groups"])
    for args, said in ((["check", "rules", str(rules)], f"SUCCESS: {count} rules found"),
                       (["check", "config", str(PROMETHEUS_CONFIG)], "SUCCESS")):
        r = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and said in r.stdout, r.stdout + r.stderr


ERROR_RATE_TESTS = """
rule_files: [voxcpm-serve.rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m  # a replica restarting a worker: /ready answers its probes 503 while generation is fine
    input_series:
      - {series: 'voxcpm_http_requests_total{namespace="tts",method="GET",route="/ready",status="503"}',
         values: '0+120x30'}
      - {series: 'voxcpm_http_requests_total{namespace="tts",method="POST",route="/generate",status="200"}',
         values: '0+60x30'}
    alert_rule_test: [{eval_time: 20m, alertname: VoxcpmHighErrorRate, exp_alerts: []}]
  - interval: 1m  # a third of the generations fail
    input_series:
      - {series: 'voxcpm_http_requests_total{namespace="tts",method="POST",route="/generate",status="500"}',
         values: '0+30x30'}
      - {series: 'voxcpm_http_requests_total{namespace="tts",method="POST",route="/generate",status="200"}',
         values: '0+60x30'}
      - {series: 'voxcpm_http_requests_total{namespace="tts",method="GET",route="/health",status="200"}',
         values: '0+600x30'}
    alert_rule_test:
      - eval_time: 20m
        alertname: VoxcpmHighErrorRate
        exp_alerts:
          - exp_labels: {namespace: tts, severity: critical}
            exp_annotations:
              summary: "voxcpm-serve: 33.33% of requests answer 5xx"
              description: "More than 5% of requests failed with a 5xx for 5 minutes (503s from a full queue count)."
"""


NOT_READY_TESTS = """
rule_files: [voxcpm-serve.rules.yml]
evaluation_interval: 1m
tests:
  - interval: 1m  # stuck loading: the startup probe restarts the container every 15 minutes (a stale gap each time)
    input_series:
      - {series: 'voxcpm_ready{namespace="tts",pod="p1"}', values: '0x13 stale 0x13 stale 0x13'}
      - {series: 'kube_pod_container_status_restarts_total{namespace="tts",pod="p1",container="voxcpm-serve"}',
         values: '0x14 1x14 2x14'}
    alert_rule_test:
      - eval_time: 12m
        alertname: VoxcpmReplicaNotReady
        exp_alerts:
          - exp_labels: {namespace: tts, pod: p1, severity: warning}
            exp_annotations:
              summary: "voxcpm-serve replica p1 not ready for 10 minutes"
              description: "/ready has said 503 for 10 minutes: see the pod's /ready detail and its log."
      - eval_time: 40m
        alertname: VoxcpmReplicaRestarting
        exp_alerts:
          - exp_labels: {namespace: tts, pod: p1, severity: critical}
            exp_annotations:
              summary: "voxcpm-serve replica p1 restarted 2 times in 30 minutes"
              description: "The container keeps restarting: see its previous log (kubectl logs --previous)."
  - interval: 1m  # a cold load of five minutes, then ready: neither
    input_series:
      - {series: 'voxcpm_ready{namespace="tts",pod="p2"}', values: '0x5 1x40'}
      - {series: 'kube_pod_container_status_restarts_total{namespace="tts",pod="p2",container="voxcpm-serve"}',
         values: '0x45'}
    alert_rule_test:
      - {eval_time: 30m, alertname: VoxcpmReplicaNotReady, exp_alerts: []}
      - {eval_time: 30m, alertname: VoxcpmReplicaRestarting, exp_alerts: []}
"""


def promtool_test(objects: dict[str, dict], tmp_path: Path, tests: str) -> None:
    (tmp_path / "voxcpm-serve.rules.yml").write_text(yaml.safe_dump(kind(objects, "PrometheusRule")["spec"]))
    (tmp_path / "tests.yml").write_text(tests)
    r = subprocess.run([promtool(), "test", "rules", "tests.yml"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_a_replica_that_never_gets_ready_is_alerted_despite_its_restarts(objects, tmp_path):
    """promtool runs the rules on series: a replica stuck loading, restarted by its startup probe every 15 minutes,
    raises the not-ready alert before its first restart (at 15 minutes it never fired: each restart's stale gap reset
    it) and the restart alert; a five-minute cold load raises neither."""
    promtool_test(objects, tmp_path, NOT_READY_TESTS)


def test_the_error_rate_alert_counts_requests_not_probes(objects, tmp_path):
    """promtool runs the rules on series: a replica whose /ready answers 503 (a worker restarting) while every
    generation succeeds raises no error-rate alert (the probes were counted as failed requests), and a third of the
    generations failing raises it whatever the probes say."""
    promtool_test(objects, tmp_path, ERROR_RATE_TESTS)


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "le", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are neither functions, keywords, label names
    (in braces or groupings), strings, durations nor template variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers (and prometheus-adapter's <<.LabelMatchers>>)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]|\$\w+|<<[^>]*>>", "", expr)  # ranges, dashboard variables, adapter templates
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if not m[2] and m[1].lower() not in PROMQL_WORDS:
            names.add(m[1])
    return names


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panels(panel) if "panels" in panel else ()


def queries() -> dict[str, str]:
    """Every query the deployment runs: each target of the dashboard's panels, the alerts, the autoscalers'."""
    found = {}
    for panel in panels(json.loads(DASHBOARD.read_text())):
        for i, target in enumerate(panel.get("targets", [])):
            found[f"dashboard {panel['title']!r} {target.get('refId', i)}"] = target["expr"]
    for group in yaml.safe_load((K8S / "prometheusrule.yaml").read_text())["spec"]["groups"]:
        for rule in group["rules"]:
            found[f"alert {rule['alert']}"] = rule["expr"]
    for i, trigger in enumerate(yaml.safe_load((K8S / "scaledobject.yaml").read_text())["spec"]["triggers"]):
        found[f"ScaledObject trigger {i}"] = trigger["metadata"]["query"]
    adapter = yaml.safe_load((ALTERNATIVES / "prometheus-adapter-values.yaml").read_text())
    for i, rule in enumerate(adapter["rules"]["custom"]):
        found[f"prometheus-adapter rule {i}"] = rule["metricsQuery"] + " " + rule["seriesQuery"]
    return found


def test_every_query_is_read():
    """Each of the dashboard's queries is checked, not the last of each panel only (a misspelt first one passed)."""
    found = queries()
    dashboard = json.loads(DASHBOARD.read_text())
    assert sum(key.startswith("dashboard ") for key in found) == sum(len(p.get("targets", [])) for p in panels(
        dashboard)) > len(dashboard["panels"])


def test_metric_names_parse():
    assert metric_names('sum by (le) (rate(a_bucket{status=~"5.."}[5m])) / on (pod) b > 0.5 and c offset 5m') == \
        {"a_bucket", "b", "c"}
    adapter = "sum by (<<.GroupBy>>) (x{<<.LabelMatchers>>}) + histogram_quantile(0.9, y[$__rate_interval])"
    assert metric_names(adapter) == {"x", "y"}


@pytest.fixture(scope="module")
def live_metric_names(checkpoint_factory, tmp_path_factory) -> set[str]:
    """The sample names the running service exposes after some traffic (a streamed MP3 for the TTFB and encoder
    histograms, a 404), with the names its declared families may take."""
    with (live_server(checkpoint_factory, tmp_path_factory.mktemp("deployment-cache")) as server,
          httpx.Client(verify=TLS, base_url=server.url, timeout=60) as c):
        assert c.post("/generate", json={"target_text": "Metrics.", "max_generate_length": 2}).status_code == 200
        assert c.delete("/prompts/some-id").status_code == 404
        text = c.get("/metrics").text
    names = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ())}  # declared, no series yet
    assert "voxcpm_time_to_first_audio_byte_seconds_bucket" in {s.name for f in text_string_to_metric_families(text)
                                                                for s in f.samples}
    return names


def test_every_queried_metric_is_exposed_by_the_service(live_metric_names):
    used: dict[str, list[str]] = {}
    for where, expr in queries().items():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    assert {"voxcpm_voice_store_up", "voxcpm_queue_depth", "voxcpm_time_to_first_audio_byte_seconds_bucket"} <= \
        set(used)
    missing = {name: where for name, where in used.items()
               if name not in live_metric_names and name not in KUBE_STATE_METRICS}
    assert not missing, f"queried but not in /metrics: {missing}"


def test_dockerfile_is_hadolint_clean():
    hadolint = Path(sys.executable).with_name("hadolint")
    r = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_post_start_warm_up_passes_against_a_service_that_requires_a_key(checkpoint_factory, tmp_path):
    """deployment/post_start_warmup.sh (the systemd unit's ExecStartPost) against a live service with API keys: it
    sends VOXCPM_API_KEY, else the first of NANOVLLM_API_KEYS, else the first of NANOVLLM_API_KEYS_FILE (the unit's own
    environment), and passes; with none it fails naming the step (it sent no key at all: every call a 401, so the unit
    never started)."""
    script = ROOT / "deployment" / "post_start_warmup.sh"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VOXCPM_API_KEY", "NANOVLLM_API_KEYS", "NANOVLLM_API_KEYS_FILE", "VOXCPM_URL")}

    def warm_up(url: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), url], env={**env, "WAIT_S": "120", **extra}, capture_output=True,
                              text=True, timeout=300)

    with live_server(checkpoint_factory, tmp_path, api_keys="k1,k2", voice_store="memory") as server:
        keys_file = tmp_path / "keys"
        keys_file.write_text("# the service's keys\n\n  k2  \nk1\n")
        for extra in ({"NANOVLLM_API_KEYS": " k2 , k1"}, {"VOXCPM_API_KEY": "k1", "NANOVLLM_API_KEYS": "nope"},
                      {"NANOVLLM_API_KEYS_FILE": str(keys_file)}):
            done = warm_up(server.url, **extra)
            assert done.returncode == 0 and "warm-up OK" in done.stdout, (extra, done.stdout, done.stderr)
        refused = warm_up(server.url)
        assert refused.returncode == 1 and "warm-up FAILED: zero-shot" in refused.stderr, refused.stderr
        hifi = httpx.get(server.url + "/hifi", headers={"authorization": "Bearer k1"}, verify=TLS).json()
        assert hifi == {"voices": []}  # each run deleted its own voice
