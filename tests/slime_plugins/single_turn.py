"""A custom generate written as a slime user writes one (slime's signature and imports): one
model turn on the prompt's ids, bookkeeping kept by hand, no loss mask (slime's default: all
trained). The engine's reply is kept in metadata for the tests to compare with."""

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.tokens = prompt_ids + [p[1] for p in pairs]
    sample.response_length = len(pairs)
    sample.response = output["text"]
    sample.rollout_log_probs = [p[0] for p in pairs]
    sample.metadata["engine_logprobs"] = [p[0] for p in pairs]
    sample.metadata["prompt_ids"] = prompt_ids
    finish = output["meta_info"]["finish_reason"]["type"]
    sample.status = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED}.get(
        finish, Sample.Status.ABORTED
    )
    return sample


async def generate_minimal(args, sample: Sample, sampling_params, evaluation=False) -> Sample:
    """Keeps no bookkeeping at all: slimish rebuilds the sample from the recorded reply."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"text": sample.prompt, "sampling_params": sampling_params})
    sample.response = output["text"]
    sample.metadata["evaluation"] = evaluation
    sample.metadata["engine_output_ids"] = output["output_ids"]
    sample.metadata["engine_prompt_ids"] = state.tokenizer.encode(sample.prompt)
    return sample
