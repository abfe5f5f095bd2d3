"""A real Prometheus (Debian's `prometheus` package, which `make test` installs) scrapes a live
`python -m server serve`: every PromQL expression of the Grafana dashboard must return a
series, so a panel naming a metric we do not export fails, and the autoscaling queries of
deploy/k8s (KEDA's, prometheus-adapter's for an HPA) return data that follows the load.
promtool checks the scrape config and alert rules and runs the rules' unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from server.metrics import CATALOG, PREFIX
from tests.support.live import free_port, live_server
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "diffshard.json"
RULES = ROOT / "deploy" / "prometheus"
K8S = ROOT / "deploy" / "k8s"
DEADLINE_S = 60
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$device": ".*"}


@pytest.fixture(scope="module")
def prometheus_installed() -> None:
    """Debian's prometheus (server and promtool) on PATH; the Makefile installs it, not the test."""
    missing = [binary for binary in ("prometheus", "promtool") if not shutil.which(binary)]
    if missing:
        not_found = ", ".join(missing)
        pytest.fail(
            f"prometheus is not installed: run `make test`, which installs it ({not_found} not on PATH)"
        )


@pytest.mark.parametrize(
    "command",
    [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ],
)
def test_promtool(prometheus_installed, command: list[str]) -> None:
    result = subprocess.run(["promtool", *command], cwd=RULES, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def families_in(expr: str) -> set[str]:
    """The catalog names of the diffshard metrics an expression reads (suffixes stripped)."""
    names = set(re.findall(rf"{PREFIX}_[a-z_]+", expr))
    return {re.sub(r"_(bucket|sum|count|info)$", "", n).removeprefix(f"{PREFIX}_") for n in names}


@pytest.fixture(scope="module")
def prometheus(prometheus_installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A server with traffic behind it, and a Prometheus scraping its metrics port every second:
    one for the module (its tests read, and wait for the server to be idle before they load it)."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    metrics_port, web_port = free_port(), free_port()
    with live_server("--metrics-port", str(metrics_port)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for seed in range(3):
                body = {"prompt": "a red circle", "seed": seed, "num_inference_steps": 4, "n": 2}
                assert client.post("/v1/images/generations", json=body).status_code == 200
            assert client.post("/v1/images/generations", json={"prompt": ""}).status_code == 400
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\n"
            "scrape_configs:\n"
            # the job and namespace labels the ServiceMonitor gives the series in a cluster
            f"  - job_name: diffshard\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}'],"
            " labels: {namespace: diffshard}}]\n"
        )
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield server.url, f"http://127.0.0.1:{web_port}"
        finally:
            process.terminate()
            process.wait(timeout=30)


def query(api: str, expr: str) -> list:
    response = httpx.get(f"{api}/api/v1/query", params={"query": expr}, timeout=10)
    response.raise_for_status()
    return response.json()["data"]["result"]


def wait_for_series(api: str, expr: str) -> list:
    def series() -> list:
        try:
            return query(api, expr)
        except httpx.HTTPError:  # Prometheus is still starting
            return []

    return wait_until(series, DEADLINE_S, f"a series for {expr}")


def test_every_dashboard_query_returns_a_series(prometheus) -> None:
    url, api = prometheus
    # three scrapes at least: rate() over the window needs two samples
    wait_for_series(api, f'count_over_time({PREFIX}_queue_depth{{job="diffshard"}}[1m]) >= 3')
    cuda_only = {f.name for f in CATALOG if f.cuda_only}
    known = {f.name for f in CATALOG} | {f.name.removesuffix("_total") for f in CATALOG}
    empty = []
    for expr in dashboard_queries():
        families = families_in(expr)
        assert families <= known, f"the dashboard reads metrics diffshard does not export: {families - known}"
        if families & cuda_only and not torch.cuda.is_available():
            continue  # allocator series exist on CUDA devices only
        if any(name.startswith("video_") for name in families):
            continue  # a video model's (this one makes images); tests/test_videos.py reads them
        promql = expr
        for variable, value in GRAFANA_VARIABLES.items():
            promql = promql.replace(variable, value)
        if not query(api, promql):
            empty.append(expr)
    assert not empty, f"dashboard queries with no series: {empty}"
    # the $device variable's values: the devices the server shards over, which `--devices auto`
    # draws from every visible CUDA device, else cpu
    visible = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    served = list(httpx.get(f"{url}/v1/shards").json()["devices"])
    assert served[:1] == visible[:1] and set(served) <= set(visible), served
    devices = httpx.get(
        f"{api}/api/v1/label/device/values", params={"match[]": f"{PREFIX}_shard_parameter_bytes"}
    ).json()["data"]
    assert devices == sorted(served)


def autoscaling_queries() -> dict[str, str]:
    """KEDA's trigger query, and the query prometheus-adapter runs for the HPA alternative with
    its template filled in as the adapter would for the diffshard pods."""
    scaled = yaml.safe_load((K8S / "components" / "keda" / "scaledobject.yaml").read_text())
    (trigger,) = scaled["spec"]["triggers"]
    (rule,) = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter-rules.yaml").read_text())
    adapter = (
        rule["metricsQuery"]
        .replace("<<.GroupBy>>", "instance")
        .replace("<<.LabelMatchers>>", 'job="diffshard",namespace="diffshard"')
    )
    return {"keda": trigger["metadata"]["query"], "hpa": adapter}


def test_autoscaling_queries_follow_the_load(prometheus) -> None:
    url, api = prometheus
    queries = autoscaling_queries()
    for expr in queries.values():  # idle: the fixture's requests have all been answered
        assert float(wait_for_series(api, expr)[0]["value"][1]) == 0
    body = {"prompt": "a green square", "n": 2, "num_inference_steps": 100}
    with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(client.post, "/v1/images/generations", json=body) for _ in range(8)]
        for expr in queries.values():  # 8 requests waiting or denoising: both queries see them
            wait_for_series(api, f"({expr}) >= 4")
        assert [answer.result().status_code for answer in answers] == [200] * 8
