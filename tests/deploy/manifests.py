"""deploy/k8s as the cluster would receive it: `kubectl kustomize` renders an overlay (or any
kustomization) into a list of objects. There is no cluster, and none is needed to render.

kubectl is not on PyPI, and `make test-tools` installs it only where apt carries a recent one:
without it, the tests that render are skipped, saying what to install."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# The LoRA adapters the image ships: the Dockerfile links this path to the installed package's
# server/demo/adapters (package data), so a file there is this repository's file of that name.
IMAGE_ADAPTERS = "/opt/diffshard/adapters"
IMAGE_CONTROLNETS = "/opt/diffshard/controlnets"
KUBECTL = (
    "kubectl ≥ 1.21 (kustomize components), e.g. Debian's `kubectl` from Kubernetes' own apt "
    "repository, https://pkgs.k8s.io (https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/); "
    "Debian 12's `kubernetes-client` is 1.20, too old"
)


def render(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip(f"kubectl is not on PATH: rendering deploy/k8s needs {KUBECTL}")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize {folder}: {result.stderr.strip()} (needs {KUBECTL})"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def overlay(name: str) -> list[dict]:
    return render(K8S / "overlays" / name)


def the(objects: list[dict], kind: str, name: str | None = None) -> dict:
    """The one object of `kind` (named `name`, if given) among `objects`."""
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def settings_env(objects: list[dict]) -> dict[str, str]:
    """The DIFFSHARD_* variables the Deployment's container gets from its ConfigMap."""
    return {k: v for k, v in the(objects, "ConfigMap")["data"].items() if k.startswith("DIFFSHARD_")}


def container(objects: list[dict]) -> dict:
    (only,) = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return only


def in_image(path: str) -> Path | None:
    """The repository file the image holds at `path` (one of the shipped adapters or ControlNets),
    else None."""
    folder, _, name = path.rpartition("/")
    shipped = {IMAGE_ADAPTERS: "adapters", IMAGE_CONTROLNETS: "controlnets"}
    return ROOT / "server" / "demo" / shipped[folder] / name if folder in shipped else None


def adapter_paths(value: str) -> dict[str, str]:
    """DIFFSHARD_LORA's NAME=PATH entries (comma-separated) → {name: path}."""
    return dict(entry.strip().split("=", 1) for entry in value.split(",") if entry.strip())
