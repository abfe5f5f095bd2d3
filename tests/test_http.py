"""The HTTP service end to end: the real server (uvicorn, `python -m server serve`, the built-in
model) driven by the official openai SDK and by raw HTTP for what the SDK cannot send."""

from __future__ import annotations

import base64
import contextlib
import inspect
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from server.demo.evaluate import Verdict, classify
from tests.support.live import LiveServer, live_server
from tests.support.waiting import wait_until

# what `serve` shards over with its default `--devices auto`: every visible CUDA device, else cpu
VISIBLE = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]


@pytest.fixture(scope="module")
def server(served: LiveServer) -> LiveServer:
    return served


def pngs(result) -> list[bytes]:
    return [base64.b64decode(item.b64_json) for item in result.data]


def test_openai_sdk_generates_pngs_and_the_seed_fixes_the_bytes(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def generate():
        return client.images.generate(
            prompt="a red circle",
            size="64x64",
            n=2,
            response_format="b64_json",
            extra_body={"seed": 7, "num_inference_steps": 10},
        )

    first = generate()
    images = [Image.open(io.BytesIO(png)) for png in pngs(first)]
    assert [(image.format, image.size) for image in images] == [("PNG", (64, 64))] * 2
    assert first.size == "64x64" and first.data[0].revised_prompt == "a red circle"
    assert pngs(first)[0] != pngs(first)[1]  # image i uses seed + i
    assert pngs(generate()) == pngs(first)


def test_every_field_the_openai_sdk_sends_is_accepted(server: LiveServer) -> None:
    """images.generate's every parameter, with a value this server serves (null where it makes
    no such output): none is refused as unknown."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    sent = {
        "prompt": "a red circle",
        "background": "opaque",
        "complexity": "low",
        "frame_count": None,
        "frame_duration_ms": None,
        "model": "diffshard-shapes",
        "moderation": "low",
        "n": 1,
        "output_compression": 80,
        "output_format": "webp",
        "partial_images": None,
        "quality": "auto",
        "response_format": "b64_json",
        "safety_identifier": "user-1234",
        "size": "64x64",
        "stream": False,
        "style": None,
        "svg": None,
        "user": "user-1234",
    }
    parameters = set(inspect.signature(client.images.generate).parameters)
    assert parameters - {"extra_headers", "extra_query", "extra_body", "timeout"} == set(sent)
    result = client.images.generate(**sent, extra_body={"num_inference_steps": 2})
    assert Image.open(io.BytesIO(pngs(result)[0])).format == "WEBP"


def test_a_deterministic_request_gives_the_same_bytes_alone_and_in_a_mixed_batch(server: LiveServer) -> None:
    """Seeds 0, 3 and 4 are ones whose plain images moved by one level in a batch of 8 on the
    development host (kernels depend on the batch's rows); deterministic ones must not move."""
    mine = [
        {"prompt": "a red circle", "seed": s, "num_inference_steps": 20, "deterministic": True}
        for s in (0, 3, 4)
    ]
    others = [
        {"prompt": "a blue square", "seed": 1, "num_inference_steps": 22, "n": 2},
        {"prompt": "a green triangle", "seed": 2, "num_inference_steps": 18},
        {"prompt": "a white circle", "seed": 3, "num_inference_steps": 25, "guidance_scale": 3.0},
        {"prompt": "a red square", "seed": 4, "num_inference_steps": 15, "size": "128x128"},
        {"prompt": "a blue circle", "seed": 5, "num_inference_steps": 20},
    ]

    def send(request: dict) -> bytes:
        answer = httpx.post(f"{server.url}/v1/images/generations", json=request, timeout=120)
        assert answer.status_code == 200, answer.text
        return base64.b64decode(answer.json()["data"][0]["b64_json"])

    def batched_calls() -> int:  # calls of more than one guided image so far
        rows = httpx.get(f"{server.url}/v1/stats", timeout=10).json()["engine"]["batch_rows"]
        return sum(calls for n, calls in rows.items() if int(n) > 2)

    alone = [send(body) for body in mine]
    before = batched_calls()
    start = threading.Barrier(8)

    def together(request: dict) -> bytes:
        start.wait(timeout=60)
        return send(request)

    with ThreadPoolExecutor(8) as pool:
        batched = list(pool.map(together, [*mine, *others]))
    assert batched_calls() > before  # the others were batched meanwhile
    assert batched[: len(mine)] == alone


def test_step_cache_through_the_openai_sdk_reuses_rows_and_stays_close(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    def generate(step_cache) -> np.ndarray:
        extra = {"seed": 3, "num_inference_steps": 12, "step_cache": step_cache}
        result = client.images.generate(prompt="a blue square", size="64x64", extra_body=extra)
        return np.asarray(Image.open(io.BytesIO(pngs(result)[0]))).astype(int)

    def reused() -> int:
        return httpx.get(f"{server.url}/v1/stats", timeout=10).json()["engine"]["step_cache_rows"]["reused"]

    before = reused()
    cached = generate({"policy": "deep", "interval": 3})
    assert reused() - before == 8 * 2  # 12 steps: 4 refresh, 8 reuse, 2 guided rows each
    plain = generate("off")
    assert reused() - before == 16
    assert np.abs(cached - plain).mean() > 0  # a little different: the same picture
    assert classify(cached.astype(np.uint8)) == classify(plain.astype(np.uint8)) == Verdict("blue", "square")


def test_openai_sdk_raises_bad_request_for_a_bad_size(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="multiples of 8") as caught:
        client.images.generate(prompt="a red circle", size="60x64")
    assert caught.value.param == "size"


def test_keys_guard_v1_but_not_health(keyed_server: LiveServer) -> None:
    wrong = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.images.generate(prompt="a red circle", extra_body={"num_inference_steps": 1})
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-second", max_retries=0)
    assert [model.id for model in right.models.list()] == ["diffshard-shapes"]
    missing = httpx.get(f"{keyed_server.url}/v1/models")
    assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]
    assert missing.headers["www-authenticate"].startswith("Bearer")
    wrong_key = httpx.get(f"{keyed_server.url}/v1/models", headers={"authorization": "Bearer sk-wrong"})
    assert wrong_key.status_code == 401 and 'error="invalid_token"' in wrong_key.headers["www-authenticate"]
    assert httpx.get(f"{keyed_server.url}/livez").status_code == 200
    assert httpx.get(f"{keyed_server.url}/readyz").status_code == 200


GOOD = {"prompt": "a blue square", "num_inference_steps": 2, "seed": 1}
# a generation's body limit on make run's server: --max-body-bytes' 64 KiB and room for four
# base64 control images of --max-image-bytes' 4 MiB (its ControlNet), a data URL's prefix each
CONTROLLED_LIMIT = 2**16 + 4 * (4 * math.ceil(4 * 2**20 / 3) + 64)
CONTROLLED_BODY = CONTROLLED_LIMIT + 2**16
BAD_BODIES = [
    # (body, param, words the message must contain)
    ({**GOOD, "size": "60x64"}, "size", ["multiples of 8"]),
    # the built-in model's native size is 64x64: max_pixels defaults to 4x its area, 128x128
    ({**GOOD, "size": "1024x1024"}, "size", ["1048576 pixels", "16384", "DIFFSHARD_MAX_PIXELS"]),
    # n x steps x pixels / native pixels = 10 x 100 x 4 = 4000 native-image steps > 1000
    (
        {**GOOD, "n": 10, "num_inference_steps": 100, "size": "128x128"},
        "n",
        ["4000 native-image steps", "1000", "DIFFSHARD_MAX_WORK"],
    ),
    ({**GOOD, "size": "0x64"}, "size", ["WIDTHxHEIGHT"]),
    ({**GOOD, "size": "big"}, "size", ["WIDTHxHEIGHT"]),
    ({**GOOD, "num_inference_steps": 0}, "num_inference_steps", ["between 1 and 100", "DIFFSHARD_MAX_STEPS"]),
    ({**GOOD, "num_inference_steps": 10_000}, "num_inference_steps", ["between 1 and 100", "got 10000"]),
    ({**GOOD, "n": 11}, "n", ["between 1 and 10", "DIFFSHARD_MAX_N"]),
    ({**GOOD, "n": 0}, "n", ["between 1 and 10"]),
    ({**GOOD, "prompt": ""}, "prompt", ["must not be empty"]),
    ({**GOOD, "prompt": "a" * 2001}, "prompt", ["2001 characters", "2000", "DIFFSHARD_MAX_PROMPT_CHARS"]),
    ({**GOOD, "negative_prompt": "b" * 2001}, "negative_prompt", ["2001 characters"]),
    ({**GOOD, "scheduler": "plms"}, "scheduler", ["one of default, ddim", "'plms'"]),
    ({**GOOD, "n": "2"}, "n", ["must be an integer", 'got string "2"']),
    ({**GOOD, "prompt": 5}, "prompt", ["must be a string", "got number 5"]),
    ({**GOOD, "guidance_scale": "high"}, "guidance_scale", ["must be a number", 'got string "high"']),
    ({**GOOD, "n": 1.5}, "n", ["must be an integer", "got number 1.5"]),
    ({**GOOD, "stream": "yes"}, "stream", ["must be true or false"]),
    ({**GOOD, "lora": ["diamond"]}, "lora", ["must be a JSON object", "got array"]),
    ({**GOOD, "lora": {"diamond": "full"}}, "lora.diamond", ["must be a number"]),
    ({**GOOD, "guidance_scale": 1e9}, "guidance_scale", ["between 0 and 100"]),
    ({**GOOD, "seed": -2}, "seed", ["between 0 and", "-1 for a random one"]),
    ({**GOOD, "response_format": "url"}, "response_format", ["only b64_json"]),
    ({**GOOD, "model": "dall-e-3"}, "model", ["diffshard-shapes"]),
    ({"n": 1}, "prompt", ["prompt: is required"]),
    ({"promt": "a red circle"}, "promt", ["unknown field", "did you mean 'prompt'? prompt is required"]),
    ({**GOOD, "num_inference_step": 5}, "num_inference_step", ["unknown field", "'num_inference_steps'"]),
    ({**GOOD, "step_cahce": "deep"}, "step_cahce", ["unknown field", "did you mean 'step_cache'"]),
    ({**GOOD, "turbo": True}, "turbo", ["unknown field", "/openapi.json"]),
    ({**GOOD, "step_cache": "fast"}, "step_cache.policy", ["one of off, deep, first_block", "'fast'"]),
    ({**GOOD, "step_cache": {"policy": "deep", "interval": 11}}, "step_cache.interval", ["from 1 to 10"]),
    ({**GOOD, "step_cache": "first_block"}, "step_cache", ["does not fit this model", "off, deep"]),
    ({**GOOD, "step_cache": [1, 2]}, "step_cache", ["a policy name or an object, got list"]),
    ({**GOOD, "frame_count": 4}, "frame_count", ["gif output is not served"]),
    ({**GOOD, "svg": {"model": "x"}}, "svg", ["svg output is not served"]),
    ({**GOOD, "complexity": "high"}, "complexity", ["must be low"]),
]


@pytest.mark.parametrize(
    ("body", "param", "words"), BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_BODIES)]
)
def test_bad_input_gets_the_envelope_and_serving_goes_on(server: LiveServer, body, param, words) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.post("/v1/images/generations", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        for word in words:
            assert word in error["message"]
        assert client.post("/v1/images/generations", json=GOOD).status_code == 200


@pytest.mark.parametrize(
    ("content", "kind", "status", "code", "words"),
    [
        (b"not json", "application/json", 400, "invalid_json", ["not valid JSON"]),
        (b"[1, 2]", "application/json", 400, "invalid_body", ["JSON object"]),
        (b"prompt=a", "application/x-www-form-urlencoded", 400, "invalid_content_type", ["application/json"]),
        (b'{"prompt": "\xff"}', "application/json", 400, "invalid_body", ["UTF-8 JSON"]),
        (  # over --max-body-bytes and the room make run's ControlNet gives four control images
            json.dumps({**GOOD, "prompt": "a" * CONTROLLED_BODY}).encode(),
            "application/json",
            413,
            "body_too_large",
            [f"over {CONTROLLED_LIMIT} bytes (DIFFSHARD_MAX_BODY_BYTES, DIFFSHARD_MAX_IMAGE_BYTES)"],
        ),
    ],
)
def test_malformed_and_huge_bodies(
    server: LiveServer, content: bytes, kind: str, status: int, code, words
) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.post("/v1/images/generations", content=content, headers={"content-type": kind})
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == code
        for word in words:
            assert word in error["message"]
        assert client.post("/v1/images/generations", json=GOOD).status_code == 200


def test_a_streamed_body_over_the_limit_is_cut_off(server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count as it streams
        yield b'{"prompt": "'
        for _ in range(CONTROLLED_BODY // 2**16):
            yield b"a" * 2**16
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/images/generations", content=chunks(), timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_unknown_route_and_method_get_the_envelope(server: LiveServer) -> None:
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.delete(f"{server.url}/v1/models")
    assert wrong.status_code == 405 and "DELETE" in wrong.json()["error"]["message"]
    assert wrong.headers["allow"] == "GET"
    assert httpx.get(f"{server.url}/v1/images/generations").headers["allow"] == "POST"


def test_every_answer_carries_the_request_id(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        mine = {"x-request-id": "client-7.a:b"}
        assert (
            client.post("/v1/images/generations", json=GOOD, headers=mine).headers["x-request-id"]
            == mine["x-request-id"]
        )
        made = {
            client.get("/v1/nothing").headers["x-request-id"],
            client.post("/v1/images/generations", json={}).headers["x-request-id"],
            client.get("/readyz", headers={"x-request-id": "no spaces allowed"}).headers["x-request-id"],
        }
        assert len(made) == 3 and all(re.fullmatch(r"[0-9a-f]{16}", rid) for rid in made)
    lines = wait_until(
        lambda: [line for line in server.log if "[request client-7.a:b]" in line], 10, "the access log line"
    )
    assert '"POST /v1/images/generations HTTP/1.1" 200' in lines[0]  # uvicorn's, with the id


def test_models_and_shards_views(server: LiveServer) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "diffshard-shapes"
    shards = httpx.get(f"{server.url}/v1/shards").json()
    assert shards["plan"]["stages"][0]["device"] == VISIBLE[0]
    assert shards["plan"]["dtype"] == ("float32" if VISIBLE == ["cpu"] else "bfloat16")  # dtype auto
    devices = shards["devices"]
    assert set(devices) <= set(VISIBLE)
    blocks = [block for device in devices.values() for block in device["blocks"]]
    assert blocks[0] == "embed" and blocks[-1] == "out"
    # the built-in UNet's 17 MiB in float32, half that in bfloat16
    scale = torch.finfo(getattr(torch, shards["plan"]["dtype"])).bits / 32
    assert sum(device["memory"]["shard_bytes"] for device in devices.values()) > 10 * 2**20 * scale
    assert "ModelShard(UNet2DConditionModel" in shards["text"]


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        # bad folders, devices and budgets: tests/reliability/test_bad_startup.py
        (
            [],
            {"DIFFSHARD_MAX_STEPS": "0"},
            ["--max-steps (DIFFSHARD_MAX_STEPS)", "greater than or equal to 1"],
        ),
        (["--api-key-file", "/nonexistent"], {}, ["--api-key-file", "cannot read /nonexistent"]),
        (["--step-cache", "first_block"], {}, ["--step-cache", "'first_block' does not fit a sd model"]),
    ],
)
def test_bad_settings_fail_fast_saying_what_to_fix(args, env, words, tmp_path: Path) -> None:
    result = serve(*args, env=env)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ")
    for word in words:
        assert word in line


# Bounded connections, with raw sockets: what no HTTP client library would send.
READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
ANSWER_WITHIN_S = READ_TIMEOUT_S + 10  # the deadline for the server to act on a timeout


@pytest.fixture(scope="module")
def bounded() -> Iterator[LiveServer]:
    args = ("--read-timeout-s", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS))
    with live_server(*args, "--inject-faults") as running:  # loopback: allowed, and loud
        yield running


def test_fault_injection_is_announced_at_startup(bounded: LiveServer) -> None:
    assert any("WARNING diffshard: fault injection is on" in line for line in bounded.log)


def connect(server: LiveServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=ANSWER_WITHIN_S)


def until_closed(sock: socket.socket, pace: bytes = b"") -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took;
    with `pace`, one such byte is sent whenever the server stays silent for 0.1 s (a client
    trickling its request). AssertionError if the server has not closed it by the deadline."""
    started, received = time.monotonic(), b""
    sock.settimeout(0.1 if pace else ANSWER_WITHIN_S)
    while time.monotonic() - started < ANSWER_WITHIN_S:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            with contextlib.suppress(OSError):  # the server may close between two bytes
                sock.sendall(pace)
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return received, time.monotonic() - started
        received += chunk
    raise AssertionError(f"the connection is still open after {ANSWER_WITHIN_S} s; got {received!r}")


def open_fds(server: LiveServer) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


REQUEST_HEAD = (  # Host: a name the Host check admits on loopback
    b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
)


@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickled"])
def test_slow_headers_get_408_and_the_connection_closes(bounded: LiveServer, trickle: bool) -> None:
    with connect(bounded) as sock:
        sock.sendall(REQUEST_HEAD)  # the blank line that ends the headers never comes
        received, seconds = until_closed(sock, pace=b"x-slow: 1\r\n" if trickle else b"")
    assert received.startswith(b"HTTP/1.1 408 ") and b"DIFFSHARD_READ_TIMEOUT_S" in received
    assert b'"code": "request_timeout"' in received
    assert READ_TIMEOUT_S * 0.9 <= seconds < ANSWER_WITHIN_S


@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickled"])
def test_a_body_that_never_completes_gets_408_and_the_connection_closes(bounded: LiveServer, trickle) -> None:
    with connect(bounded) as sock:
        sock.sendall(REQUEST_HEAD + b"content-length: 4000\r\n\r\n" + b'{"prompt": "a')
        received, seconds = until_closed(sock, pace=b"a" if trickle else b"")
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert READ_TIMEOUT_S * 0.9 <= seconds < ANSWER_WITHIN_S


def test_silent_connections_are_closed_and_their_descriptors_freed(bounded: LiveServer) -> None:
    baseline = open_fds(bounded)
    socks = [connect(bounded) for _ in range(MAX_CONNECTIONS - 1)]  # under the cap: all held
    try:
        wait_until(lambda: open_fds(bounded) >= baseline + len(socks), ANSWER_WITHIN_S, "the server's fds")
        for sock in socks:
            received, _ = until_closed(sock)
            assert received == b""  # nothing was asked: nothing to answer
        wait_until(lambda: open_fds(bounded) <= baseline, ANSWER_WITHIN_S, "the fds back to the baseline")
    finally:
        for sock in socks:
            sock.close()


def test_connections_beyond_the_cap_get_503_and_are_closed(bounded: LiveServer) -> None:
    held = [connect(bounded) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # a whole request on each, so the server counts them all
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with connect(bounded) as extra:
            received, _ = until_closed(extra)
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and "DIFFSHARD_MAX_CONNECTIONS=6" in error["message"]
    finally:
        for sock in held:
            sock.close()
    with httpx.Client(base_url=bounded.url, timeout=10) as client:
        wait_until(lambda: client.get("/livez").status_code == 200, ANSWER_WITHIN_S, "a connection again")
