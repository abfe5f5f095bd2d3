"""Adapters (issue 37) and ControlNets (issue 54) loaded and unloaded at runtime, over HTTP on a
real server with the built-in model: only an admin key may, only a .safetensors file of --lora-dir
or a folder of --controlnet-dir; one loaded serves the next request, and one unloaded while a
request uses it lets that request finish (it stays until then; new requests for it get 400).
Without admin keys: test_lora.py."""

from __future__ import annotations

import base64
import io
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw

from server.demo import MODEL_DIR
from server.pipeline.conditioning.live_changes import ChangeLock
from tests.support.controlnets import folder_controlnet
from tests.support.live import LiveServer, live_server
from tests.support.lora import random_lora
from tests.support.waiting import wait_until

ADMIN, USER = "admin-key-runtime", "user-key-runtime"
QUICK = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 4, "size": "64x64"}
ANSWER_S = 120


@dataclass
class Served:
    server: LiveServer
    folder: Path  # the server's --lora-dir, empty at startup
    source: Path  # a random adapter for the built-in model, outside that folder
    nets: Path  # the server's --controlnet-dir, empty at startup
    admin: httpx.Client
    user: httpx.Client


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("runtime")
    folder, nets = root / "adapters", root / "controlnets"
    folder.mkdir()
    nets.mkdir()
    (root / "keys").write_text(USER + "\n")
    (root / "admins").write_text(ADMIN + "\n")
    source = random_lora(MODEL_DIR, root / "style.safetensors", 7, "sd15")
    with live_server(
        "--lora-dir",
        str(folder),
        "--controlnet-dir",
        str(nets),
        "--api-key-file",
        str(root / "keys"),
        "--admin-key-file",
        str(root / "admins"),
        "--inject-faults",
        "--step-timeout-s",
        "1",
        "--threads",
        "1",
    ) as server:
        headers = {ADMIN: {"authorization": f"Bearer {ADMIN}"}, USER: {"authorization": f"Bearer {USER}"}}
        with (
            httpx.Client(base_url=server.url, headers=headers[ADMIN], timeout=ANSWER_S) as admin,
            httpx.Client(base_url=server.url, headers=headers[USER], timeout=ANSWER_S) as user,
        ):
            yield Served(server, folder, source, nets, admin, user)


def listed(client: httpx.Client, kind: str = "adapters") -> list[str]:
    return [a["name"] for a in client.get("/v1/models").json()["data"][0][kind]]


def image(client: httpx.Client, **body) -> bytes:
    answer = client.post("/v1/images/generations", json={**QUICK, **body})
    assert answer.status_code == 200, answer.text
    return base64.b64decode(answer.json()["data"][0]["b64_json"])


