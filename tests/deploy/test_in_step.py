"""deploy/ and the code in step: every port, probe path, DIFFSHARD_* variable, metric and
label that the manifests, the compose files, the Dockerfile, the Prometheus rules, the Grafana
dashboard and the autoscaling queries name must exist in the server. Renaming a setting, a
route or a metric then fails here, not in a cluster at 3 a.m."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, get_args, get_origin

import pytest
import yaml
from pydantic import TypeAdapter

from server.api.health import PROBES
from server.app import create_app
from server.metrics import CATALOG, PREFIX
from server.settings import Settings
from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    ROOT,
    adapter_paths,
    container,
    in_image,
    overlay,
    settings_env,
    the,
)

DEPLOY = ROOT / "deploy"
# Files that configure the server from outside, and files that hold PromQL.
CONFIGURING = [*DEPLOY.rglob("*.y*ml"), *ROOT.glob("docker-compose*.yml"), *ROOT.glob("Dockerfile*")]
PROMQL = [*(DEPLOY / "prometheus").glob("*.yml"), *(DEPLOY / "grafana").rglob("*.json"), *K8S.rglob("*.yaml")]
# Labels Prometheus (or the Operator's ServiceMonitor) adds to every scraped series, and le.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint", "le"}
SUFFIXES = re.compile(r"_(total|created|bucket|sum|count|info)$")
METRIC = re.compile(rf"\b{PREFIX}_[a-z0-9_]+")


def read(path: Path) -> str:
    return path.read_text()


def promql(path: Path) -> str:
    """The file's text; for a Grafana dashboard, its panels' and variables' queries."""
    if path.suffix != ".json":
        return read(path)
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            found.extend(
                v for k, v in node.items() if k in ("expr", "query", "definition") and isinstance(v, str)
            )
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(read(path)))
    return "\n".join(found)


def setting_names() -> set[str]:
    return {f"DIFFSHARD_{name.upper()}" for name in Settings.model_fields}


def route_paths() -> set[str]:
    return set(create_app(Settings()).openapi()["paths"])  # every route is documented


def metric_labels() -> dict[str, set[str]]:
    """Each exported family (suffixes stripped) and its labels."""
    return {SUFFIXES.sub("", f"{PREFIX}_{spec.name}"): set(spec.labels) for spec in CATALOG}


def adapter_names() -> set[str]:
    """Names prometheus-adapter gives the metrics it serves (they are not ours to export)."""
    rules = yaml.safe_load(read(K8S / "components" / "hpa" / "prometheus-adapter-rules.yaml"))
    return {rule["name"]["as"] for rule in rules}


