"""A request fuzzer built on the OpenAPI schema the server publishes (schemathesis, which is
hypothesis): schema-valid and schema-violating requests to every route find no 5xx, no hang, no
response that breaks the schema, and every violating request is refused with a 4xx.

Valid requests name a random model most of the time, so half of them have their ``model`` set
to the served one: those reach the engine (the server's ``--max-model-len 128`` keeps each one
short). Every call has a timeout; the number of examples follows the hypothesis profile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serve.conftest import KEY
from tests.serve.support import ServerProcess

CALL_TIMEOUT_S = 60
CHECKS: list[Any] = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
ROUTES = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


@schemathesis.check
def refused(ctx: Any, response: Any, case: Any) -> bool | None:
    """``negative_data_rejection``, where a 413 refuses too: a body past the server's size limit
    (a list longer than the schema's bound, here) is refused before its schema is read."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def schema(server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", timeout=CALL_TIMEOUT_S)


def test_the_schema_lists_every_route(schema: Any) -> None:
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted((o.method.upper(), o.path) for o in operations) == sorted(ROUTES)


def _served(model: str) -> Callable[[Any], Any]:
    def name_it(case: Any) -> Any:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        return case

    return name_it


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzing_a_route_finds_no_server_error_and_no_hang(
    schema: Any, server: ServerProcess, model_name: str, method: str, path: str, mode: Any
) -> None:
    operation = schema[path][method]
    if mode is GenerationMode.NEGATIVE and not operation.body and method == "GET":
        pytest.skip("nothing a client sends to this route can violate its schema")
    cases = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        cases = st.one_of(cases, cases.map(_served(model_name)))
    checks = [*CHECKS, refused] if mode is GenerationMode.NEGATIVE else CHECKS
    statuses: list[int] = []

    @settings(suppress_health_check=list(HealthCheck), database=None)
    @given(cases)
    def fuzz(case: Any) -> None:
        response = case.call(
            base_url=server.url,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=CALL_TIMEOUT_S,
        )
        statuses.append(response.status_code)
        case.validate_response(response, checks=checks)

    fuzz()
    assert statuses and max(statuses) < 500
    with server.client() as http:
        assert http.get("/health").status_code == 200