def test_an_adapter_loaded_at_runtime_serves_the_next_request_and_only_admins_load(served: Served) -> None:
    shutil.copy(served.source, served.folder / "style.safetensors")  # the operator's copy, then the call
    refused = served.user.post("/v1/adapters", json={"name": "style"})
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]
    assert httpx.post(f"{served.server.url}/v1/adapters", json={"name": "style"}).status_code == 401
    assert "style" not in listed(served.user)
    plain = image(served.user)
    loaded = served.admin.post("/v1/adapters", json={"name": "style"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["name"] == "style" and loaded.json()["parts"] == ["text_encoder", "unet"]
    assert "style" in listed(served.user)
    styled = image(served.user, lora={"style": 1.5})  # the very next request
    assert styled != plain and image(served.user) == plain  # and those without it are unchanged
    assert served.admin.post("/v1/adapters", json={"name": "style"}).status_code == 409
    outside = {"name": "x", "file": "../style.safetensors"}  # the source, beside the folder
    (served.folder / "bad.safetensors").write_bytes(b"not weights")
    for body, field in (
        (outside, "file"),
        ({"name": "x", "file": str(served.source)}, "file"),  # a server path: refused too
        ({"name": "x", "file": "nope.safetensors"}, "file"),
        ({"name": "bad"}, "file"),  # not weights at all
        ({"name": "../x"}, "name"),
    ):
        answer = served.admin.post("/v1/adapters", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    assert served.admin.delete("/v1/adapters/nope").status_code == 404


def test_unloading_an_adapter_in_use_lets_its_request_finish_and_refuses_new_ones(served: Served) -> None:
    shutil.copy(served.source, served.folder / "busy.safetensors")
    assert served.admin.post("/v1/adapters", json={"name": "busy"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        # [[slow]]: its third step waits twice the step deadline (2 s), so it is in flight below
        running = pool.submit(image, served.user, prompt="a red circle [[slow]]", lora={"busy": 1.0})
        wait_until(
            lambda: served.admin.get("/v1/stats").json()["engine"]["active_jobs"] == 1, ANSWER_S, "running"
        )
        unloading = served.admin.delete("/v1/adapters/busy")
        assert unloading.status_code == 200, unloading.text
        assert unloading.json() == {"name": "busy", "status": "unloading", "requests": 1}
        assert "busy" not in listed(served.user)
        refused = served.user.post("/v1/images/generations", json={**QUICK, "lora": {"busy": 1.0}})
        assert refused.status_code == 400 and "being unloaded" in refused.json()["error"]["message"]
        assert served.admin.post("/v1/adapters", json={"name": "busy"}).status_code == 409  # not yet gone
        assert running.result(timeout=ANSWER_S)  # it finished, with its adapter

    # detached after its last request: the name is free again (409 until then), and loads anew
    def load_again() -> int | None:
        status = served.admin.post("/v1/adapters", json={"name": "busy"}).status_code
        return None if status == 409 else status

    assert wait_until(load_again, ANSWER_S, "busy detached") == 200
    unloaded = served.admin.delete("/v1/adapters/busy")
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"  # unused: at once


SILHOUETTE = MODEL_DIR.parent / "controlnets" / "silhouette"  # the built-in model's trained one


def circle_control(name: str) -> list[dict]:
    control = Image.new("RGB", (64, 64))
    ImageDraw.Draw(control).ellipse((6, 6, 30, 30), fill="white")
    png = io.BytesIO()
    control.save(png, format="PNG")
    return [{"model": name, "image": base64.b64encode(png.getvalue()).decode()}]


def test_a_controlnet_loaded_at_runtime_serves_the_next_request_and_only_admins_load(
    served: Served, folders: dict[str, Path]
) -> None:
    shutil.copytree(SILHOUETTE, served.nets / "shapes")
    refused = served.user.post("/v1/controlnets", json={"name": "shapes"})
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]
    assert httpx.post(f"{served.server.url}/v1/controlnets", json={"name": "shapes"}).status_code == 401
    unknown = served.user.post("/v1/images/generations", json={**QUICK, "control": circle_control("shapes")})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "control"
    loaded = served.admin.post("/v1/controlnets", json={"name": "shapes"})
    assert loaded.status_code == 200, loaded.text
    assert (loaded.json()["name"], loaded.json()["class"]) == ("shapes", "ControlNetModel")
    assert "shapes" in listed(served.user, "controlnets")
    assert [n["name"] for n in served.user.get("/v1/shards").json()["controlnets"]] == ["shapes"]
    plain = image(served.user)
    controlled = image(served.user, control=circle_control("shapes"))  # the very next request
    assert controlled != plain and image(served.user) == plain
    assert served.admin.post("/v1/controlnets", json={"name": "shapes"}).status_code == 409

    folder_controlnet(folders["sd15"], 1).save_pretrained(served.nets / "tiny", safe_serialization=True)
    shutil.copytree(SILHOUETTE, served.nets / "broken")
    for weights in (served.nets / "broken").glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    (served.nets / "empty").mkdir()
    for body, field, says in (
        ({"name": "x", "folder": "../adapters"}, "folder", "not inside the --controlnet-dir folder"),
        ({"name": "x", "folder": str(SILHOUETTE)}, "folder", "not inside"),  # a server path: refused too
        ({"name": "x", "folder": "nope"}, "folder", "'nope' is not a ControlNet folder"),
        ({"name": "empty"}, "folder", "'empty' is not a ControlNet folder"),
        ({"name": "broken"}, "folder", "'broken' did not load"),  # not weights at all
        ({"name": "tiny"}, "folder", "was made for another model"),  # another model's
        ({"name": "../x"}, "name", "a name is"),
    ):
        answer = served.admin.post("/v1/controlnets", json=body)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == field and says in error["message"], answer.text
        assert str(served.nets) not in error["message"]  # no server path in an answer
    assert served.admin.delete("/v1/controlnets/nope").status_code == 404
    assert image(served.user, control=circle_control("shapes")) == controlled  # still serving


def test_unloading_a_controlnet_in_use_lets_its_request_finish_and_refuses_new_ones(served: Served) -> None:
    shutil.copytree(SILHOUETTE, served.nets / "busy")
    assert served.admin.post("/v1/controlnets", json={"name": "busy"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        slow = {"prompt": "a red circle [[slow]]", "control": circle_control("busy")}
        running = pool.submit(image, served.user, **slow)
        wait_until(
            lambda: served.admin.get("/v1/stats").json()["engine"]["active_jobs"] == 1, ANSWER_S, "running"
        )
        unloading = served.admin.delete("/v1/controlnets/busy")
        assert unloading.json() == {"name": "busy", "status": "unloading", "requests": 1}, unloading.text
        assert "busy" not in listed(served.user, "controlnets")
        body = {**QUICK, "control": circle_control("busy")}
        refused = served.user.post("/v1/images/generations", json=body)
        assert refused.status_code == 400 and "being unloaded" in refused.json()["error"]["message"]
        assert served.admin.post("/v1/controlnets", json={"name": "busy"}).status_code == 409  # not yet gone
        assert running.result(timeout=ANSWER_S)  # it finished, with its ControlNet

    def load_again() -> int | None:
        status = served.admin.post("/v1/controlnets", json={"name": "busy"}).status_code
        return None if status == 409 else status

    assert wait_until(load_again, ANSWER_S, "busy gone") == 200
    unloaded = served.admin.delete("/v1/controlnets/busy")
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"  # unused: at once


def test_an_adapter_change_waits_for_the_call_in_flight() -> None:
    """The change lock (a step's call and an encoding read, attach and detach write): a writer
    waits for the call in flight; new calls wait until the change is done."""
    lock, order = ChangeLock(), []
    inside, go_on = threading.Event(), threading.Event()

    def call() -> None:
        with lock.reading():
            inside.set()
            go_on.wait(30)
            order.append("call done")

    def change() -> None:
        with lock.writing():
            order.append("changed")

    def later_call() -> None:
        with lock.reading():
            order.append("later call")

    threads = [threading.Thread(target=call)]
    threads[0].start()
    inside.wait(30)
    threads.append(threading.Thread(target=change))
    threads[1].start()
    wait_until(lambda: lock._writers_waiting == 1, 30, "the writer waiting")
    threads.append(threading.Thread(target=later_call))
    threads[2].start()
    go_on.set()
    for thread in threads:
        thread.join(30)
    assert order == ["call done", "changed", "later call"]
