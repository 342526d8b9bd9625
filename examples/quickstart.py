"""Quickstart: build a tiny model, start the built-in engine, generate through its HTTP API.

Everything runs on this machine's CPU in about a minute, with no downloads.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from slimish.client import Client
from slimish.launch.local import engine_process
from slimish.tiny_model import make_tiny_model

RUN_DIR = Path("runs/quickstart")


async def main(url: str) -> None:
    async with Client(url) as client:
        info = await client.model_info()
        print(f"engine up at {url}: {info['architectures'][0]} from {info['model_path']}")
        greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
        out = await client.generate(text="12+7=", sampling_params=greedy, return_logprob=True)
        print(f"greedy: {out.output_ids} -> {out.text!r}")
        print(f"  logprobs: {[round(lp, 3) for lp, _, _ in out.meta_info.output_token_logprobs[:6]]} ...")
        sampled = {"temperature": 1.0, "max_new_tokens": 8, "n": 4, "sampling_seed": 0}
        batch = await client.generate(input_ids=out.output_ids[:4], sampling_params=sampled)
        for i, b in enumerate(batch):
            print(f"sample {i}: {b.output_ids} finish={b.meta_info.finish_reason.type}")
        print(
            "chunks streamed:",
            [
                len(c.output_ids)
                async for c in client.generate_stream(text="hello", sampling_params={**greedy, "max_new_tokens": 5})
            ],
        )
        chat = await client.chat(messages=[{"role": "user", "content": "What is 2+3?"}], max_tokens=12, temperature=0)
        print(f"chat: {chat['choices'][0]['message']['content']!r}")
    print("(random weights: the text is noise; the tokens, logprobs and protocol are real)")


if __name__ == "__main__":
    model_dir = RUN_DIR / "tiny-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, arch="llama", size="tiny", seed=0)
        print(f"built {model_dir}")
    with engine_process(model_dir, log_path=RUN_DIR / "engine.log") as engine:
        asyncio.run(main(engine.url))
