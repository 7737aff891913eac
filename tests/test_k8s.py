"""k8s/: the RayService validates against KubeRay's CRD schema; PodMonitor and Grafana dashboard agree with the
labels, ports and metric names the server really exports."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import yaml

from conftest import ROOT

CRD = ROOT.parent / "shared" / "k8s-schemas" / "ray.io_rayservices.yaml"
K8S = ROOT / "k8s"


@pytest.fixture(scope="module")
def schema():
    if not CRD.is_file():
        pytest.skip(f"KubeRay CRD schema not found at {CRD}")
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def rayservice():
    return yaml.safe_load((K8S / "rayservice.yaml").read_text())


def test_rayservice_matches_crd(schema, rayservice):
    jsonschema.Draft7Validator(schema).validate(rayservice)


def test_crd_validation_can_fail(schema, rayservice):
    bad = copy.deepcopy(rayservice)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)
    bad = copy.deepcopy(rayservice)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)


def test_serve_config_builds_our_app(rayservice):
    from deployments.config import LLMConfig

    serve_cfg = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    app = serve_cfg["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = LLMConfig(**app["args"])  # the args parse as our config (engine kwargs too)
    engine = cfg.engine_config()
    gpus = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == engine.tensor_parallel_size == 2
    assert engine.speculative_config.method == "eagle3"


def test_podmonitor_selects_pods_and_port(rayservice):
    pm = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
    selector = pm["spec"]["selector"]["matchLabels"]
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    rc = rayservice["spec"]["rayClusterConfig"]
    templates = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]
    for t in templates:
        assert selector.items() <= t["metadata"]["labels"].items()
        assert any(p["name"] == port for c in t["spec"]["containers"] for p in c.get("ports", []))
    params = [rc["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in rc["workerGroupSpecs"]]
    assert all(p["metrics-export-port"] == "8080" for p in params)


def exported_metric_families() -> set[str]:
    """Every Prometheus family name the server exports (Ray prefixes ray_, counters get _total)."""
    from ray.util.metrics import Counter, Gauge, Histogram

    from deployments.metrics import EngineMetrics

    names = set()
    for m in vars(EngineMetrics("x")).values():
        if isinstance(m, Counter):
            names.add(f"ray_{m._name}_total")
        elif isinstance(m, Histogram):
            names |= {f"ray_{m._name}_{s}" for s in ("bucket", "sum", "count")}
        elif isinstance(m, Gauge):
            names.add(f"ray_{m._name}")
    return names


def test_dashboard_uses_exported_metrics():
    dash = json.loads((K8S / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\bray_vllm_[a-z0-9_]+", e)}
    exported = exported_metric_families()
    assert used and used <= exported, used - exported
    assert all('model_name=~"$model_name"' in e for e in exprs)
    spec_families = {n for n in exported if "spec_decode" in n}
    assert spec_families <= used  # every speculative metric has a panel
    titles = {p["title"] for p in dash["panels"]}
    assert {"Mean accept length", "Per-position acceptance rate", "Drafted vs accepted tokens/s",
            "Time to first token", "Inter-token latency"} <= titles
