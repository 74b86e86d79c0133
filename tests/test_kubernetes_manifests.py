"""deploy/kubernetes/: every manifest of the kustomization (and the KubeRay one) validates against the
Kubernetes schemas (kubernetes-validate, strict: no unknown fields); the custom resources it has no schema
for (ServiceMonitor, PrometheusRule, RayJob, RayService: no registry ships KubeRay's CRD schemas) are
checked field by field, their embedded pod templates against the Kubernetes schemas; the pieces fit together (selectors,
ports, names, the router's discovery name, the HPA's target); the containers' command lines parse with
tokenloom's own CLI; the PrometheusRule holds deploy/alerts.yml's rules. No cluster: nothing is applied."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="make test installs kubernetes-validate")

from tokenloom.cli import build_parser  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes still supported upstream when these were written
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("ray.io/v1", "RayJob"), ("ray.io/v1", "RayService")}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = [K8S / f for f in kustomization["resources"]] + [K8S / "ray" / "rayjob.yaml", K8S / "ray" / "rayservice.yaml"]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for f in files:
        for d in _docs(f):
            key = (d["kind"], d["metadata"]["name"])
            assert key not in out, f"{key} twice"
            out[key] = d
    return out


def test_every_manifest_validates(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    validated = 0
    for (kind, name), d in manifests.items():
        if (d["apiVersion"], kind) in CRDS:
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises ValidationError
        validated += 1
    assert validated == 6  # 3 Services, 2 Deployments, the HPA
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does catch a bad field
        bad = dict(manifests[("Service", "tokenloom-worker")], spec={"clusterIP": None, "ports": [{"port": "x"}]})
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _container(d: dict[str, Any]) -> dict[str, Any]:
    (c,) = d["spec"]["template"]["spec"]["containers"]
    return c


def _parse(argv: list[str]) -> Any:
    return build_parser().parse_args(argv)


def test_the_pieces_fit_together(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    svc, dep = manifests[("Service", "tokenloom-worker")], manifests[("Deployment", "tokenloom-worker")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"].items() <= labels.items() and dep["spec"]["selector"]["matchLabels"] == labels
    worker = _container(dep)
    args = _parse(worker["args"])
    assert worker["args"][0] == "serve"
    port = {p["name"]: p["containerPort"] for p in worker["ports"]}["http"]
    assert args.port == port == svc["spec"]["ports"][0]["port"] and args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert worker["resources"]["requests"]["cpu"] and worker["resources"]["requests"]["memory"]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert args.model.startswith(mounts["models"] + "/")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.graceful_timeout

    router_dep = manifests[("Deployment", "tokenloom-router")]
    router = _container(router_dep)
    argv = [a.replace("$(POD_NAMESPACE)", "default") for a in router["args"]]
    assert any(e["name"] == "POD_NAMESPACE" for e in router["env"])
    rargs = _parse(argv)
    assert rargs.worker == [] and rargs.worker_discovery == f"dns:tokenloom-worker.default.svc.cluster.local:{port}"
    from tokenloom.router.cli import router_config
    from tokenloom.router.discovery import parse_discovery

    config = router_config(rargs, [], [])
    d = parse_discovery(config.worker_discovery)  # type: ignore[arg-type]
    assert d.host.split(".")[0] == svc["metadata"]["name"] and d.port == port
    rsvc = manifests[("Service", "tokenloom-router")]
    assert rsvc["spec"]["selector"].items() <= router_dep["spec"]["template"]["metadata"]["labels"].items()

    hpa = manifests[("HorizontalPodAutoscaler", "tokenloom-worker")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tokenloom-worker"}
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    # The series is one the workers export, under that name.
    from prometheus_client import generate_latest

    from tokenloom.distributed.autoscale import parse_load
    from tokenloom.serve.metrics import ServingMetrics

    m = ServingMetrics("tokenloom")
    m.waiting.set(3)
    assert rule["seriesQuery"].startswith("tokenloom:num_requests_waiting{")
    assert f'tokenloom:num_requests_waiting{{model_name="tokenloom"}} 3.0' in generate_latest(m.registry).decode()
    assert parse_load(generate_latest(m.registry).decode()).waiting == 3  # what ray-serve's autoscaler reads


def test_monitoring_custom_resources(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in prometheus["scrape_configs"]}
    for component in ("router", "worker"):
        sm = manifests[("ServiceMonitor", f"tokenloom-{component}")]
        svc = manifests[("Service", f"tokenloom-{component}")]
        # No jobLabel: the job is the Service's name, the one the dashboard and the alert rules select on.
        assert "jobLabel" not in sm["spec"] and svc["metadata"]["name"] in jobs
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        (ep,) = sm["spec"]["endpoints"]
        assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["path"] == "/metrics"
    rule = manifests[("PrometheusRule", "tokenloom")]
    assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    assert set(rule["spec"]) == {"groups"}


def _check_ray_cluster(cluster: dict[str, Any], config: Any, serving_port: tuple[str, int]) -> dict[str, Any]:
    """A KubeRay RayClusterSpec that can hold `config`'s workers; its head pod template (validated)."""
    import json

    import ray

    assert set(cluster) <= {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling"}
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray (pyproject's pin) is the cluster's
    head = cluster["headGroupSpec"]
    assert set(head) <= {"rayStartParams", "template", "serviceType"}
    assert head["rayStartParams"]["num-cpus"] == "0"  # no tokenloom worker on the head
    (group,) = cluster["workerGroupSpecs"]
    assert set(group) <= {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}
    node_resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
    assert config.resources.keys() <= node_resources.keys()
    assert float(group["rayStartParams"]["num-cpus"]) >= config.num_cpus
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"] >= config.autoscale.max_workers
    for template in (head["template"], group["template"]):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S_VERSION, strict=True)
    head_ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    name, port = serving_port
    assert head_ports[name] == port
    return head


def test_the_kuberay_job_runs_ray_serve(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    job = manifests[("RayJob", "tokenloom")]
    spec = job["spec"]
    assert set(spec) <= {"entrypoint", "shutdownAfterJobFinishes", "rayClusterSpec"}
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["tokenloom", "ray-serve"]
    args = _parse(argv[1:])
    from tokenloom.distributed.cli import ray_serve_config

    head = _check_ray_cluster(spec["rayClusterSpec"], ray_serve_config(args), ("http", args.port))
    svc = manifests[("Service", "tokenloom-ray-router")]
    assert svc["spec"]["selector"].items() <= head["template"]["metadata"]["labels"].items()


def test_the_kuberay_service_deploys_the_serve_application(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    import ast

    from tokenloom.distributed.cli import parse_serve_app_argv, ray_serve_config
    from tokenloom.errors import ConfigError

    spec = manifests[("RayService", "tokenloom")]["spec"]
    assert set(spec) <= {"serveConfigV2", "rayClusterConfig", "upgradeStrategy", "serveService",
                         "excludeHeadPodFromServeSvc", "rayClusterDeletionDelaySeconds"}
    assert isinstance(spec["serveConfigV2"], str)  # KubeRay takes Serve's config file as a string
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    assert set(serve_config) == {"applications"}  # Serve's own HTTP default, port 8000: KubeRay's serve port
    (app,) = serve_config["applications"]
    assert set(app) == {"name", "route_prefix", "import_path", "args"} and app["route_prefix"] == "/"
    module, attr = app["import_path"].split(":")
    # The builder exists (read, not imported: Ray Serve is an extra the test run may not have).
    source = (Path(__file__).resolve().parents[1] / (module.replace(".", "/") + ".py")).read_text()
    assert attr in {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    assert set(app["args"]) == {"argv"}
    config = ray_serve_config(parse_serve_app_argv(shlex.split(app["args"]["argv"])))
    assert config.autoscale.min_workers < config.autoscale.max_workers  # the autoscaler has room to act
    _check_ray_cluster(spec["rayClusterConfig"], config, ("serve", 8000))
    for owned in (["--port", "9000"], ["--host=0.0.0.0"], ["--address", "auto"]):  # Serve's, not argv's
        with pytest.raises(ConfigError, match="Ray Serve's to set"):
            parse_serve_app_argv(["--model", "/m.gguf", *owned])
    with pytest.raises(ConfigError, match="not `tokenloom ray-serve` flags"):
        parse_serve_app_argv(["--model", "/m.gguf", "--no-such-flag"])
