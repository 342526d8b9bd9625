"""A small file-editing agent: the kind of program slimish trains black-box, without changing it.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python agent.py     # in the directory to work in

It imports nothing of slimish: it reads `task.md` from its working directory, asks the model
(OpenAI Chat Completions; base URL and key from the environment, as the `openai` SDK reads them)
to do it with two tools, `read_file` and `write_file`, runs the calls inside the working directory
for up to `AGENT_MAX_TURNS` model turns, and exits 0. A model that writes garbage gets a bad
reward, not a crash: bad tool arguments and paths outside the directory are reported back to the
model as the tool's result. A model API that cannot be reached is a crash (exit 1): the run then
says nothing about the policy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import openai

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "6"))
MODEL = os.environ.get("AGENT_MODEL", "policy")
MAX_READ_CHARS = 20_000  # a tool result the model sees; the rest is cut, saying so
MAX_WRITE_CHARS = 100_000
SYSTEM = (
    "You work in a directory of files. Use the read_file and write_file tools to do the task, "
    "then reply with a one-line summary and no tool call."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the working directory.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write (create or replace) a text file of the working directory.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]


def inside(root: Path, path: Any) -> Path:
    """`path` resolved under `root`; absolute paths, `..` and symlinks that lead out are refused."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"path {path!r} is outside the working directory")
    return target


def read_file(root: Path, path: Any) -> str:
    text = inside(root, path).read_text(encoding="utf-8")
    return (
        text
        if len(text) <= MAX_READ_CHARS
        else text[:MAX_READ_CHARS] + f"\n[cut: {len(text) - MAX_READ_CHARS} more chars]"
    )


def write_file(root: Path, path: Any, content: Any) -> str:
    if not isinstance(content, str) or len(content) > MAX_WRITE_CHARS:
        raise ValueError(f"content must be a string of at most {MAX_WRITE_CHARS} chars")
    target = inside(root, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content, encoding="utf-8")
    return f"wrote {len(content)} chars to {path}"


def run_tool(root: Path, name: str, arguments: str) -> str:
    """One tool call; whatever is wrong with it comes back as the result, for the model to read."""
    try:
        args = json.loads(arguments)
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        if name == "read_file":
            return read_file(root, args["path"])
        if name == "write_file":
            return write_file(root, args["path"], args["content"])
        return f"error: no tool named {name!r} (tools: read_file, write_file)"
    except KeyError as exc:
        return f"error: missing argument {exc}"
    except (ValueError, TypeError, OSError) as exc:
        return f"error: {exc}"


def main() -> int:
    root = Path.cwd().resolve()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": (root / "task.md").read_text(encoding="utf-8")},
    ]
    client = openai.OpenAI()
    for turn in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        except openai.BadRequestError as exc:  # e.g. the conversation outgrew the context: the policy's doing
            print(f"turn {turn}: request refused: {exc}", file=sys.stderr)
            break
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"turn {turn}: done: {(message.content or '')[:200]}")
            break
        for call in message.tool_calls:
            result = run_tool(root, call.function.name, call.function.arguments)
            print(f"turn {turn}: {call.function.name} -> {result[:200]}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
