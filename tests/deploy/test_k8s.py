"""deploy/k8s, checked offline (there is no cluster here). Both overlays render; every object
validates, strictly (an unknown field fails), against the Kubernetes API schemas that PyPI's
kubernetes-validate ships, for the oldest and newest Kubernetes we support; ServiceMonitor,
PrometheusRule and ScaledObject against their CRDs' schemas, vendored in tests/deploy/crds/
(SOURCES.md says from where). And a pod's timings agree with the server's: its termination
grace covers preStop, the drain and the shutdown, and its startup probe outlasts a measured
model load."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kubernetes_schemas

from server.__main__ import SHUTDOWN_GRACE_S
from server.settings import Settings
from tests.deploy.manifests import K8S, OVERLAYS, container, overlay, render, settings_env, the
from tests.deploy.test_images import image_env
from tests.support.live import live_server

KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
CRDS = Path(__file__).parent / "crds"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
TERMINATION_MARGIN_S = 5  # for the kubelet to deliver SIGTERM and the process to exit
STARTUP_MARGIN = 5  # a startup probe gives a model load at least 5x what it took here


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> list[dict]:
    return overlay(request.param)


def closed(schema: dict) -> dict:
    """`schema` with unknown fields refused wherever the API server would prune them (objects
    with properties that do not preserve unknown fields), as `kubectl apply --validate=strict`
    refuses them."""
    if isinstance(schema, dict):
        schema = {key: closed(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [closed(item) for item in schema]
    return schema


def crd_validators() -> dict[tuple[str, str], jsonschema.Validator]:
    validators = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = closed(version["schema"]["openAPIV3Schema"])
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators


def problems(objects: list[dict]) -> list[str]:
    """What the API server (with the CRDs installed) would refuse among `objects`."""
    crds = crd_validators()
    found = []
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_KINDS:
            validator = crds.get((obj["apiVersion"], obj["kind"]))
            if validator is None:
                found.append(f"{where}: no vendored CRD for {obj['apiVersion']}")
                continue
            found += [f"{where}: {e.json_path}: {e.message}" for e in validator.iter_errors(obj)]
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_schemas.validate(obj, version, strict=True)
            except (kubernetes_schemas.ValidationError, kubernetes_schemas.SchemaNotFoundError) as e:
                found.append(f"{where} (Kubernetes {version}): {getattr(e, 'message', e)}")
    return found


def test_overlays_render_objects_the_api_server_accepts(rendered) -> None:
    kinds = {o["kind"] for o in rendered}
    expected = {"Namespace", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"}
    assert expected | CRD_KINDS <= kinds
    assert problems(rendered) == []


def test_validation_refuses_what_a_cluster_would() -> None:
    """The checks above could fail: a misspelt field fails both kinds of schema."""
    objects = overlay("cpu")
    container(objects)["readinessprobe"] = {"httpGet": {"path": "/readyz", "port": "http"}}
    the(objects, "ScaledObject")["spec"]["minReplicas"] = 1
    found = problems(objects)
    assert any("Deployment/diffshard" in p and "readinessprobe" in p for p in found), found
    assert any("ScaledObject/diffshard" in p and "minReplicas" in p for p in found), found


def test_gpu_overlay_asks_for_gpus_and_mounts_the_models() -> None:
    gpu, cpu = overlay("gpu"), overlay("cpu")
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "nvidia.com/gpu" not in container(cpu)["resources"]["limits"]
    assert settings_env(gpu)["DIFFSHARD_MODEL"].startswith("/models/")
    assert the(gpu, "PersistentVolumeClaim")["metadata"]["name"] == "diffshard-models"
    assert not [o for o in cpu if o["kind"] == "PersistentVolumeClaim"]  # the built-in model


def test_scaled_object_bounds(rendered) -> None:
    """KEDA's CEL rule (minReplicaCount ≤ maxReplicaCount), which jsonschema does not run, and
    no scaling to zero: a replica takes minutes to load its model."""
    spec = the(rendered, "ScaledObject")["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]


def test_hpa_alternative_renders_and_validates(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes relative paths only
                "resources": [os.path.relpath(K8S / "base", tmp_path)],
                "components": [os.path.relpath(K8S / "components" / "hpa", tmp_path)],
            }
        )
    )
    objects = render(tmp_path)
    hpa = the(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == the(objects, "Deployment")["metadata"]["name"]
    assert problems(objects) == []


def test_example_secret_validates_and_is_not_deployed(rendered) -> None:
    secret = yaml.safe_load((K8S / "examples" / "api-keys-secret.yaml").read_text())
    assert problems([secret]) == []
    assert not [o for o in rendered if o["kind"] == "Secret"]  # no deployment with a known key
    volumes = the(rendered, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert [v["secret"]["secretName"] for v in volumes if "secret" in v] == [secret["metadata"]["name"]]


def test_prometheus_rule_is_the_alert_rules() -> None:
    alerts = yaml.safe_load((K8S.parent / "prometheus" / "alerts.yml").read_text())
    rule = yaml.safe_load((K8S / "components" / "monitoring" / "prometheusrule.yaml").read_text())
    assert rule["spec"] == alerts, "copy deploy/prometheus/alerts.yml's groups into the PrometheusRule"


def test_termination_grace_covers_prestop_drain_and_shutdown(rendered) -> None:
    pod = the(rendered, "Deployment")["spec"]["template"]["spec"]
    command = container(rendered)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    pre_stop_s = float(command[1])
    drain_s = float(
        settings_env(rendered).get(
            "DIFFSHARD_DRAIN_TIMEOUT_S", Settings.model_fields["drain_timeout_s"].default
        )
    )
    needed = pre_stop_s + drain_s + SHUTDOWN_GRACE_S + TERMINATION_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed, (
        f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} < preStop {pre_stop_s}"
        f" + drain {drain_s} + shutdown {SHUTDOWN_GRACE_S} + margin {TERMINATION_MARGIN_S}"
    )


@pytest.mark.parametrize("variable", ["DIFFSHARD_CACHE_DIR", "XDG_DATA_HOME"])
def test_writable_folders_are_writable_volumes(rendered, variable: str) -> None:
    """The root filesystem is read-only: the planner's cache (DIFFSHARD_CACHE_DIR) must be a
    volume mounted writable at that very path, or every pod calibrates again and warns; so must
    the image's data home (XDG_DATA_HOME), the video jobs' default store."""
    folder = settings_env(rendered).get(variable) or image_env(variable)
    assert container(rendered)["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in container(rendered)["volumeMounts"]}
    assert folder in mounts, f"{variable}={folder} is none of the mounts {sorted(mounts)}"
    assert not mounts[folder].get("readOnly") and "subPath" not in mounts[folder]
    volumes = {v["name"]: v for v in the(rendered, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts[folder]["name"]]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume, volume
    assert not volume.get("persistentVolumeClaim", {}).get("readOnly"), volume


def selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def admits(rule: dict, labels: dict, ports: set) -> bool:
    """An ingress rule lets pods labelled `labels` (in the policy's namespace) in on one of `ports`."""
    peers = [peer.get("podSelector") for peer in rule.get("from", []) if "namespaceSelector" not in peer]
    return any(s is not None and selects(s, labels) for s in peers) and any(
        p["port"] in ports for p in rule.get("ports", [])
    )


def test_overlays_keep_video_jobs_in_a_redis_only_diffshard_reaches(rendered) -> None:
    """DIFFSHARD_JOB_STORE names the Redis Service, whose pods keep their data on a volume and
    answer PING; every policy on those pods admits the diffshard pods on the Redis port, and the
    diffshard pods' own policy restricts no egress."""
    store = urlsplit(settings_env(rendered)["DIFFSHARD_JOB_STORE"])
    assert store.scheme == "redis", store.geturl()
    service = the(rendered, "Service", store.hostname)
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == (store.port or 6379)]
    redis = the(rendered, "StatefulSet", store.hostname)
    pod = redis["spec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    (server,) = pod["spec"]["containers"]
    assert "--appendonly" in server["args"] and server["securityContext"]["readOnlyRootFilesystem"]
    assert {m["name"]: m["mountPath"] for m in server["volumeMounts"]}["data"] == "/data"
    assert [c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]] == ["data"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "redis-cli ping" in " ".join(server[probe]["exec"]["command"]), probe

    diffshard_pod = the(rendered, "Deployment", "diffshard")["spec"]["template"]["metadata"]["labels"]
    redis_ports = {port["targetPort"], *(p["containerPort"] for p in server["ports"])}
    policies = [o for o in rendered if o["kind"] == "NetworkPolicy"]
    guarding = [o["spec"] for o in policies if selects(o["spec"]["podSelector"], pod["metadata"]["labels"])]
    assert guarding, "nothing keeps Redis (no auth) from every pod in the cluster"
    for spec in guarding:
        assert any(admits(rule, diffshard_pod, redis_ports) for rule in spec.get("ingress", [])), (
            f"a NetworkPolicy keeps the diffshard pods from Redis: {spec}"
        )
    own = [o["spec"] for o in policies if selects(o["spec"]["podSelector"], diffshard_pod)]
    assert own and all("Egress" not in spec["policyTypes"] for spec in own), own


def test_every_object_lands_in_the_namespace(rendered) -> None:
    """The components' objects too: without a namespace they would go to kubectl's current one,
    away from the Deployment they scale, scrape or serve."""
    namespaced = [o for o in rendered if o["kind"] != "Namespace"]
    namespace = the(rendered, "Namespace")["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {namespace}


@pytest.mark.slow
def test_startup_probe_outlasts_a_model_load() -> None:
    """From process start to ready, measured on the built-in model (what the cpu overlay
    serves); the probe's budget must exceed it STARTUP_MARGIN times. Bigger models load longer:
    the gpu overlay's budget is sized for GBs from a network volume (10 minutes)."""
    started = time.monotonic()
    with live_server():
        load_s = time.monotonic() - started
    for name in OVERLAYS:
        probe = container(overlay(name))["startupProbe"]
        budget_s = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
        assert probe["httpGet"]["path"] == "/readyz"  # passes once the model is loaded
        assert budget_s >= STARTUP_MARGIN * load_s, f"{name}: {budget_s} s for a {load_s:.1f} s load"
