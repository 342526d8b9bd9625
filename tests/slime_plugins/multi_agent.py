"""A multi-agent fan-out in slime's shape (after slime's examples/multi_agent): `num_parallel`
solver agents answer the problem, each a new training sample with its own prompt, rewarded
together by `batched_async_rm` (the run's `rm_type`); a selector agent then picks among them and
is rewarded with its pick's reward. Every sample is stamped with the input's `rollout_id`, and
the list of all of them is returned. Loaded by module path, as slime loads its examples
(`slime:tests.slime_plugins.multi_agent:generate_with_multi_agents`)."""

import asyncio
from copy import deepcopy

from slime.rollout.rm_hub import batched_async_rm
from slime.utils.http_utils import post
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

SOLVER = "Solve: {problem}\nAgent {k}:"
SELECTOR = "Problem: {problem}\n{solutions}\nBest solution number:"


async def agent_turn(args, base: Sample, prompt: str) -> Sample:
    """One agent's sample: `prompt`, one model turn within the context left."""
    sample = deepcopy(base)
    sample.prompt = prompt
    sample.tokens = args.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = deepcopy(args.sampling_params)
    params["max_new_tokens"] = min(params["max_new_tokens"], args.rollout_max_context_len - len(sample.tokens))
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args,
        tokens=[p[1] for p in pairs],
        log_probs=[p[0] for p in pairs],
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )
    sample.metadata["engine"] = {
        "output_ids": [p[1] for p in pairs],
        "logprobs": [p[0] for p in pairs],
        "text": output["text"],
    }
    return sample


async def generate_with_multi_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    args = deepcopy(args)
    args.sampling_params = sampling_params
    args.rollout_max_context_len = args.eval_max_context_len if evaluation else args.rollout_max_context_len
    args.tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
    problem = sample.prompt
    solvers = await asyncio.gather(
        *(agent_turn(args, sample, SOLVER.format(problem=problem, k=k)) for k in range(args.num_parallel))
    )
    for solver, reward in zip(solvers, await batched_async_rm(args, list(solvers))):
        solver.reward = reward
    listing = "\n".join(f"{k + 1}. {s.response}" for k, s in enumerate(solvers))
    selector = await agent_turn(args, sample, SELECTOR.format(problem=problem, solutions=listing))
    selector.reward = max(s.reward for s in solvers)
    samples = [*solvers, selector]
    for s in samples:
        s.rollout_id = sample.index
    return samples