@pytest.mark.parametrize("path", CONFIGURING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_diffshard_variable_is_a_setting(path: Path) -> None:
    unknown = set(re.findall(r"\bDIFFSHARD_[A-Z0-9_]+", read(path))) - setting_names()
    assert not unknown, f"{path.name} names settings the server does not have: {sorted(unknown)}"


def is_path(annotation: object) -> bool:
    """A Path setting, optional or not, or a Path with a check of its own (`settings/values.py::Folder`)."""
    kinds = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    return all(a is Path or (get_origin(a) is Annotated and get_args(a)[0] is Path) for a in kinds)


@pytest.mark.parametrize("name", OVERLAYS)
def test_configmap_values_are_valid_settings(name: str) -> None:
    """Each value parses as its setting does at startup (type and bounds; the model folder and
    key file exist only in the pod, the adapters the image ships are this repository's)."""
    for variable, value in settings_env(overlay(name)).items():
        field = Settings.model_fields[variable.removeprefix("DIFFSHARD_").lower()]
        if is_path(field.annotation):  # checked at startup in the pod (a folder, a key file): absolute
            assert value.startswith("/"), f"{variable}: {value}"
            continue
        if variable in ("DIFFSHARD_LORA", "DIFFSHARD_CONTROLNET"):  # NAME=PATH; what the image ships: ours
            paths = adapter_paths(value)
            assert all(p.startswith("/") for p in paths.values()), f"{variable}: {value}"
            value = ",".join(f"{n}={in_image(p)}" for n, p in paths.items() if in_image(p))
        # a ValidationError names the value and the bound it breaks
        constrained = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
        TypeAdapter(constrained).validate_python(value)


@pytest.mark.parametrize("name", OVERLAYS)
def test_ports_and_probes_are_the_servers(name: str) -> None:
    objects = overlay(name)
    env = settings_env(objects)
    defaults = Settings.model_fields
    api = int(env.get("DIFFSHARD_PORT", defaults["port"].default))
    metrics = int(env.get("DIFFSHARD_METRICS_PORT", defaults["metrics_port"].default))
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    assert ports == {"http": api, "metrics": metrics}
    assert env.get("DIFFSHARD_HOST") == "0.0.0.0"  # reachable from outside the pod
    service = the(objects, "Service", "diffshard")
    service_ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert set(service_ports.values()) <= set(ports)
    (endpoint,) = the(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"
    for rule in the(objects, "NetworkPolicy", "diffshard")["spec"]["ingress"]:
        assert {p["port"] for p in rule["ports"]} <= set(ports)
    probes = [container(objects)[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    # on the metrics port, which answers them too: never refused with clients' connections
    assert {p["path"] for p in probes} <= set(PROBES) <= route_paths()
    assert {p["port"] for p in probes} == {"metrics"}


def test_images_compose_and_scrape_config_use_the_servers_ports_and_paths() -> None:
    defaults = Settings.model_fields
    api, metrics = defaults["port"].default, defaults["metrics_port"].default
    paths = {api: route_paths() | {"", "/"}, metrics: {"", "/", "/metrics", *PROBES}}
    for dockerfile in ROOT.glob("Dockerfile*"):
        exposed = re.findall(r"^EXPOSE (.+)$", read(dockerfile), re.M)
        assert {int(p) for line in exposed for p in line.split()} == {api, metrics}, dockerfile.name
    for path in [*ROOT.glob("Dockerfile*"), *ROOT.glob("docker-compose*.yml")]:
        for port, route in re.findall(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[a-z/]*)?", read(path)):
            if int(port) in paths:  # the others are Prometheus's and Grafana's
                assert route in paths[int(port)], f"{path.name}: :{port}{route} is not the server's"
    scrape = yaml.safe_load(read(DEPLOY / "prometheus" / "prometheus.yml"))
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert {int(t.rsplit(":", 1)[1]) for t in targets} == {defaults["metrics_port"].default}


@pytest.mark.parametrize("path", PROMQL, ids=lambda p: str(p.relative_to(ROOT)))
def test_metrics_and_labels_are_exported(path: Path) -> None:
    text = promql(path)
    families = metric_labels()
    all_labels = set().union(*families.values()) | TARGET_LABELS
    for name in set(METRIC.findall(text)) - adapter_names():
        assert SUFFIXES.sub("", name) in families, f"{path.name}: {name} is not exported"
    for name, selector in re.findall(rf"({PREFIX}_[a-z0-9_]+)\{{([^}}]*)\}}", text):
        used = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", selector))
        allowed = families.get(SUFFIXES.sub("", name), set()) | TARGET_LABELS
        assert used <= allowed, f"{path.name}: {name} has no labels {used - allowed}"
    grouped = {
        label.strip() for group in re.findall(r"\bby \(([^)<]*)\)", text) for label in group.split(",")
    }
    templated = set(re.findall(r"\$labels\.(\w+)", text)) | set(
        re.findall(r"label_values\([^,]+,\s*(\w+)\)", text)
    )
    assert (grouped | templated) - {""} <= all_labels, f"{path.name}: unknown labels"


def test_dashboard_panels_have_their_own_ids_and_places() -> None:
    """Grafana lays out a dashboard by gridPos and tells panels apart by id: no two may share."""
    panels = json.loads(read(DEPLOY / "grafana" / "dashboards" / "diffshard.json"))["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, f"{panel['title']} runs past the 24 columns"
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{panel['title']} overlaps {taken[cell]}"
            taken[cell] = panel["title"]


def test_the_checks_catch_a_renamed_metric(tmp_path: Path) -> None:
    """The check above is not vacuous: a query on a metric we do not export fails it."""
    query = tmp_path / "bad.yaml"
    query.write_text('query: sum(diffshard_queue_depthh{job="diffshard"})\n')
    with pytest.raises(AssertionError, match="diffshard_queue_depthh is not exported"):
        test_metrics_and_labels_are_exported(query)
