"""k8s/: the RayService validates against KubeRay's CRD schema; PodMonitor and Grafana dashboard agree with the
labels, ports and metric names the server really exports."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# beside the checkout (or, for a git worktree in <dir>/wt/<name>, beside <dir>)
CRD = next((p for p in (base / "shared" / "k8s-schemas" / "ray.io_rayservices.yaml" for base in (ROOT.parent,
                                                                                               ROOT.parents[1]))
            if p.is_file()), ROOT.parent / "shared" / "k8s-schemas" / "ray.io_rayservices.yaml")
K8S = ROOT / "k8s"

# The metric families the server exports (deployments/engine/metrics.py), as Prometheus sees them through Ray's metrics
# agent: Ray adds the `ray_` prefix, counters get `_total`, histograms `_bucket/_sum/_count`. The names are vLLM's
# with `vllm:` written `vllm_` (Ray no longer accepts ':' in metric names).
COUNTERS = {"spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_steps", "prompt_tokens", "generation_tokens",
            "request_success", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions"}
GAUGES = {"spec_decode_mean_accept_length", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
HISTOGRAMS = {"time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_params_max_tokens", "request_params_n", "iteration_tokens_total"}
FAMILIES = ({f"ray_vllm_{n}_total" for n in COUNTERS} | {f"ray_vllm_{n}" for n in GAUGES}
            | {f"ray_vllm_{n}" for n in HISTOGRAMS})


# ---------------------------------------------------------------- CRD schema


def structural(node):
    """An OpenAPI v3 (Kubernetes structural) schema as JSON Schema Draft 7, with the API server's semantics:
    `x-kubernetes-*` keys dropped (int-or-string already carries its anyOf), `nullable` admits null, and objects
    with `properties` reject unknown fields like `kubectl apply` (strict field validation) does, unless they
    preserve unknown fields."""
    if isinstance(node, list):
        return [structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k.startswith("x-kubernetes-") or k == "nullable":
            continue
        out[k] = {name: structural(s) for name, s in v.items()} if k == "properties" else structural(v)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    if not CRD.is_file():
        pytest.skip(f"KubeRay RayService CRD not found at {CRD} (expected beside the checkout in shared/k8s-schemas/)")
    crd = yaml.safe_load(CRD.read_text())
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = structural(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def rayservice():
    return yaml.safe_load((K8S / "rayservice.yaml").read_text())


def errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_rayservice_matches_crd(validator, rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert rayservice["metadata"]["name"] == "specserve"
    assert errors(validator, rayservice) == []


def _worker(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


@pytest.mark.parametrize("breakage", [
    "replicas as string", "rayStartParams value as int", "missing groupName", "missing headGroupSpec",
    "unknown field", "serveConfigV2 as object", "container ports not a list"])
def test_crd_validation_can_fail(validator, rayservice, breakage):
    bad = copy.deepcopy(rayservice)
    rc = bad["spec"]["rayClusterConfig"]
    if breakage == "replicas as string":
        _worker(bad)["replicas"] = "one"
    elif breakage == "rayStartParams value as int":
        rc["headGroupSpec"]["rayStartParams"]["metrics-export-port"] = 8080  # must be a string
    elif breakage == "missing groupName":
        del _worker(bad)["groupName"]
    elif breakage == "missing headGroupSpec":
        del rc["headGroupSpec"]
    elif breakage == "unknown field":
        _worker(bad)["rayStartParam"] = _worker(bad).pop("rayStartParams")  # a typo the API server rejects
    elif breakage == "serveConfigV2 as object":
        bad["spec"]["serveConfigV2"] = yaml.safe_load(bad["spec"]["serveConfigV2"])
    elif breakage == "container ports not a list":
        rc["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"] = {"containerPort": 8080}
    assert errors(validator, bad), f"{breakage}: the schema accepted a broken manifest"


# ---------------------------------------------------------------- serve config


def test_serve_config(rayservice):
    serve_cfg = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve_cfg["applications"]
    assert app["name"] == "specserve" and app["route_prefix"] == "/"
    assert app["import_path"] == "deployments.app:build_app"
    assert app["runtime_env"]["env_vars"] == {"HF_HUB_OFFLINE": "1"}
    args = app["args"]
    assert args["model_loading_config"] == {"model_id": "llama-3.1-8b-instruct",
                                            "model_source": "/models/Meta-Llama-3.1-8B-Instruct"}
    ek = args["engine_kwargs"]
    assert ek["tensor_parallel_size"] == 2 and ek["device"] == "cuda" and ek["dtype"] == "bfloat16"
    assert ek["speculative_config"] == {"method": "eagle3", "model": "/models/EAGLE3-LLaMA3.1-Instruct-8B",
                                        "num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    # the ingress replicas (HTTP, tokenizing, detokenizing) scale; the one controller owns the engine core
    assert args["ingress_deployment_config"]["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2,
                                                                       "target_ongoing_requests": 128}
    assert "deployment_config" not in args
    assert args["placement_group_config"] == {"strategy": "STRICT_PACK"}

    worker = _worker(rayservice)
    assert worker["groupName"] == "gpu-workers"
    (container,) = worker["template"]["spec"]["containers"]
    for kind in ("requests", "limits"):
        assert int(container["resources"][kind]["nvidia.com/gpu"]) == ek["tensor_parallel_size"] == 2
    # the API key comes from a Secret in every Ray container (the ingress replicas may run on any node), never in
    # the Serve config's args
    head_container = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    for c in (container, head_container):
        (key,) = [e for e in c["env"] if e["name"] == "SPECSERVE_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"]["name"] == "specserve-api-key"
    assert "api_key" not in args and "api_key_file" not in args
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert all("nvidia.com/gpu" not in c.get("resources", {}).get(k, {})
               for c in head["template"]["spec"]["containers"] for k in ("requests", "limits"))

    # the model and draft paths live on the read-only models PVC mounted on the workers
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["claimName"] == "specserve-models"
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"


def test_serve_config_parses_as_our_config(rayservice):
    """The args are accepted by the project's own config models (skipped where deployments/ cannot be imported)."""
    config = pytest.importorskip("deployments.config")
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    engine = config.LLMConfig(**args).engine_config()
    assert engine.tensor_parallel_size == 2 and engine.speculative_config.method == "eagle3"
    # TP ranks meet on one node: a strategy that may spread them is refused with the reason, not left to hang
    spread = dict(args, placement_group_config={"strategy": "PACK"})
    with pytest.raises(ValueError, match="use STRICT_PACK"):
        config.LLMConfig(**spread)
    assert config.LLMConfig(**dict(spread, engine_kwargs=dict(args["engine_kwargs"], tensor_parallel_size=1)))


