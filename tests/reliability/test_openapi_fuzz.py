"""The live server against its own OpenAPI document: schemathesis generates requests for every
operation (valid ones from the document's bounds, and invalid ones), sends them to a real
`python -m server serve` and checks every answer: no 5xx, a status the document lists for the
operation, the content type it promises, a body that matches its schema, and OpenAI's error
envelope on every error. With `-s`, the figures (examples per operation, statuses seen) print
as one JSON line.

The server runs the built-in model with small limits (`--max-steps 2 --max-n 2`; its pixel
limit is 4x the native 64x64) so the valid generations the fuzzer finds are cheap."""

from __future__ import annotations

import json
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import timedelta

import pytest
import schemathesis
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import Failure

from tests.support.live import LiveServer, live_server

CALL_TIMEOUT_S = 30  # no answer this late: the server hangs
SEEN: dict[str, Counter] = defaultdict(Counter)  # operation → status → answers
REFUSED: Counter = Counter()  # param → 400s answered to bodies the document allows (limits it cannot state)
FUZZER_ERRORS: Counter = Counter()  # operation → draws schemathesis could not handle itself (skipped)


class NoErrorEnvelope(Failure):
    """An error answer without OpenAI's envelope (or with a null code)."""

    def __init__(self, *, operation: str, message: str) -> None:
        super().__init__(
            operation=operation, title="No error envelope", message=message, code="error_envelope"
        )

    @property
    def _unique_key(self) -> str:
        return self.message


def error_envelope(ctx, response, case) -> bool | None:
    """Every 4xx and 5xx answer is {"error": {"message", "type", "param", "code"}}, with a code."""
    if response.status_code < 400:
        return None
    try:
        error = json.loads(response.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["code"], str) and error["code"]
    except Exception:
        text = response.content[:300].decode(errors="replace")
        raise NoErrorEnvelope(
            operation=case.operation.label, message=f"{response.status_code} answered {text!r}"
        ) from None
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    error_envelope,
]


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[LiveServer]:
    with live_server("--max-steps", "2", "--max-n", "2") as running:
        yield running
    operations = {label: dict(sorted(statuses.items())) for label, statuses in sorted(SEEN.items())}
    figures = {
        "operations": len(operations),
        "examples": sum(sum(statuses.values()) for statuses in SEEN.values()),
        **FOUND,
        "statuses": operations,
        "valid_by_the_document_but_refused": dict(REFUSED),
        "fuzzer_errors_skipped": dict(FUZZER_ERRORS),
    }
    print(json.dumps({"openapi_fuzz": figures}))


def failures_of(err: BaseException) -> list[str]:
    """Each distinct failure a run raised (hypothesis groups them), as 'check title: message',
    with the curl command that reproduces it when schemathesis gives one."""
    if isinstance(err, BaseExceptionGroup):
        lines = [line for inner in err.exceptions for line in failures_of(inner)]
        reproduce = str(err).partition("Reproduce with:")[2].strip().splitlines()
        return [f"{line} | {reproduce[0].strip()}" for line in lines] if reproduce else lines
    if isinstance(err, Failure):
        return [f"{err.title}: {' '.join(err.message.split())[:300]}"]
    return [f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"]


def fuzzers_own(err: ValueError) -> bool:
    """A value schemathesis made that its own validator (jsonschema_rs) cannot read: a multipart
    file part (its `Binary`, a str subclass) reached the validator on some rare draws. Raised
    before anything is sent or after the answer, in the fuzzer: not the server's failure."""
    frames = traceback.extract_tb(err.__traceback__)
    return "Unsupported type" in str(err) and any("schemathesis" in frame.filename for frame in frames)


def fuzz(operation: APIOperation, mode: GenerationMode, max_examples: int) -> list[str]:
    """Send up to `max_examples` generated cases of `operation`; the failures found (hypothesis
    shrinks each to a small example and reports distinct ones together). A case is drawn inside
    the test so that a draw the fuzzer itself cannot handle is skipped (and counted), not blamed
    on the server."""
    cases = operation.as_strategy(generation_mode=mode)

    @given(data=st.data())
    @settings(
        max_examples=max_examples,
        deadline=timedelta(seconds=CALL_TIMEOUT_S),
        suppress_health_check=list(HealthCheck),  # slow and filtered examples are expected here
        derandomize=True,  # the same examples every run: a CI failure reproduces
        database=None,
        print_blob=False,
    )
    def run(data: st.DataObject) -> None:
        try:
            case = data.draw(cases, label="case")
            response = case.call(timeout=CALL_TIMEOUT_S)
            SEEN[operation.label][response.status_code] += 1
            if mode == GenerationMode.POSITIVE and response.status_code == 400:  # valid by the document
                REFUSED[str(response.json()["error"]["param"])] += 1
            case.validate_response(response, checks=CHECKS)
        except ValueError as err:
            if not fuzzers_own(err):
                raise
            FUZZER_ERRORS[operation.label] += 1
            reject()

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (a GET without inputs): nothing to send
        return []
    except (Exception, BaseExceptionGroup) as err:  # schemathesis' FailureGroup is a BaseExceptionGroup
        return failures_of(err)
    return []


FOUND: dict[str, dict[str, list[str]]] = {}


@pytest.mark.parametrize(
    ("mode", "max_examples"), [(GenerationMode.POSITIVE, 250), (GenerationMode.NEGATIVE, 150)], ids=str
)
def test_every_operation_answers_as_its_openapi_document_says(
    fuzzed: LiveServer, mode: GenerationMode, max_examples: int
) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    # the built-in model makes images: its /v1/videos operations answer one documented 404
    # (checked by tests/test_videos.py's server of a video model), not worth 17 s of cases here
    operations = [
        op for result in schema.get_all_operations() if not (op := result.ok()).path.startswith("/v1/videos")
    ]
    assert len(operations) >= 6, [operation.label for operation in operations]
    found = {operation.label: fuzz(operation, mode, max_examples) for operation in operations}
    FOUND[f"failures_{mode}"] = {label: failures for label, failures in found.items() if failures}
    assert not FOUND[f"failures_{mode}"], json.dumps(FOUND[f"failures_{mode}"], indent=2)
