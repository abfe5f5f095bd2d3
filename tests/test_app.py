"""The app in process, before its lifespan has loaded anything (httpx's ASGI transport runs no
lifespan): what a client sees while the model loads or after it failed, how internal errors
look, the OpenAPI document built from the settings, and the HTTP metrics' labels."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from server.api.errors import domain_response
from server.app import create_app
from server.errors import NotReady, OutOfMemory, StepFailed
from server.requests.generation import SEED_LIMIT
from server.settings import Settings
from tests.support.asgi import request


def test_while_loading_livez_answers_and_readyz_and_generation_say_503() -> None:
    app = create_app(Settings())
    assert request(app, "GET", "/livez").status_code == 200
    ready = request(app, "GET", "/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "loading"
    generation = request(app, "POST", "/v1/images/generations", json={"prompt": "a red circle"})
    assert generation.status_code == 503 and "loading" in generation.json()["error"]["message"]
    stats = request(app, "GET", "/v1/stats")  # the compile's progress, while loading
    assert stats.status_code == 200 and stats.json()["status"] == "loading"
    assert stats.json()["compile"]["mode"] == "off" and stats.json()["compile"]["graphs"] == {
        "ready": 0,
        "total": 0,
    }


def test_a_failed_load_says_failed_without_its_text_or_paths() -> None:
    app = create_app(Settings())
    runtime = app.state.runtime
    runtime.status, runtime.error = "failed", "OSError: cannot read /srv/secret/unet/weights.safetensors"
    for method, path in (("GET", "/readyz"), ("POST", "/v1/images/generations"), ("GET", "/v1/stats")):
        response = request(app, method, path, json={"prompt": "a red circle"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "failed"
        assert "/srv/secret" not in response.text and "OSError" not in response.text


def test_an_internal_error_is_a_500_with_the_request_id_and_the_details_in_the_log(caplog) -> None:
    app = create_app(Settings())

    @app.get("/v1/boom")
    async def boom() -> None:  # a route that fails as a bug would
        raise RuntimeError("secret internals")

    with caplog.at_level(logging.ERROR, logger="diffshard"):
        response = request(app, "GET", "/v1/boom", headers={"x-request-id": "trace-42"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-42"
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "request id trace-42" in error["message"]
    assert "secret" not in response.text and "Traceback" not in response.text
    logged = [r for r in caplog.records if getattr(r, "request_id", None) == "trace-42"]
    assert (
        logged and "trace-42" in logged[0].getMessage() and "secret internals" in str(logged[0].exc_info[1])
    )


@pytest.mark.parametrize(
    ("given", "kept"),
    [("abc-123", True), ("0af7651916cd43dd8448eb211c80319c", True), ("a b", False), ("x" * 65, False)],
)
def test_request_ids_are_kept_when_plain_and_short_else_made(given: str, kept: bool) -> None:
    response = request(create_app(Settings()), "GET", "/livez", headers={"x-request-id": given})
    echoed = response.headers["x-request-id"]
    assert (echoed == given) is kept and 1 <= len(echoed) <= 64


def test_out_of_memory_and_step_failures_keep_their_details_in_the_log(caplog) -> None:
    torch_text = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"
    with caplog.at_level(logging.WARNING, logger="diffshard"):
        oom = domain_response(OutOfMemory(torch_text), "rid-1")
        failed = domain_response(StepFailed("generation failed: RuntimeError: /opt/kernels/x.so"), "rid-2")
        not_ready = domain_response(NotReady("failed", "OSError: /srv/model/unet is unreadable"), "rid-3")
    assert oom.status_code == 503 and oom.headers["x-should-retry"] == "false"
    assert failed.status_code == 500 and not_ready.status_code == 503
    for response, rid in ((oom, "rid-1"), (failed, "rid-2"), (not_ready, "rid-3")):
        body = response.body.decode()
        assert f"request id {rid}, the server log has the details" in body
        assert "GiB" not in body and "/opt" not in body and "/srv" not in body
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"request rid-1: OutOfMemory: {torch_text}" in logged and "request rid-2:" in logged
    assert "/srv/model/unet" in logged


def test_unknown_methods_get_allow_and_count_as_other() -> None:
    app = create_app(Settings())
    for method in ("FOO1", "FOO2", "DELETE"):
        response = request(app, method, "/v1/models")
        assert response.status_code == 405 and response.headers["allow"] == "GET"
        assert response.json()["error"]["code"] == "method_not_allowed"
    value = app.state.metrics.registry.get_sample_value
    labels = {"route": "/v1/models", "code": "405"}
    assert value("diffshard_http_requests_total", labels | {"method": "other"}) == 2
    assert value("diffshard_http_requests_total", labels | {"method": "DELETE"}) == 1


def openapi(settings: Settings) -> dict:
    response = request(create_app(settings), "GET", "/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_openapi_states_the_limits_of_every_field_from_the_settings() -> None:
    document = openapi(
        Settings(max_n=3, max_steps=7, max_prompt_chars=50, max_pixels=4096, step_cache="deep")
    )
    body = document["components"]["schemas"]["ImageGenerationRequest"]["properties"]

    def bounds(name: str) -> dict:
        prop = body[name]
        return next((b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"), prop)

    assert (bounds("n")["minimum"], bounds("n")["maximum"]) == (1, 3)
    assert (bounds("num_inference_steps")["minimum"], bounds("num_inference_steps")["maximum"]) == (1, 7)
    assert bounds("prompt")["maxLength"] == 50 and bounds("prompt")["minLength"] == 1
    assert bounds("negative_prompt")["maxLength"] == 50
    assert (bounds("guidance_scale")["minimum"], bounds("guidance_scale")["maximum"]) == (0, 100)
    assert (bounds("seed")["minimum"], bounds("seed")["maximum"]) == (-1, SEED_LIMIT - 1)  # -1: a random seed
    assert bounds("size")["pattern"] == r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"
    assert "4096" in body["size"]["description"] and "multiples of 8" in body["size"]["description"]
    assert bounds("scheduler")["enum"] == ["default", "ddim", "euler", "euler_a", "dpmpp_2m"]
    assert bounds("step_cache")["enum"] == ["off", "deep"] and body["step_cache"]["default"] == "deep"
    assert bounds("model")["enum"] == ["diffshard-shapes"]
    assert bounds("response_format")["enum"] == ["b64_json"]


def test_openapi_lists_the_statuses_sent_with_the_envelope_and_no_422(tmp_path: Path) -> None:
    document = openapi(Settings())
    assert "securitySchemes" not in document["components"]  # no keys: nothing to send
    assert "HTTPValidationError" not in document["components"]["schemas"]
    error = document["components"]["schemas"]["Error"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    generate = document["paths"]["/v1/images/generations"]["post"]
    assert sorted(generate["responses"]) == ["200", "400", "408", "413", "500", "503", "504"]
    assert "security" not in generate
    for operations in document["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"] and "499" not in operation["responses"]
            for status, response in operation["responses"].items():
                assert "x-request-id" in response["headers"]
                if status != "200":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-1\n")
    keyed = openapi(Settings(api_key_file=keys))
    scheme = keyed["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, operations in keyed["paths"].items():
        for operation in operations.values():
            guarded = path.startswith("/v1/")
            assert ("401" in operation["responses"]) is guarded
            assert (operation.get("security") == [{"bearer": []}]) is guarded


def test_fault_injection_shows_in_build_info() -> None:
    for on in (False, True):
        app = create_app(Settings(inject_faults=on))
        value = app.state.metrics.registry.get_sample_value
        labels = {"inject_faults": str(on).lower(), "model": "diffshard-shapes"}
        assert value("diffshard_build_info", labels | _versions(app)) == 1


def _versions(app) -> dict[str, str]:
    sample = next(
        s for m in app.state.metrics.registry.collect() if m.name == "diffshard_build" for s in m.samples
    )
    return {k: v for k, v in sample.labels.items() if k not in ("inject_faults", "model")}
