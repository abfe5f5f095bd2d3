"""LoRA adapters in the deployments, checked offline. Compose and both Kubernetes overlays carry
the adapter settings (DIFFSHARD_LORA, DIFFSHARD_LORA_DIR); every adapter file they name is one the
image ships (this repository's server/demo/adapters) or lies in a mounted volume, and the adapter
folder is a mounted volume. The diamond trained on the built-in model is served wherever the
built-in model is (compose, the cpu overlay); the gpu overlay serves a model of yours, with the
adapters in its PVC."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    IMAGE_ADAPTERS,
    K8S,
    OVERLAYS,
    ROOT,
    adapter_paths,
    container,
    in_image,
    overlay,
    render,
    settings_env,
)
from tests.deploy.test_images import BASE, GPU, instructions, rendered
from tests.deploy.test_k8s import problems

DIAMOND = ROOT / "server" / "demo" / "adapters" / "diamond.safetensors"


def under(path: str, mounts: set[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def served(env: dict[str, str], mounts: set[str]) -> tuple[dict[str, str], str | None]:
    """The adapters `env` names ({name: path}) and its adapter folder, each checked to be in the
    image or under one of `mounts`."""
    lora = adapter_paths(env.get("DIFFSHARD_LORA", ""))
    for name, path in lora.items():
        shipped = in_image(path)
        assert (shipped and shipped.is_file()) or under(path, mounts), (
            f"DIFFSHARD_LORA {name}={path} is neither an adapter the image ships nor in a mounted volume"
        )
    folder = env.get("DIFFSHARD_LORA_DIR")
    assert folder is None or under(folder, mounts), f"DIFFSHARD_LORA_DIR={folder} is none of {sorted(mounts)}"
    assert lora or folder, "no adapter setting (DIFFSHARD_LORA, DIFFSHARD_LORA_DIR)"
    return lora, folder


def test_the_image_ships_the_trained_adapter_at_a_fixed_path() -> None:
    assert DIAMOND.is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "adapters/*" in package_data["server.demo"], "the wheel (and so the image) lacks the adapters"
    runs = " ".join(args for name, args in instructions(ROOT / "Dockerfile") if name == "RUN")
    assert re.search(rf"\bln -s \S.*\s{re.escape(IMAGE_ADAPTERS)}(?:\s|$)", runs), (
        f"the image does not link {IMAGE_ADAPTERS} to the package's adapters"
    )


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU)], ids=["base", "gpu"])
def test_compose_serves_the_trained_adapter_and_a_mounted_folder(
    files: tuple[str, ...], tmp_path: Path
) -> None:
    diffshard = rendered(*files, tmp_path=tmp_path)["services"]["diffshard"]
    mounts = {v["target"]: v for v in diffshard.get("volumes", [])}
    lora, folder = served(diffshard["environment"], set(mounts))
    assert in_image(lora.get("diamond", "")) == DIAMOND  # the built-in model's adapter
    assert folder is not None, "compose mounts no adapter folder"
    mount = mounts[folder]
    assert mount["type"] == "bind" and mount.get("read_only"), mount
    assert Path(mount["source"]) == ROOT / "deploy" / "compose" / "adapters"
    assert Path(mount["source"]).is_dir()  # committed (its .gitignore keeps the adapters out of git)


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlays_serve_adapters(name: str) -> None:
    objects = overlay(name)
    env = settings_env(objects)
    lora, folder = served(env, {m["mountPath"] for m in container(objects)["volumeMounts"]})
    if "DIFFSHARD_MODEL" in env:  # a model of yours (gpu): the diamond fits the built-in model only
        assert "diamond" not in lora
        assert folder is not None and folder.startswith("/models/"), folder  # in the models PVC
    else:
        assert in_image(lora.get("diamond", "")) == DIAMOND


def test_cpu_overlay_with_the_models_pvc_serves_both(tmp_path: Path) -> None:
    """What docs/deploy.md tells a cpu cluster to do for adapters of its own: add components/models."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / "cpu", tmp_path)],
                "components": [os.path.relpath(K8S / "components" / "models", tmp_path)],
            }
        )
    )
    objects = render(tmp_path)
    lora, folder = served(settings_env(objects), {m["mountPath"] for m in container(objects)["volumeMounts"]})
    assert in_image(lora["diamond"]) == DIAMOND and folder == "/models/adapters"
    assert problems(objects) == []
