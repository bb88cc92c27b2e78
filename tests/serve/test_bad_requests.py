"""Every bad request a client can send is a 4xx OpenAI error object naming the field, and the
server then still answers correctly (the same greedy text as ``dsv4 run``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.conftest import KEY, MAX_NEW_TOKENS, PROMPTS
from tests.serve.support import ServerProcess

MODEL = "{model}"
"""Stands for the served model's name in the cases below."""


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def without(body: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != field}


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body, status, param)
    ("wrong type: max_tokens as text", COMPLETIONS, completion(max_tokens="8"), 400, "max_tokens"),
    ("wrong type: temperature", COMPLETIONS, completion(temperature="hot"), 400, "temperature"),
    ("wrong type: stream as 1", COMPLETIONS, completion(stream=1), 400, "stream"),
    ("wrong type: prompt as a number", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    ("wrong type: messages as text", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("missing field: prompt", COMPLETIONS, without(completion(), "prompt"), 400, "prompt"),
    ("missing field: model", CHAT, without(chat(), "model"), 400, "model"),
    ("out of range: temperature", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    ("out of range: top_p 0", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("out of range: top_p 1.5", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    ("out of range: top_k", COMPLETIONS, completion(top_k=-2), 400, "top_k"),
    ("out of range: min_p", COMPLETIONS, completion(min_p=2), 400, "min_p"),
    ("out of range: n 0", COMPLETIONS, completion(n=0), 400, "n"),
    ("out of range: n 17", COMPLETIONS, completion(n=17), 400, "n"),
    ("out of range: max_tokens 0", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("out of range: seed", COMPLETIONS, completion(seed=-1), 400, "seed"),
    ("out of range: logprobs", COMPLETIONS, completion(logprobs=6), 400, "logprobs"),
    ("out of range: top_logprobs", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("out of range: penalty", COMPLETIONS, completion(presence_penalty=3), 400, "presence_penalty"),
    ("out of range: repetition", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("out of range: min_tokens", COMPLETIONS, completion(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens > max_tokens", COMPLETIONS, completion(min_tokens=9), 400, "min_tokens"),
    ("empty stop string", COMPLETIONS, completion(stop=[""]), 400, "stop.0"),
    ("five hundred stop strings", COMPLETIONS, completion(stop=["x"] * 500), 400, "stop"),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("no messages", CHAT, chat(messages=[]), 400, "messages"),
    (
        "unknown role",
        CHAT,
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        "messages.0.role",
    ),
    (
        "image content",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages.0.content.0.type",
    ),
    ("token id past the vocabulary", COMPLETIONS, completion(prompt=[1, 320]), 400, "prompt"),
    ("negative token id", COMPLETIONS, completion(prompt=[1, -1]), 400, "prompt.1"),
    (
        "stop token id past the vocabulary",
        COMPLETIONS,
        completion(stop_token_ids=[99999]),
        400,
        "stop_token_ids",
    ),
    ("prompt past max_model_len", COMPLETIONS, completion(prompt=[65] * 129), 400, "prompt"),
    ("max_tokens past max_model_len", COMPLETIONS, completion(max_tokens=200), 400, "max_tokens"),
    ("chat past max_model_len", CHAT, chat(max_completion_tokens=500), 400, "max_tokens"),
    ("unsupported: logit_bias", COMPLETIONS, completion(logit_bias={"1": 2}), 400, "logit_bias"),
    ("unsupported: suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    ("unsupported: tools", CHAT, chat(tools=[]), 400, "tools"),
    ("unsupported: best_of", COMPLETIONS, completion(best_of=2), 400, "best_of"),
    (
        "unsupported: echo with logprobs",
        COMPLETIONS,
        completion(echo=True, logprobs=1),
        400,
        "echo",
    ),
    (
        "unsupported: special tokens",
        COMPLETIONS,
        completion(skip_special_tokens=False),
        400,
        "skip_special_tokens",
    ),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("unknown model", COMPLETIONS, dict(completion(), model="gpt-4"), 404, "model"),
    ("unknown model in chat", CHAT, dict(chat(), model="x" * 5000), 404, "model"),
    ("tokenize: neither field", "/tokenize", {"model": MODEL}, 400, "prompt"),
    # requests that can never fit the server's 16 rows + 256 queued choices: a 400, not a 503
    # with Retry-After (which the openai client retries for ever)
    ("never fits: 5,000 prompts", COMPLETIONS, completion(prompt=["a"] * 5000), 400, "prompt"),
    ("never fits: 2,000 prompts", COMPLETIONS, completion(prompt=[[1]] * 2000), 400, "prompt"),
    ("never fits: n 16 x 20 prompts", COMPLETIONS, completion(prompt=["a"] * 20, n=16), 400, "n"),
    (
        "detokenize: past vocabulary",
        "/detokenize",
        {"model": MODEL, "tokens": [400]},
        400,
        "tokens",
    ),
]


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(KEY) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and "\n" not in error["message"]
    return error


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_a_bad_request_is_a_4xx_error_object_naming_the_field(
    http: httpx.Client,
    model_name: str,
    name: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
) -> None:
    if body.get("model") == MODEL:
        body = dict(body, model=model_name)
    error = _error(http.post(path, json=body), status)
    assert error["param"] == param, error
    if param is not None:
        assert param in error["message"]


@pytest.mark.parametrize(
    ("name", "content", "param"),
    [
        ("malformed JSON", b'{"model": "x", "prompt": ', None),
        ("not an object", b"[1, 2, 3]", None),
        ("NaN", b'{"model": "M", "prompt": "a", "temperature": NaN}', "temperature"),
        ("infinity", b'{"model": "M", "prompt": "a", "top_p": Infinity}', "top_p"),
        ("huge number", b'{"model": "M", "prompt": "a", "temperature": 1e999}', "temperature"),
        ("not UTF-8", b'{"model": "M", "prompt": "\xff\xfe"}', None),
        ("empty body", b"", None),
    ],
)
def test_a_body_that_is_not_a_valid_json_object_is_a_400(
    http: httpx.Client, model_name: str, name: str, content: bytes, param: str | None
) -> None:
    content = content.replace(b'"M"', json.dumps(model_name).encode())
    headers = {"Content-Type": "application/json"}
    error = _error(http.post(COMPLETIONS, content=content, headers=headers), 400)
    assert error["param"] == param


LONE = "\\udfff"
"""A JSON escape that decodes to a lone surrogate: no tokenizer, template or reply can encode
it (the issue saw a plain-text 500 for it in chat content and ``/tokenize``)."""


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": [{"role": "user", "content": f"a{LONE}b"}]}, "messages.0.content"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
            "messages.0.content.0.text",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "a", "name": LONE}]}, "messages.0.name"),
        ("/tokenize", {"prompt": LONE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
        (COMPLETIONS, {"prompt": LONE}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", LONE]}, "prompt.1"),
        (COMPLETIONS, {"prompt": "a", "stop": [LONE]}, "stop.0"),
        (COMPLETIONS, {"prompt": "a", "user": LONE}, "user"),
        (COMPLETIONS, {"prompt": "a", LONE: 1}, None),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_error_object(
    http: httpx.Client, model_name: str, path: str, body: dict[str, Any], param: str | None
) -> None:
    raw = json.dumps({"model": model_name, **body}).replace("\\\\udfff", "\\udfff")
    assert "\\udfff" in raw and "\\\\" not in raw
    headers = {"Content-Type": "application/json"}
    error = _error(http.post(path, content=raw.encode(), headers=headers), 400)
    assert error["param"] == param
    assert "\\udfff" in error["message"]  # named, as its escape


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (completion(stop=["x"] * 5000), "stop: List should have at most 16 items"),
        (completion(prompt=["a"] * 5000), "prompt: List should have at most 2048 items"),
        (completion(prompt=["a"] * 20, n=16), "20 prompts x n 16 = 320 choices"),
        (completion(prompt={"text": "a"}), "should be a string, a list of token ids, or a list"),
    ],
)
def test_one_message_per_bound(
    http: httpx.Client, model_name: str, body: dict[str, Any], says: str
) -> None:
    error = _error(http.post(COMPLETIONS, json=dict(body, model=model_name)), 400)
    assert says in error["message"] and "more field" not in error["message"], error


def test_keys_body_size_routes_and_methods(server: ServerProcess, model_name: str) -> None:
    body = dict(completion(), model=model_name)
    with server.client() as anonymous:
        assert _error(anonymous.post(COMPLETIONS, json=body), 401)["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer not-the-key"}
        _error(anonymous.post(COMPLETIONS, json=body, headers=wrong), 401)
        _error(anonymous.get("/v1/models", headers={"Authorization": KEY}), 401)
        for route in ("/tokenize", "/detokenize"):  # guarded too: they encode and decode
            _error(anonymous.post(route, json={"model": model_name, "prompt": "a"}), 401)
        assert anonymous.get("/health").status_code == 200  # open, as in vLLM
        assert anonymous.get("/metrics").status_code == 200
    with server.client(KEY) as http:
        huge = dict(body, prompt="x" * (64 * 1024))
        _error(http.post(COMPLETIONS, json=huge), 413)
        chunked = http.post(COMPLETIONS, content=iter([b"{" + b" " * 40_000] * 2))
        _error(chunked, 413)
        assert _error(http.get("/v1/nothing"), 404)["type"] == "not_found_error"
        long_path = _error(http.get("/v1/" + "x" * 8000), 404)["message"]
        assert len(long_path) < 120 and long_path.endswith("..."), long_path
        _error(http.get(COMPLETIONS), 405)


def test_after_every_bad_request_the_server_still_answers_correctly(
    http: httpx.Client, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    for _, path, body, status, _ in CASES:  # all of them again, on this worker's server
        if body.get("model") == MODEL:
            body = dict(body, model=model_name)
        assert http.post(path, json=body).status_code == status
    for prompt in PROMPTS[:3]:
        reply = http.post(
            COMPLETIONS,
            json={
                "model": model_name,
                "prompt": prompt,
                "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0,
            },
        )
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["text"] == offline[prompt]["text"]
    assert http.get("/health").json() == {"status": "ok"}
