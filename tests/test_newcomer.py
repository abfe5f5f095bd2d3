"""What a newcomer met on a fresh `make run` (issue 36), replayed against the same command: the
built-in model served with the diamond adapter, a real uvicorn on a loopback port and its own
metrics port. Each friction is answered as built: errors in the API's words (no pydantic or
library phrasing), the nearest adapter suggested, /v1/stats equal to /metrics, a route label
per route, the unmasked pixels of an inpainting edit kept, every seed said (and -1 drawing one),
a size the model was not trained at warned of, the vocabulary listed, a quiet startup log; and
every body and stream event the official SDK's own types accept, strictly."""

from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import pytest
from openai import types as openai_types
from PIL import Image

from tests.support.live import MAKE_RUN, ROOT, LiveServer, sse

QUICK = {"prompt": "a red circle", "num_inference_steps": 4, "seed": 1}
# what pydantic, FastAPI or a library would say: none of it may reach a client
LIBRARY_WORDS = ("Input should", "Field required", "Value error", "valid integer", "Extra inputs", "pydantic")


@pytest.fixture(scope="module")
def newcomer(served: LiveServer) -> tuple[LiveServer, str]:
    """conftest's `served`: what `make run` runs, with a metrics port."""
    assert served.metrics_url is not None
    return served, served.metrics_url


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert not any(word in error["message"] for word in LIBRARY_WORDS), error["message"]
    return error


def png_of(item: dict) -> np.ndarray:
    return np.asarray(
        Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).convert("RGB"), dtype=np.int16
    )


def test_these_tests_run_what_make_run_runs() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "-m server serve " + " ".join(MAKE_RUN).replace(f"{ROOT}/", "") in recipe


def test_the_startup_log_is_ours_and_says_ready_last(newcomer) -> None:
    server, _ = newcomer
    log = "".join(server.log)
    assert "torchvision" not in log and "Loading weights" not in log  # transformers' chatter
    started = log[: log.index("diffshard: ready:")]
    assert "placed (each of" in started or "placed (one replica)" in started  # the plan, then ready


RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ([\w.]+): (.*)")
SPANS_LINES = ("parallel:", "placed (")  # our records that continue on lines of their own (tables)


def test_the_first_screen_holds_only_our_own_lines(newcomer) -> None:
    """Up to ready, every record is ours or uvicorn's: a library's warning (a diffusers model cast
    after loading, say) would come named by its logger or bare, and every bare line continues one
    of our records that spans lines (the plan, the placement)."""
    server, _ = newcomer
    lines = "".join(server.log).split("diffshard: ready:")[0].splitlines()
    spans = False
    for line in lines:
        if record := RECORD.match(line):
            assert record.group(1) in ("diffshard", "uvicorn.error"), line
            spans = record.group(1) == "diffshard" and record.group(2).startswith(SPANS_LINES)
        else:
            assert spans, f"a line that is not ours before ready: {line!r}"


def test_a_misspelt_required_field_is_named_with_the_field_it_may_mean(newcomer) -> None:
    server, _ = newcomer
    error = error_of(httpx.post(f"{server.url}/v1/images/generations", json={"promt": "a red circle"}))
    assert error["param"] == "promt"
    assert error["message"] == "promt: unknown field; did you mean 'prompt'? prompt is required"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"n": "2"}, "n", 'n: must be an integer, got string "2"'),
        ({"n": 1.5}, "n", "n: must be an integer, got number 1.5"),
        ({"lora": "diamond"}, "lora", 'lora: must be a JSON object, got string "diamond"'),
        ({"lora": {"diamond": "high"}}, "lora.diamond", "lora.diamond: must be a number"),
        ({"stream": 1}, "stream", "stream: must be true or false, got number 1"),
    ],
)
def test_type_errors_say_what_the_field_must_be(newcomer, fields, param, words) -> None:
    server, _ = newcomer
    error = error_of(httpx.post(f"{server.url}/v1/images/generations", json={**QUICK, **fields}))
    assert error["param"] == param and words in error["message"]


