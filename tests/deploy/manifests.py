"""deploy/k8s as the cluster would receive it: `kubectl kustomize` renders an overlay (or any
kustomization) into a list of objects. kubectl (with kustomize built in) is on these machines;
there is no cluster, and none is needed to render."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")


def render(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: install kubectl (it renders deploy/k8s with kustomize)")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize {folder}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def overlay(name: str) -> list[dict]:
    return render(K8S / "overlays" / name)


def the(objects: list[dict], kind: str) -> dict:
    """The one object of `kind` among `objects`."""
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def settings_env(objects: list[dict]) -> dict[str, str]:
    """The DIFFSHARD_* variables the Deployment's container gets from its ConfigMap."""
    return {k: v for k, v in the(objects, "ConfigMap")["data"].items() if k.startswith("DIFFSHARD_")}


def container(objects: list[dict]) -> dict:
    (only,) = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return only
