"""Agents written as each framework's users write them, for tests/test_agent_frameworks.py: a
calculator tool from a plain Python function, a structured answer from a pydantic model, the
framework's own client pointed at a gateway session (nothing here knows it is one).

Each agent is `async def agent(urls) -> output`, `urls` being the session's `Urls`; the
framework is imported inside it (each import is ~1 s: only the frameworks a test runs load).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from rollout_plugins.openai_agent import calculator as evaluate

SYSTEM = "You are a careful assistant."
QUESTION = "What is 2+3?"
KEY = "sk-unused"
CLAUDE = "claude-haiku-4-5"  # a name pydantic-ai knows to take structured output (its model profiles)


class Answer(BaseModel):
    answer: int


def calculator(expression: str) -> str:
    """Evaluate arithmetic"""
    return evaluate(expression)


@dataclass(frozen=True)
class Urls:
    openai: str  # base_url of OpenAI's SDKs (`.../v1`)
    anthropic: str  # base_url of Anthropic's SDK


AgentFn = Callable[[Urls], Awaitable[Any]]


# ---- openai-agents ------------------------------------------------------------------------------


def openai_agents(protocol: str, kind: str) -> AgentFn:
    """Chat Completions or Responses model; `kind`: tools | forced (tool_choice="required",
    reset after the call) | structured (`output_type`) | stream (`Runner.run_streamed`)."""

    async def agent(urls: Urls) -> Any:
        import openai
        from agents import (
            Agent,
            ModelSettings,
            OpenAIChatCompletionsModel,
            OpenAIResponsesModel,
            Runner,
            function_tool,
            set_tracing_disabled,
        )

        set_tracing_disabled(True)  # it would upload traces to OpenAI

        client = openai.AsyncOpenAI(base_url=urls.openai, api_key=KEY, max_retries=0)
        model = (OpenAIChatCompletionsModel if protocol == "chat" else OpenAIResponsesModel)("m", client)
        structured = kind == "structured"
        a = Agent(
            name="a",
            instructions=SYSTEM,
            model=model,
            tools=[] if structured else [function_tool(calculator)],
            model_settings=ModelSettings(tool_choice="required" if kind == "forced" else None),
            output_type=Answer if structured else None,
        )
        if kind != "stream":
            return (await Runner.run(a, QUESTION)).final_output
        run = Runner.run_streamed(a, QUESTION)
        async for _ in run.stream_events():
            pass
        return run.final_output

    return agent


# ---- LangChain / LangGraph ----------------------------------------------------------------------


def langchain_model(protocol: str, urls: Urls) -> Any:
    if protocol == "anthropic":
        from langchain_anthropic import ChatAnthropic

        return ChatAnthropic(model=CLAUDE, base_url=urls.anthropic, api_key=KEY, max_retries=0, max_tokens=64)
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="m", base_url=urls.openai, api_key=KEY, max_retries=0, use_responses_api=protocol == "responses"
    )


def langchain(protocol: str, kind: str) -> AgentFn:
    """langchain-openai (Chat or Responses) or langchain-anthropic; `kind`: tools (LangGraph's
    `create_react_agent`) | forced (`with_structured_output(method="function_calling")`: a named
    tool forced) | structured (`with_structured_output(method="json_schema")`) | stream (`bind_tools`
    and a hand-written loop reading `astream`)."""

    async def agent(urls: Urls) -> Any:
        from langchain_core.messages import HumanMessage, SystemMessage
        from langchain_core.tools import tool

        llm, calc = langchain_model(protocol, urls), tool(calculator)
        messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
        if kind in ("forced", "structured"):
            method = "function_calling" if kind == "forced" else "json_schema"
            return await llm.with_structured_output(Answer, method=method).ainvoke(messages)
        if kind == "tools":
            from langgraph.prebuilt import create_react_agent

            out = await create_react_agent(llm, [calc], prompt=SYSTEM).ainvoke({"messages": [("user", QUESTION)]})
            return out["messages"][-1].text
        bound = llm.bind_tools([calc])
        while True:
            reply = None
            async for chunk in bound.astream(messages):
                reply = chunk if reply is None else reply + chunk
            messages.append(reply)
            if not reply.tool_calls:
                return reply.text
            messages += [await calc.ainvoke(call) for call in reply.tool_calls]

    return agent


# ---- pydantic-ai --------------------------------------------------------------------------------


def pydantic_ai_model(protocol: str, urls: Urls) -> Any:
    if protocol == "anthropic":
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        return AnthropicModel(CLAUDE, provider=AnthropicProvider(base_url=urls.anthropic, api_key=KEY))
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    cls = OpenAIChatModel if protocol == "chat" else OpenAIResponsesModel
    return cls("m", provider=OpenAIProvider(base_url=urls.openai, api_key=KEY))


def pydantic_ai(protocol: str, kind: str) -> AgentFn:
    """OpenAI Chat, OpenAI Responses or Anthropic model; `kind`: tools | forced
    (`output_type=ToolOutput(Answer)`: pydantic-ai's output tool, every turn forced to call a tool;
    the default for a plain `Answer` where the model's profile has no native structured output) |
    structured (`output_type=NativeOutput(Answer)`: the protocol's structured output) | stream
    (`run_stream`)."""

    async def agent(urls: Urls) -> Any:
        from pydantic_ai import Agent, NativeOutput, ToolOutput

        output = {"forced": ToolOutput(Answer), "structured": NativeOutput(Answer)}.get(kind, str)
        tools = [] if kind == "structured" else [calculator]
        a = Agent(pydantic_ai_model(protocol, urls), system_prompt=SYSTEM, tools=tools, output_type=output)
        if kind != "stream":
            return (await a.run(QUESTION)).output
        async with a.run_stream(QUESTION) as run:
            return await run.get_output()

    return agent