def test_edit_form_errors_are_in_our_words_too(newcomer) -> None:
    server, _ = newcomer
    image = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(image, "PNG")
    for fields, param in (({"n": "two"}, "n"), ({"lora": "{"}, "lora"), ({"strength": "most"}, "strength")):
        response = httpx.post(
            f"{server.url}/v1/images/edits",
            data={"prompt": "a red circle", **fields},
            files={"image": ("in.png", image.getvalue(), "image/png")},
        )
        assert error_of(response)["param"] == param


def test_an_unknown_adapter_gets_the_nearest_and_the_loaded_ones(newcomer) -> None:
    server, _ = newcomer
    body = {**QUICK, "lora": {"diamnod": 1}}
    error = error_of(httpx.post(f"{server.url}/v1/images/generations", json=body))
    assert error["param"] == "lora"
    assert "did you mean 'diamond'?" in error["message"] and "Loaded: diamond" in error["message"]


def test_a_random_seed_is_said_and_makes_the_image_again(newcomer) -> None:
    server, _ = newcomer
    url = f"{server.url}/v1/images/generations"
    # deterministic: the same bytes whatever else shares the calls (n=2 against n=1)
    drawn = httpx.post(url, json={**QUICK, "seed": -1, "n": 2, "deterministic": True}, timeout=60).json()[
        "data"
    ]
    seeds = [item["seed"] for item in drawn]
    assert seeds[1] == seeds[0] + 1 and seeds[0] >= 0
    again = httpx.post(url, json={**QUICK, "seed": seeds[0], "deterministic": True}, timeout=60).json()[
        "data"
    ][0]
    assert again["seed"] == seeds[0] and (png_of(again) == png_of(drawn[0])).all()
    unseeded = {k: v for k, v in QUICK.items() if k != "seed"}
    assert isinstance(httpx.post(url, json=unseeded, timeout=60).json()["data"][0]["seed"], int)


def test_a_size_the_model_was_not_trained_at_is_warned_of(newcomer) -> None:
    server, _ = newcomer
    url = f"{server.url}/v1/images/generations"
    native = httpx.post(url, json=QUICK, timeout=60)
    assert native.status_code == 200 and "x-diffshard-warning" not in native.headers
    large = httpx.post(url, json={**QUICK, "size": "128x128"}, timeout=60)
    assert large.status_code == 200
    assert "trained at (64x64)" in large.headers["x-diffshard-warning"]
    assert any("128x128 is 4x the area" in line for line in server.log)


def test_the_models_list_says_the_vocabulary(newcomer) -> None:
    server, _ = newcomer
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert {"red", "purple", "circle", "triangle"} <= set(model["vocabulary"])
    assert "diamond" not in model["vocabulary"] and [a["name"] for a in model["adapters"]] == ["diamond"]