def test_dp2_rayservice_matches_crd_and_runs_two_engine_replicas(validator, rayservice):
    """k8s/rayservice-dp2.yaml: the same cluster with two engine replicas (data parallel), one GPU pod each, behind
    the prefix-aware router; it validates against the CRD and parses as our config."""
    dp2 = yaml.safe_load((K8S / "rayservice-dp2.yaml").read_text())
    assert errors(validator, dp2) == []
    assert dp2["metadata"]["name"] == "specserve-dp2"
    args = yaml.safe_load(dp2["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["deployment_config"] == {"num_replicas": 2}
    assert args["request_router"]["policy"] == "prefix_aware"
    worker = _worker(dp2)
    (container,) = worker["template"]["spec"]["containers"]
    tp = args["engine_kwargs"]["tensor_parallel_size"]
    # every engine replica's TP ranks fit in one pod (STRICT_PACK), and there is a pod per replica
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == tp
    assert worker["replicas"] == worker["minReplicas"] == args["deployment_config"]["num_replicas"]
    # the rest is the single-replica manifest's
    assert dp2["spec"]["rayClusterConfig"]["headGroupSpec"] == rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert worker["template"] == _worker(rayservice)["template"]
    config = pytest.importorskip("deployments.config")
    cfg = config.LLMConfig(**args)
    assert cfg.request_router.imbalanced_threshold == 16 and cfg.engine_config().tensor_parallel_size == tp


# ---------------------------------------------------------------- PodMonitor


def pod_labels(rc) -> list[tuple[dict, dict]]:
    """(labels a pod of each group gets, its template): the template's labels plus those KubeRay adds."""
    out = [({**rc["headGroupSpec"]["template"]["metadata"]["labels"], "ray.io/is-ray-node": "yes",
             "ray.io/node-type": "head"}, rc["headGroupSpec"]["template"])]
    for g in rc["workerGroupSpecs"]:
        out.append(({**g["template"]["metadata"]["labels"], "ray.io/is-ray-node": "yes",
                     "ray.io/node-type": "worker", "ray.io/group": g["groupName"]}, g["template"]))
    return out


def test_podmonitor_selects_pods_and_port(rayservice):
    pm = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    selector = pm["spec"]["selector"]["matchLabels"]
    assert selector.get("ray.io/is-ray-node") == "yes"
    # our own label must narrow the selection: the template labels carry every non-KubeRay selector label
    rc = rayservice["spec"]["rayClusterConfig"]
    for _, template in pod_labels(rc):
        own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}
        assert own and own.items() <= template["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    for labels, template in pod_labels(rc):
        assert selector.items() <= labels.items()
        ports = [p for c in template["spec"]["containers"] for p in c.get("ports", []) if p["name"] == endpoint["port"]]
        assert [p["containerPort"] for p in ports] == [8080]
    params = [rc["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in rc["workerGroupSpecs"]]
    assert all(p["metrics-export-port"] == "8080" for p in params)
    head_ports = {p["name"]: p["containerPort"] for c in rc["headGroupSpec"]["template"]["spec"]["containers"]
                  for p in c.get("ports", [])}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}


# ---------------------------------------------------------------- Grafana dashboard


def family(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in FAMILIES:
            return name[: -len(suffix)]
    return name


@pytest.fixture(scope="module")
def dashboard():
    return json.loads((K8S / "grafana-dashboard.json").read_text())


def all_panels(dash):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # panels inside collapsed rows


def test_dashboard_metrics(dashboard):
    targets = [(p["title"], t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])]
    assert targets
    used = set()
    for title, expr in targets:
        names = set(re.findall(r"\b(?:ray_)?vllm[:_][a-zA-Z0-9_:]+", expr))
        assert names, f"{title}: no metric in {expr}"
        assert not {n for n in names if ":" in n}, f"{title}: Ray exports vllm_ names, not vllm: ({expr})"
        fams = {family(n) for n in names}
        assert fams <= FAMILIES, f"{title}: unknown metrics {fams - FAMILIES}"
        for n in names:  # histogram families only through their series, counters only as _total
            base = family(n)
            assert (n == base) != (base[len("ray_vllm_"):] in HISTOGRAMS), f"{title}: {n}"
        assert expr.count('{model_name=~"$model_name"') == len(re.findall(r"\bray_vllm_", expr)), (
            f"{title}: every selector must filter model_name=~\"$model_name\": {expr}")
        used |= fams
    assert used == FAMILIES, f"metric families without a panel: {FAMILIES - used}"


def test_dashboard_queries(dashboard):
    exprs = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in all_panels(dashboard)}
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Speculative decoding", "Latency", "Throughput", "Load", "Prefix cache"]
    mal = " ".join(exprs["Mean accept length"])
    assert "1 + " in mal and "ray_vllm_spec_decode_mean_accept_length" in mal
    assert any("by (position)" in e and "spec_decode_num_drafts_total" in e
               for e in exprs["Per-position acceptance rate"])
    for title, quantiles in [("Time to first token", {"0.5", "0.9", "0.99"}),
                             ("Inter-token latency", {"0.5", "0.9", "0.99"}),
                             ("Time per output token (per request)", {"0.5", "0.9", "0.99"}),
                             ("End-to-end request latency", {"0.5", "0.99"})]:
        got = set()
        for e in exprs[title]:
            m = re.fullmatch(r"histogram_quantile\(([0-9.]+), sum by \(le\) \(rate\(ray_vllm_\w+_bucket\{[^}]*\}"
                             r"\[1m\]\)\)\)", e)
            assert m, f"{title}: {e}"
            got.add(m.group(1))
        assert got == quantiles, title
    assert any("by (finished_reason)" in e for e in exprs["Finished requests/s"])
    phases = [re.fullmatch(r"histogram_quantile\(0\.5, sum by \(le\) \(rate\(ray_vllm_request_(\w+)_time_seconds_bucket"
                           r"\{[^}]*\}\[1m\]\)\)\)", e) for e in exprs["Request phases (p50 of finished requests)"]]
    assert [m and m.group(1) for m in phases] == ["queue", "prefill", "decode", "inference"], phases
    (hit_rate,) = exprs["Prefix cache hit rate"]
    assert re.fullmatch(r"sum\(rate\(ray_vllm_prefix_cache_hits_total\{[^}]*\}\[1m\]\)\) / "
                        r"sum\(rate\(ray_vllm_prefix_cache_queries_total\{[^}]*\}\[1m\]\)\)", hit_rate), hit_rate
    (per_replica,) = exprs["Prefix cache hit rate per replica"]
    assert per_replica.count("sum by (replica)") == 2, per_replica


def test_dashboard_variables(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    mn = variables["model_name"]
    assert mn["type"] == "query"
    query = mn["query"]["query"] if isinstance(mn["query"], dict) else mn["query"]
    assert query == "label_values(ray_vllm_num_requests_running, model_name)"
    for p in all_panels(dashboard):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_dashboard_names_match_exporter():
    """FAMILIES above is what deployments/engine/metrics.py registers (skipped where ray or deployments/ is missing)."""
    metrics = pytest.importorskip("ray.util.metrics")
    engine_metrics = pytest.importorskip("deployments.engine.metrics")
    names = set()
    registered = [*vars(engine_metrics.EngineMetrics("x")).values(), *vars(engine_metrics.RequestMetrics("x")).values()]
    registered += [m for group in registered if isinstance(group, dict) for m in group.values()]  # (grouped ones)
    for m in registered:
        if isinstance(m, metrics.Counter):
            names.add(f"ray_{m._name}_total")
        elif isinstance(m, (metrics.Histogram, metrics.Gauge)):  # histograms: the family of _bucket/_sum/_count
            names.add(f"ray_{m._name}")
    assert names == FAMILIES
