"""A ReTool-style tool loop in slime's shape (after slime's examples/retool): the model's turns come
from `/generate` on the ids the function holds; each turn's code (a `<code>...</code>` block, else
the whole turn) runs in slimish's code sandbox (`run_python`), and its
output goes back as an `<interpreter>` observation, appended with `trainable=False` (loss mask 0,
logprob 0). A turn is at most `turn_max_tokens` long; the loop ends when the model answers
(`\\boxed{}` or `Answer:`), after `max_turns` turns, once the model wrote `max_new_tokens`, or when
the context (`rollout_max_context_len`, else slime's `context_parallel_size * max_tokens_per_gpu`)
is full. Each turn's engine reply goes into `metadata["turns"]` for the tests;
`reward_func` scores with DAPO's rule, as the example does."""

import re

from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

from slimish.rollout.python_tool import run_python

CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)


async def run_in_sandbox(code: str) -> str:
    """The code's output (its last 120 characters), run by slimish's sandboxed interpreter: no
    network, a private filesystem, its own PID namespace, time and resource limits. A sandbox that
    failed fails the sample (an error, never a reward)."""
    result = await run_python(code)
    if result.infra_error is not None:
        raise RuntimeError(f"the code sandbox failed: {result.infra_error}")
    return result.observation()[-120:]


async def generate(args, sample: Sample, sampling_params) -> Sample:
    assert not args.partial_rollout
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens, sample.response, sample.response_length = list(prompt_ids), "", 0
    sample.loss_mask, sample.rollout_log_probs = [], None
    if args.rollout_max_context_len is not None:
        max_context = args.rollout_max_context_len
    else:
        max_context = args.context_parallel_size * args.max_tokens_per_gpu
    turns, answered = [], False
    for turn in range(args.max_turns):
        written = sum(sample.loss_mask)  # the model's tokens count against max_new_tokens, observations do not
        budget = min(
            args.turn_max_tokens, sampling_params["max_new_tokens"] - written, max_context - len(sample.tokens)
        )
        if budget <= 0:
            break
        payload = {
            "input_ids": sample.tokens,
            "sampling_params": {**sampling_params, "max_new_tokens": budget},
            "return_logprob": True,
        }
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        pairs = output["meta_info"]["output_token_logprobs"]
        ids, lps = [p[1] for p in pairs], [p[0] for p in pairs]
        sample.append_response_tokens(
            args, tokens=ids, log_probs=lps, trainable=True, meta_info=output["meta_info"], text=output["text"]
        )
        record = {"output_ids": ids, "logprobs": lps, "text": output["text"], "obs": "", "obs_ids": []}
        turns.append(record)
        answered = "\\boxed" in output["text"] or "Answer:" in output["text"]
        if answered or turn == args.max_turns - 1:
            break
        match = CODE.search(output["text"])
        result = await run_in_sandbox(match.group(1) if match else output["text"])
        record["obs"] = f"\n<interpreter>\n{result}\n</interpreter>\n"
        record["obs_ids"] = state.tokenizer(record["obs"], add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=record["obs_ids"], trainable=False, text=record["obs"])
    sample.metadata["turns"] = turns
    sample.metadata["prompt_ids"] = prompt_ids
    # Each turn's reply set the status (a turn cut at turn_max_tokens reads TRUNCATED): the loop's own end decides.
    full = len(sample.tokens) >= max_context or sum(sample.loss_mask) >= sampling_params["max_new_tokens"]
    sample.status = Sample.Status.TRUNCATED if full and not answered else Sample.Status.COMPLETED
    return sample


async def reward_func(args, sample: Sample, **kwargs) -> float:
    return compute_score(sample.prompt + sample.response, sample.label)["score"]