def test_inpainting_keeps_the_pixels_the_mask_leaves_opaque(newcomer) -> None:
    server, _ = newcomer
    source = png_of(
        httpx.post(f"{server.url}/v1/images/generations", json=QUICK, timeout=60).json()["data"][0]
    )
    mask = np.full((64, 64, 4), 255, dtype=np.uint8)
    mask[:, :32, 3] = 0  # OpenAI's mask: transparent = repaint the left half
    files = {
        "image": ("in.png", _png(source.astype(np.uint8)), "image/png"),
        "mask": ("m.png", _png(mask), "image/png"),
    }
    body = {"prompt": "a blue square", "num_inference_steps": "6", "seed": "2"}
    edited = png_of(
        httpx.post(f"{server.url}/v1/images/edits", data=body, files=files, timeout=60).json()["data"][0]
    )
    assert np.abs(edited[:, 32:] - source[:, 32:]).max() <= 2  # kept
    assert np.abs(edited[:, :32] - source[:, :32]).mean() > 2  # repainted


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def test_stats_and_metrics_agree_over_a_mixed_run(newcomer) -> None:
    """Good requests, invalid ones, a body too large and a cancelled one: every counter both
    show is equal, and every route has its own label."""
    server, metrics_url = newcomer
    url = f"{server.url}/v1/images/generations"
    with httpx.Client(timeout=60) as client:
        for body in (
            {**QUICK, "n": 0},
            {"promt": "x"},
            {**QUICK, "lora": {"nope": 1}},
            {**QUICK, "steps": 3},
        ):
            error_of(client.post(url, json=body))
        # over --max-body-bytes and the room make run's ControlNet gives four control images
        assert client.post(url, json={**QUICK, "prompt": "a" * 23_000_000}).status_code == 413
        assert client.post(url, json={**QUICK, "step_cache": "deep"}).status_code == 200
        assert client.get(f"{server.url}/openapi.json").status_code == 200
        assert client.get(f"{server.url}/docs").status_code == 200
    long = {**QUICK, "num_inference_steps": 100, "n": 4, "stream": True}
    with httpx.stream("POST", url, json=long, timeout=60) as leaving:
        assert leaving.status_code == 200  # accepted; the client leaves before any image
    server.wait_for(lambda s: s["engine"]["rejected"]["cancelled"] >= 1 and s["engine"]["active_jobs"] == 0)
    engine = server.stats()["engine"]
    metrics = httpx.get(metrics_url).text
    rejections = dict(re.findall(r'diffshard_rejections_total\{reason="(\w+)"\} (\S+)', metrics))
    assert {reason: float(n) for reason, n in engine["rejected"].items()} == {
        reason: float(n) for reason, n in rejections.items()
    }
    assert engine["rejected"]["invalid"] >= 5
    assert _sample(metrics, "diffshard_images_generated_total") == engine["images_completed"]
    for outcome, rows in engine["step_cache_rows"].items():
        assert _sample(metrics, f'diffshard_step_cache_rows_total{{outcome="{outcome}"}}') == rows
    answered = re.findall(
        r'diffshard_http_requests_total\{code="(\d+)",method="\w+",route="([^"]+)"', metrics
    )  # (code, route): labels in the exposition's order
    assert {"/openapi.json", "/docs", "/v1/images/generations"} <= {route for _, route in answered}
    assert ("413", "/v1/images/generations") in answered  # refused before routing, still its route


def _sample(exposition: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", exposition, re.M)
    assert match, f"{name} is not in the metrics"
    return float(match.group(1))


# The openai SDK's own types for each body and event (openai 3.57), validated strictly: a stricter
# client than the SDK (which does not validate by default) accepts every answer.
SDK_EVENTS = {
    "image_generation.partial_image": openai_types.ImageGenPartialImageEvent,
    "image_generation.completed": openai_types.ImageGenCompletedEvent,
    "image_edit.partial_image": openai_types.ImageEditPartialImageEvent,
    "image_edit.completed": openai_types.ImageEditCompletedEvent,
}


@pytest.mark.parametrize("route", ["generations", "edits"])
def test_every_body_and_event_validates_strictly_against_the_sdks_types(newcomer, route: str) -> None:
    server, _ = newcomer
    url = f"{server.url}/v1/images/{route}"
    if route == "edits":
        image = _png(np.full((64, 64, 3), 200, dtype=np.uint8))

        def post(**fields):
            form = {
                k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in {**QUICK, **fields}.items()
            }
            return dict(data=form, files={"image": ("in.png", image, "image/png")})
    else:

        def post(**fields):
            return dict(json={**QUICK, **fields})

    plain = httpx.post(url, timeout=60, **post(n=2, output_format="webp"))
    assert plain.status_code == 200, plain.text
    parsed = openai_types.ImagesResponse.model_validate(plain.json(), strict=True)
    assert parsed.quality == "low" and len(parsed.data or []) == 2  # 4 of the model's 25 steps
    seen: list[str] = []
    with httpx.stream("POST", url, timeout=60, **post(stream=True, partial_images=2)) as stream:
        assert stream.status_code == 200
        for event, data in sse(stream):
            SDK_EVENTS[event].model_validate(data, strict=True)
            assert data["seed"] == QUICK["seed"]  # every event about an image says its seed
            seen.append(event.rsplit(".", 1)[1])
    assert seen.count("partial_image") >= 1 and seen[-1] == "completed"
