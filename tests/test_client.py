"""The async client against a real engine: replies, errors that name the route, dead servers."""

from __future__ import annotations

import asyncio

import pytest

from slimish.client import Client, ServerError, ServerUnreachable
from slimish.net import free_port

GENERATE_ONLY = True  # the `engine` fixture is the session's shared one (conftest.py): these tests only generate
PROMPT = [5, 6, 7, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def test_generate_and_stream_agree(engine: str) -> None:
    async def go():
        async with Client(engine) as c:
            whole = await c.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
            chunks = [
                ch async for ch in c.generate_stream(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
            ]
            return whole, chunks

    whole, chunks = asyncio.run(go())
    assert len(whole.output_ids) == 6
    assert chunks[-1].output_ids == whole.output_ids
    assert len(chunks[-1].meta_info.output_token_logprobs) == 6


def test_a_long_streamed_line_is_read_whole(engine: str) -> None:
    """Cumulative top-logprob chunks grow past aiohttp's default 64 KiB read buffer (about 400 KB here)."""
    params = {**GREEDY, "max_new_tokens": 120}

    async def go():
        async with Client(engine) as c:
            return [
                ch
                async for ch in c.generate_stream(
                    input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=100
                )
            ]

    chunks = asyncio.run(go())
    assert len(chunks[-1].output_ids) == 120
    assert len(chunks[-1].meta_info.output_top_logprobs[-1]) == 100


def test_a_bad_request_names_the_route_and_the_servers_message(engine: str) -> None:
    async def go():
        async with Client(engine) as c:
            await c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": -3})

    with pytest.raises(ServerError) as info:
        asyncio.run(go())
    assert info.value.status == 400 and info.value.url == engine + "/generate"
    assert "max_new_tokens" in str(info.value)


def test_a_dead_server_is_unreachable_not_a_hang() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with Client(url, timeout=10) as c:
            assert await c.health() is False
            await c.generate(input_ids=PROMPT, sampling_params=GREEDY)

    with pytest.raises(ServerUnreachable) as info:
        asyncio.run(go())
    assert info.value.status == 0 and info.value.url == url + "/generate"
