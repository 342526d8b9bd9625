"""A multi-turn, search-style custom generate in slime's shape (after slime's
examples/search-r1): the model's turns come from `/generate`, a `<search>query</search>` in a
turn is answered by a fake retriever, and the observation is tokenized with the tokenizer and
appended with loss mask 0 and logprob 0. It keeps its own tokens, loss_mask, rollout_log_probs
and status. `args.search_payload` chooses how it re-sends the conversation: `input_ids` (the ids
it holds), `text` (prompt + response text, as search-r1 does) or `alternate` (by sample index).
Each turn's engine reply goes into `metadata["turns"]` for the tests."""

import re

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

MAX_TURNS = 3


def fake_retrieve(query: str) -> str:
    return f"Doc 1(Title: {query[:12]}) nothing found"


def observation(text: str) -> str:
    match = re.search(r"<search>(.*?)</search>", text, re.DOTALL)
    if match:
        return f"\n\n<information>{fake_retrieve(match.group(1).strip())}</information>\n\n"
    return "\nMy previous action is invalid. Let me search again.\n"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    mode = args.search_payload
    if mode == "alternate":
        mode = "text" if sample.index % 2 else "input_ids"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    tokens, loss_mask, log_probs, response = list(prompt_ids), [], [], ""
    turns = []
    for turn in range(MAX_TURNS):
        payload = {"sampling_params": sampling_params, "return_logprob": True}
        if mode == "text":
            payload["text"] = sample.prompt + response
        else:
            payload["input_ids"] = tokens
        output = await post(url, payload)
        finish = output["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        ids = [p[1] for p in output["meta_info"]["output_token_logprobs"]]
        lps = [p[0] for p in output["meta_info"]["output_token_logprobs"]]
        tokens += ids
        loss_mask += [1] * len(ids)
        log_probs += lps
        response += output["text"]
        obs, obs_ids = "", []
        if turn < MAX_TURNS - 1 and "<answer>" not in output["text"]:
            obs = observation(output["text"])
            obs_ids = state.tokenizer(obs, add_special_tokens=False)["input_ids"]
            tokens += obs_ids
            loss_mask += [0] * len(obs_ids)
            log_probs += [0.0] * len(obs_ids)
            response += obs
        turns.append(
            {"output_ids": ids, "logprobs": lps, "text": output["text"], "obs": obs, "obs_ids": obs_ids, "mode": mode}
        )
        if not obs_ids:
            break
    sample.tokens = tokens
    sample.response_length = len(tokens) - len(prompt_ids)
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    sample.response = response
    sample.metadata["turns"] = turns
    sample.metadata["prompt_ids"] = prompt_ids
    sample.status = Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED
    return sample
