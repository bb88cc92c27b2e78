"""The real ``openai`` client, sync and async, works unchanged against ``dsv4 serve``: plain and
streamed, completions and chat. Served greedy text equals ``dsv4 run``'s for the same prompt,
also when 17 streams run at once; seeded sampling gives the same tokens alone and under load;
the request parameters (n, echo, stop strings and ids, min_tokens, logprobs) do what they say; a
shared prompt prefix is found in the prefix cache, as the metrics count, and changes no token.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from dsv4.tokenizer import CheckpointTokenizer
from tests.serve.conftest import KEY, MAX_NEW_TOKENS, MODEL_ARGS, PROMPTS
from tests.serve.support import ServerProcess, metric, offline_outputs

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_NEW_TOKENS}
SEEDED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 20}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_completions_plain_and_streamed_equal_dsv4_run(
    client: OpenAI, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    for prompt in (PROMPTS[0], PROMPTS[5]):
        want = offline[prompt]
        plain = client.completions.create(model=model_name, prompt=prompt, **GREEDY)
        assert plain.choices[0].text == want["text"]
        assert plain.choices[0].finish_reason == want["finish_reason"]
        assert plain.usage is not None
        assert plain.usage.prompt_tokens == len(want["prompt_ids"])
        assert plain.usage.completion_tokens == len(want["output_ids"])
        chunks = list(
            client.completions.create(
                model=model_name,
                prompt=prompt,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
        )
        pieces = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in pieces) == want["text"]
        reasons = [c.choices[0].finish_reason for c in pieces]
        assert reasons[-1] == want["finish_reason"] and set(reasons[:-1]) <= {None}
        assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


def test_chat_renders_the_template_and_streams_the_same_content(
    client: OpenAI, server: ServerProcess, model_name: str, checkpoint: Path
) -> None:
    messages: Any = [{"role": "user", "content": PROMPTS[1]}]
    with server.client(KEY) as http:
        tokens = http.post("/tokenize", json={"model": model_name, "messages": messages}).json()
    tokenizer = CheckpointTokenizer.from_directory(checkpoint)
    assert tokenizer is not None
    assert tokens["tokens"] == tokenizer.encode_chat(PROMPTS[1])  # what `dsv4 run --chat` feeds
    plain = client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    as_completion = client.completions.create(model=model_name, prompt=tokens["tokens"], **GREEDY)
    assert plain.choices[0].message.content == as_completion.choices[0].text
    assert plain.choices[0].message.role == "assistant"
    stream = list(
        client.chat.completions.create(model=model_name, messages=messages, stream=True, **GREEDY)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in stream)
    assert content == plain.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_seventeen_concurrent_streams_each_equal_their_offline_output(
    server: ServerProcess, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    running: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        with server.client() as http:
            while not stop.is_set():
                running.append(metric(http, "dsv4:num_requests_running"))
                stop.wait(0.05)

    async def stream(client: AsyncOpenAI, prompt: str) -> str:
        chunks = await client.completions.create(
            model=model_name, prompt=prompt, stream=True, **GREEDY
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def all_at_once() -> list[str]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        return await asyncio.wait_for(
            asyncio.gather(*(stream(client, p) for p in PROMPTS)), timeout=300
        )

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        texts = asyncio.run(all_at_once())
    finally:
        stop.set()
        watcher.join(10)
    assert texts == [offline[p]["text"] for p in PROMPTS]
    assert max(running) >= 2  # they were batched together, not served one by one


def test_seeded_sampling_is_the_same_alone_and_batched_with_other_work(
    client: OpenAI, server: ServerProcess, model_name: str
) -> None:
    def seeded() -> str:
        reply = client.completions.create(model=model_name, prompt=PROMPTS[6], **SEEDED)
        return reply.choices[0].text

    alone = seeded()
    greedy = client.completions.create(model=model_name, prompt=PROMPTS[6], **GREEDY)
    assert alone != greedy.choices[0].text[: len(alone)]  # it did sample

    async def under_load() -> str:
        other = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        load = [
            other.completions.create(
                model=model_name,
                prompt=p,
                temperature=0.7 * (i % 2),
                max_tokens=10 + 3 * i,
                seed=i,
            )
            for i, p in enumerate(PROMPTS[:8])
        ]
        results = await asyncio.gather(*load, asyncio.to_thread(seeded))
        return str(results[-1])

    assert asyncio.run(asyncio.wait_for(under_load(), timeout=300)) == alone


def test_n_choices_are_the_requests_of_consecutive_seeds(client: OpenAI, model_name: str) -> None:
    reply = client.completions.create(model=model_name, prompt=PROMPTS[3], n=3, **SEEDED)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) > 1
    generated = 0
    for i, text in enumerate(texts):
        single = dict(SEEDED, seed=SEEDED["seed"] + i)
        alone = client.completions.create(model=model_name, prompt=PROMPTS[3], **single)
        assert alone.choices[0].text == text
        assert alone.usage is not None
        generated += alone.usage.completion_tokens
    assert reply.usage is not None and reply.usage.completion_tokens == generated


def test_echo_and_several_prompts(
    client: OpenAI, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    prompts = [PROMPTS[2], PROMPTS[4]]
    reply = client.completions.create(model=model_name, prompt=prompts, echo=True, **GREEDY)
    assert [c.text for c in reply.choices] == [p + offline[p]["text"] for p in prompts]


def _stop_in(text: str) -> tuple[str, int]:
    """A two-character stop string from ``text`` (no replacement character), and where it
    first occurs."""
    for at in range(2, len(text) - 2):
        stop = text[at : at + 2]
        if "\ufffd" not in stop and stop.strip():
            return stop, text.find(stop)
    raise AssertionError(f"no stop string in {text!r}")


def test_stop_strings_cut_the_text_plain_and_streamed(
    client: OpenAI, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    prompt = next(p for p in PROMPTS if len(offline[p]["text"]) >= 8)
    text = offline[prompt]["text"]
    stop, at = _stop_in(text)
    plain = client.completions.create(model=model_name, prompt=prompt, stop=[stop], **GREEDY)
    assert plain.choices[0].text == text[:at]
    assert plain.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model=model_name,
        prompt=prompt,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
        **GREEDY,
    )
    assert kept.choices[0].text == text[: at + len(stop)]
    streamed = client.completions.create(
        model=model_name, prompt=prompt, stop=[stop], stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:at]


def test_stop_token_ids_and_min_tokens(
    client: OpenAI, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    prompt = PROMPTS[0]
    first = offline[prompt]["output_ids"][0]
    one = client.completions.create(
        model=model_name, prompt=prompt, extra_body={"stop_token_ids": [first]}, **GREEDY
    )
    assert one.choices[0].finish_reason == "stop"
    assert one.usage is not None and one.usage.completion_tokens == 1
    held = client.completions.create(
        model=model_name,
        prompt=prompt,
        extra_body={"stop_token_ids": [first], "min_tokens": 5},
        **GREEDY,
    )
    assert held.usage is not None and held.usage.completion_tokens >= 5


def test_logprobs_rank_the_sampled_token_first_when_greedy(
    client: OpenAI, model_name: str, offline: dict[str, dict[str, Any]]
) -> None:
    reply = client.completions.create(model=model_name, prompt=PROMPTS[1], logprobs=3, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs and logprobs.top_logprobs
    assert len(logprobs.token_logprobs) == len(offline[PROMPTS[1]]["output_ids"])
    for token, own, top in zip(
        logprobs.tokens or (), logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and own is not None and own <= 0
        assert top[token] == own == max(top.values())  # greedy took the most likely token
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": PROMPTS[1]}],
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_models_and_detokenize(server: ServerProcess, model_name: str, client: OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == model_name and card.model_extra == {"max_model_len": 128}
    with server.client(KEY) as http:
        tokens = http.post("/tokenize", json={"model": model_name, "prompt": "héllo"}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
        text = http.post("/detokenize", json={"model": model_name, "tokens": tokens["tokens"]})
        assert text.json() == {"prompt": "héllo"}
        assert isinstance(http, httpx.Client)


def test_a_shared_prefix_is_found_in_the_cache_and_changes_no_token(
    client: OpenAI, server: ServerProcess, model_name: str, checkpoint: Path
) -> None:
    """Two prompts share 71 tokens: the second finds the first 64 (the tiny model's boundary:
    blocks of 16, HCA windows of 16, entry blocks of 64 tokens) and gives the text of a run
    without the cache; ``/metrics`` counts tokens looked up and found, as vLLM does."""
    prefix = "You are a careful assistant. Answer in one short sentence and never explain "
    prompts = [f"{prefix}yourself. Question: what is red?", f"{prefix}yourself. Question: blue?"]
    tokenizer = CheckpointTokenizer.from_directory(checkpoint)
    assert tokenizer is not None
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    args = ["--checkpoint", str(checkpoint), "--max-new-tokens", "8", *MODEL_ARGS]
    want = offline_outputs([*args, "--no-enable-prefix-caching"], prompts)
    http = server.client(KEY)
    queries, hits = (metric(http, f"dsv4:prefix_cache_{n}_total") for n in ("queries", "hits"))
    for prompt, expected in zip(prompts, want, strict=True):
        got = client.completions.create(
            model=model_name, prompt=prompt, **{**GREEDY, "max_tokens": 8}
        )
        assert got.choices[0].text == expected["text"]
    assert metric(http, "dsv4:prefix_cache_queries_total") - queries == sum(lengths)
    assert metric(http, "dsv4:prefix_cache_hits_total") - hits == 64
