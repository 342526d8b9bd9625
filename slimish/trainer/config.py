"""The trainer's schemas: advantages and losses (AlgorithmConfig), the optimiser (TrainerConfig),
LoRA, the critic, weight sync, checkpoints and SFT: every default of the trainer lives here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slimish.schema import at_least, doc, doc_factory, one_of

if TYPE_CHECKING:
    from slimish.config import RunConfig

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo")  # from rewards alone
CRITIC_ADVANTAGES = ("gae",)  # per token, from a value model (the critic section)
LOSSES = ("ppo", "gspo")
LOSS_REDUCTIONS = ("token", "sample", "trajectory", "dr_grpo")
SEGMENT_CREDITS = ("broadcast", "split", "last")  # or module:function
KL_ESTIMATORS = ("k1", "k2", "k3")

LR_SCHEDULES = ("constant", "cosine", "linear")
TRANSPORTS = ("distributed", "disk")
PAUSE_MODES = ("abort", "retract", "in_place", "drain")
# trainer.lora's pushes into SGLang 0.5.23 engines (slimish/trainer/weight_sync.py): a reload from disk under an abort pause.
SGLANG_LORA = (
    "SGLang 0.5.23 loads an adapter only from a directory (/load_lora_adapter; its broadcast update has no adapter "
    "target), and its unload waits for the adapter's requests, which only an abort pause ends: set "
    "weight_sync.transport=disk and weight_sync.pause_mode=abort"
)
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Help shared by a group of fields.
GAE_DOC = (
    "GAE (advantage=gae): discount and trace decay over a response's trained tokens. 1 and 1 (as verl): the "
    "advantage is then the return minus the critic's value, unbiased whatever the critic (which starts "
    "untrained); lam < 1 trades that bias for variance."
)
ROUTING_REPLAYS = ("none", "r3", "r2")
PARALLEL_DOC = (
    "Megatron backend only: tensor- and pipeline-parallel sizes; the data-parallel size is the world size / (tp * "
    "pp), and a batch is split over data-parallel ranks only."
)


@dataclass
class OPDConfig:
    """On-policy distillation: each trained token's advantage is the task advantage minus
    coef * (log pi_old - log pi_teacher), a per-token reverse-KL penalty toward the teacher
    (`launch.teacher`), whose log-probs of the sampled tokens the rollout side fetches."""

    coef: float = doc(0.0, "weight of the teacher's per-token signal; 0 = off (no teacher is started)")
    task_reward: bool = doc(
        True,
        "false: pure distillation: the task advantage is 0 and only the teacher trains the policy. Rewards are still "
        "computed and logged where the rollout / reward fn gives them (a sample without one scores 0.0 instead of "
        "failing); the zero-reward-variance filter is refused (it would drop groups by a reward that is not trained "
        "on): set rollout.filter_fn=null.",
    )

    def __post_init__(self) -> None:
        at_least(0, self, "algorithm.opd.", "coef")
        if not self.task_reward and self.coef == 0:
            raise ValueError(
                "algorithm.opd.task_reward=false (pure distillation) needs algorithm.opd.coef > 0: nothing would train the policy"
            )


@dataclass
class AlgorithmConfig:
    """Advantages and losses (slimish/trainer/advantages.py and losses.py have the formulas and the reasons)."""

    advantage: str = doc(
        "grpo",
        "grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gspo (= grpo) | gae (PPO with a critic: "
        "per-token GAE over a value model, the `critic` section; torch backend), or module:function, `fn(rewards: "
        "Tensor[T], group: Tensor[T]) -> Tensor[T]`: one advantage per trajectory (`rewards` per trajectory, `group` "
        "its group's index), in place of the built-in estimators",
    )
    advantage_eps: float = doc(1e-6, "added to the std in grpo / reinforce_pp (TRL uses 1e-4)")
    loss: str = doc(
        "ppo",
        "ppo (token ratio) | gspo (sequence ratio), or module:function, `fn(logprobs, old_logprobs, advantages, mask) "
        "-> Tensor[B, T]`: the per-token policy loss (all inputs [B, T]), in place of the clipped surrogate; "
        "reduction, KL, entropy and TIS apply to it as to the built-ins",
    )

    eps_clip: float = 0.2
    eps_clip_high: float | None = doc(
        None,
        "DAPO clip-higher (e.g. 0.28); None: eps_clip. Clipping (either side) binds only where the policy has moved "
        "from the old log-probs: updates_per_step > 1, or async (stale samples); with one update per step on fresh "
        "samples the ratio is 1 and it does nothing.",
    )
    dual_clip_c: float | None = doc(None, "dual clip for negative advantages (e.g. 3.0); must be > 1")
    loss_reduction: str = doc(
        "token",
        "token: sum / trained tokens of the batch | sample: mean of per-sample means | trajectory: mean of "
        "per-trajectory means (its segments and fan-out siblings pooled) | dr_grpo: sum / (samples x "
        "rollout.max_new_tokens)",
    )
    segment_credit: str = doc(
        "broadcast",
        "How a trajectory's advantage reaches its samples (segments of a split conversation, fan-out siblings): "
        "broadcast (each gets it), split (divided by their number), last (the last one only), or module:function, "
        "`fn(samples: list[Sample]) -> list[float]`, each one's share. Advantages are computed over trajectories: each "
        "counts once in its group's baseline.",
    )
    kl_coef: float = doc(0.0, "weight of the KL to the reference model (trainer.ref_model); 0 = no KL")
    kl_estimator: str = doc("k3", "k1 | k2 | k3")
    kl_in_reward: bool = doc(False, "subtract kl_coef * KL from the reward instead of a loss term")
    kl_importance_weight: bool = doc(
        False,
        "KL loss term times pi/pi_old per token: DeepSeek-V3.2's unbiased KL gradient (TRL's default)",
    )
    entropy_coef: float = doc(0.0, "weight of the entropy bonus; 0 = none")
    ptx_coef: float = doc(
        0.0,
        "InstructGPT's PPO-ptx: each optimiser step also trains on `sft.batch_size` demonstrations (`sft.source`, else "
        "`data.source`'s), their token-mean NLL times ptx_coef added to the loss. Why: RL alone can drive an answer's "
        "probability to 0 on the prompts it is right for, and a token never sampled is never rewarded; the "
        "demonstrations keep pulling every answer they show. 0 = off.",
    )
    tis_cap: float | None = doc(None, "truncated importance sampling against rollout logprobs")
    mis_cap: float | None = doc(None, "masked importance sampling: tokens whose weight exceeds it are dropped")
    recompute_old_logprobs: bool = doc(
        False,
        "pi_old from the trainer for every sample; else the rollout's logprobs, except for samples drawn from a "
        "reshaped distribution (Sample.reshaped). Free with one update per step: the update's own forward",
    )
    true_on_policy: bool = doc(
        False,
        "Rollout and trainer log-probs equal bit for bit (docs/true-on-policy.md): the engines run "
        "--enable-deterministic-inference, the trainer the same batch-invariant kernels (slimish/batch_invariant.py) on "
        "one thread, each generate call gets a `sampling_seed` from (seed, prompt, sample, call), and every step checks "
        "the first update's log-probs against the rollout's and fails if one token differs. Sync runs then reproduce "
        "their rollouts token for token, resume included. Built-in engine, torch backend, dense models, no LoRA.",
    )
    routing_replay: str = doc(
        "none",
        "Mixture-of-experts models: which expert choices the trainer's forwards use. none: its own top-k | r3: the "
        "rollout's (the engine returns its routes, SGLang's --enable-return-routed-experts; every token of the sample, "
        "prompt included) | r2: the trainer's own from the old-logprob pass (needs recompute_old_logprobs), so "
        "every update of a step routes alike. Either way the router's weights over the chosen experts are recomputed, "
        "so the router still learns.",
    )
    opd: OPDConfig = field(default_factory=OPDConfig)  # on-policy distillation (teacher: launch.teacher)
    gamma: float = doc(1.0, GAE_DOC)
    lam: float = doc(1.0, GAE_DOC)

    def __post_init__(self) -> None:
        choices = {
            "advantage": ADVANTAGES + CRITIC_ADVANTAGES,
            "loss": LOSSES,
            "loss_reduction": LOSS_REDUCTIONS,
            "kl_estimator": KL_ESTIMATORS,
            "routing_replay": ROUTING_REPLAYS,
        }
        for name, allowed in choices.items():
            if name in ("advantage", "loss"):
                if ":" in getattr(self, name):
                    continue  # module:function, loaded and checked when the trainer starts
                allowed = (*allowed, "module:function")
            one_of(f"algorithm.{name}", getattr(self, name), allowed)
        if self.segment_credit not in SEGMENT_CREDITS and ":" not in self.segment_credit:
            raise ValueError(
                f"algorithm.segment_credit must be one of {', '.join(SEGMENT_CREDITS)} or module:function, "
                f"got {self.segment_credit!r}"
            )
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"algorithm.eps_clip must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"algorithm.eps_clip_high must be > 0, got {self.eps_clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"algorithm.dual_clip_c must be > 1, got {self.dual_clip_c}")
        for name in ("tis_cap", "mis_cap"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"algorithm.{name} must be > 0, got {getattr(self, name)}")
        if self.tis_cap is not None and self.mis_cap is not None:
            raise ValueError(
                "algorithm.tis_cap and algorithm.mis_cap: set one importance-sampling correction, not both"
            )
        if self.routing_replay == "r2" and not self.recompute_old_logprobs:
            raise ValueError(
                "algorithm.routing_replay=r2 replays the old-logprob pass: set recompute_old_logprobs=true"
            )
        at_least(0, self, "algorithm.", "advantage_eps", "kl_coef", "ptx_coef")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algorithm.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass
class LoraConfig:
    """LoRA (`peft`) on the torch backend: only the adapter trains and only the adapter is pushed;
    the engines serve it by name beside the base (and beside other runs' adapters)."""

    enabled: bool = False
    rank: int = 8
    alpha: float = doc(16.0, "the update is scaled by alpha / rank")
    dropout: float = doc(
        0.0,
        "Applied in the gradient passes only (SFT and RL updates): log-probs, old and reference, are always taken "
        "without it, as the engines sample.",
    )
    target_modules: list[str] = doc_factory(
        lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        "the modules the adapter wraps (peft's target_modules); on a mixture-of-experts model gate_proj, up_proj and "
        "down_proj also adapt every expert (per-expert A and B; no dropout there), never the router",
    )
    name: str = doc(
        "policy",
        "The adapter's name on the engines (`lora_path` of every generate call of the run). Runs that share engines "
        "(launch.router_url) need different names.",
    )
    export_merged: bool = doc(False, "also write merged HF weights at the end (RUN_DIR/hf/merged), beside the adapter")

    def __post_init__(self) -> None:
        at_least(1, self, "trainer.lora.", "rank")
        if self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"trainer.lora.alpha must be > 0 and dropout in [0, 1), got {self.alpha}, {self.dropout}")
        if not self.target_modules:
            raise ValueError("trainer.lora.target_modules must name at least one module (e.g. q_proj v_proj)")
        if not LORA_NAME.fullmatch(self.name):
            raise ValueError(
                f"trainer.lora.name must be letters, digits, '.', '_' or '-' (it is a URL and directory part), got {self.name!r}"
            )

    @property
    def adapter(self) -> str | None:
        """The adapter name generate calls carry; None without LoRA (the base model)."""
        return self.name if self.enabled else None


@dataclass
class PolicyConfig:
    """One of several policies trained in one run (`policies`, docs/policies.md): a LoRA adapter on
    the run's one base model (`trainer.lora` gives rank, alpha and targets to every adapter), with its
    own optimiser, learning rate, advantage, checkpoint and pushes. Rollout functions pick it per call
    (`ctx.chat(..., policy=NAME)`); its reward is the sample's `reward[NAME]` (a number reward: every
    policy's)."""

    name: str = doc("policy", "the policy's and its adapter's name on the engines (as trainer.lora.name)")
    lr: float | None = doc(None, "its optimiser's learning rate; None: trainer.lr")
    advantage: str | None = doc(
        None, "its advantage estimator (a built-in of algorithm.advantage); None: algorithm.advantage"
    )

    def __post_init__(self) -> None:
        if not LORA_NAME.fullmatch(self.name):
            raise ValueError(
                f"policies[].name must be letters, digits, '.', '_' or '-' (it is an adapter name), got {self.name!r}"
            )
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"policies[{self.name}].lr must be >= 0, got {self.lr}")
        if self.advantage is not None:
            one_of(f"policies[{self.name}].advantage", self.advantage, ADVANTAGES)


def check_policies(cfg: RunConfig) -> None:
    """What `policies` needs of the rest of the run, refused by name: LoRA adapters on one model,
    trained by the torch backend on one rank, in sync mode (what the first slice implements)."""
    names = [p.name for p in cfg.policies]
    if len(set(names)) != len(names):
        raise ValueError(f"policies: names must differ, got {names}")
    needs = {
        "trainer.lora.enabled=true (each policy is an adapter on the one base model; a model per policy is not "
        "supported)": cfg.trainer.lora.enabled,
        "trainer.backend=torch": cfg.trainer.backend == "torch",
        "trainer.nproc=1": cfg.trainer.nproc == 1,
        "async_training=false": not cfg.async_training,
        "algorithm.true_on_policy=false": not cfg.algorithm.true_on_policy,
        "algorithm.ptx_coef=0": cfg.algorithm.ptx_coef == 0,
        "algorithm.opd.coef=0": cfg.algorithm.opd.coef == 0,
        "algorithm.advantage a built-in reward-only estimator": cfg.algorithm.advantage in ADVANTAGES,
        "sft.steps=0": cfg.sft.steps == 0,
    }
    if missing := [need for need, ok in needs.items() if not ok]:
        raise ValueError(f"policies {names} need {'; '.join(missing)}")


@dataclass
class TrainerConfig:
    """The policy's optimiser and batching (slimish/trainer/base.py and the backends beside it)."""

    backend: str = doc("torch", "torch | megatron")
    nproc: int = doc(1, "torchrun ranks `slimish train` launches")
    tp: int = doc(1, PARALLEL_DOC)
    pp: int = doc(1, PARALLEL_DOC)
    ep: int = doc(
        1,
        "Megatron backend only, mixture-of-experts models: expert-parallel size (each rank of an expert group holds "
        "num_experts / ep experts); divides world size / pp",
    )
    megatron_spec: str = doc(
        "local",
        "Megatron backend only: the layer spec (megatron_bridge BridgeConfig.spec). local: Megatron-Core modules, CPU "
        "or GPU; te: Transformer Engine's fused norm+linear modules, GPU only.",
    )
    lr: float = doc(1e-5, "the learning rate after warmup (lr_schedule scales it)")
    lr_schedule: str = doc("constant", "constant | cosine | linear (to 0 at the last optimiser step), after warmup")
    warmup_steps: int = doc(0, "optimiser steps of linear warmup")
    weight_decay: float = doc(0.0, "AdamW's weight decay")
    betas: list[float] = doc_factory(lambda: [0.9, 0.999], "AdamW's betas")
    grad_clip: float = doc(1.0, "max global grad norm; 0 = no clipping (the norm is still reported)")
    micro_batch_tokens: int = doc(8192, "padded tokens (rows x longest sample) of one micro-batch")
    logprob_chunk_tokens: int = doc(
        1024,
        "Torch backend: log-probs and entropies from the LM head this many scored (response) tokens at a time, each "
        "chunk checkpointed, so full-vocabulary fp32 logits never exist for the whole micro-batch (the long-context "
        "OOM); 0: the whole micro-batch's logits at once.",
    )
    updates_per_step: int = doc(1, "optimiser steps per rollout batch: the batch split into this many mini-batches")
    dtype: str | None = doc(
        None,
        "The compute dtype, and the engines' weights pushed in it. None: float32 on CPU (bf16 is 12-18x slower there), "
        "bfloat16 on GPU. torch backend: weights and AdamW stay fp32, the forward runs under autocast to it; megatron: "
        "params_dtype, fp32 main params in its optimizer.",
    )
    cpu_threads: int = doc(
        0,
        "CPU intra-op threads while training (train and SFT steps); 0: this rank's usable cores / local ranks in sync "
        "mode, where the engines idle while the trainer trains (2 threads: 1.7x faster fwd+bwd on 2 cores), and in "
        "async mode, where they do not, the trainer's share of them (launch.cpu_placement=split, the default) or "
        "OMP_NUM_THREADS (shared).",
    )
    ref_model: str | None = doc(None, "None with kl_coef > 0: a frozen copy of the policy at its first RL step")
    seed: int | None = doc(None, "model initialisation (Megatron); None: the run's seed")
    lora: LoraConfig = field(default_factory=LoraConfig)  # off by default: full fine-tuning

    def __post_init__(self) -> None:
        one_of("trainer.backend", self.backend, ("torch", "megatron"))
        if self.lora.enabled and self.backend != "torch":
            raise ValueError(
                f"trainer.lora needs trainer.backend=torch, got {self.backend!r}: the Megatron backend trains every weight"
            )
        if self.backend == "torch" and (self.tp, self.pp, self.ep) != (1, 1, 1):
            raise ValueError(
                f"trainer.tp, trainer.pp and trainer.ep need trainer.backend=megatron, got tp={self.tp}, pp={self.pp}, "
                f"ep={self.ep}"
            )
        one_of("trainer.megatron_spec", self.megatron_spec, ("local", "te"))
        one_of("trainer.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        at_least(1, self, "trainer.", "nproc", "tp", "pp", "ep", "micro_batch_tokens", "updates_per_step")
        at_least(
            0,
            self,
            "trainer.",
            "lr",
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "cpu_threads",
            "logprob_chunk_tokens",
        )
        one_of("trainer.dtype", self.dtype, (None, "float32", "bfloat16", "float16"))

    def compute_dtype(self, device_type: str) -> str:
        """`dtype`, or its default on a `device_type` ("cpu", "cuda") device."""
        return self.dtype or ("bfloat16" if device_type == "cuda" else "float32")


@dataclass
class CriticConfig:
    """The value model of PPO with a critic (algorithm.advantage=gae; slimish/trainer/torch_backend.py):
    an HF model with a scalar head on every token, its own AdamW."""

    model: str | None = doc(None, "HF model directory its backbone starts from; None: the run's `model`")
    lr: float | None = doc(None, "constant learning rate; None: trainer.lr")
    warmup_steps: int = doc(
        0,
        "RL steps at the start where only the critic trains (the policy's schedule still advances), so that the first "
        "policy updates see values fitted to the rewards",
    )
    value_clip: float | None = doc(
        0.5,
        "PPO value clipping: a value moves at most this far from its old value per batch before its loss stops pulling "
        "it (the larger of clipped and unclipped squared errors); None: no clip",
    )

    def __post_init__(self) -> None:
        at_least(0, self, "critic.", "warmup_steps")
        for name in ("lr", "value_clip"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"critic.{name} must be > 0 (or null), got {getattr(self, name)}")


@dataclass
class WeightSyncConfig:
    """Trainer rank 0 -> engines (slimish/trainer/weight_sync.py, docs/protocol.md 4)."""

    transport: str = doc("distributed", "distributed (broadcast) | disk (update_weights_from_disk)")
    bucket_mb: float = doc(128, "tensors per /update_weights_from_distributed call, by wire bytes")
    flattened: bool = doc(False, "one flattened uint8 broadcast per bucket (load_format flattened_bucket)")
    backend: str | None = doc(None, "gloo on CPU, nccl on GPU when None")
    dtype: str | None = doc(None, "wire dtype, e.g. bfloat16 to halve the bytes to bf16 engines; None: the trainer's")
    pause_mode: str = doc(
        "retract",
        "What in-flight generation does during a push: abort (return partial tokens), retract (requeue, recompute with "
        "the new weights), in_place (keep the KV: no cache flush either, which SGLang refuses while the parked batch "
        "runs), or drain (running requests finish on the old weights first, SGLang's writer lock; new ones wait for "
        "the push).",
    )
    group_name: str = doc("weight_update_group", "the weight-update process group's name on the engines")
    master_address: str = doc(
        "127.0.0.1",
        "Trainer rank 0's address as the engines reach it. Under launch.mode=ray on a cluster (launch.ray_address "
        "set), where engines on other nodes cannot reach a loopback, 127.0.0.1 becomes this node's IP as Ray sees it "
        "(ray.util.get_node_ip_address, as slime).",
    )
    timeout_s: float = doc(600.0, "a broadcast or HTTP call that takes longer fails the push")
    disk_dir: str | None = doc(
        None,
        "transport disk (and a LoRA adapter's first load): where pushes are written (engines must see it); None: "
        "RUN_DIR/weights, emptied when a run starts there and removed at its end",
    )

    def __post_init__(self) -> None:
        one_of("weight_sync.transport", self.transport, TRANSPORTS)
        one_of("weight_sync.pause_mode", self.pause_mode, PAUSE_MODES)
        if self.bucket_mb <= 0 or self.timeout_s <= 0:
            raise ValueError(f"weight_sync.bucket_mb and timeout_s must be > 0, got {self.bucket_mb}, {self.timeout_s}")
        if self.disk_dir == "":
            raise ValueError("weight_sync.disk_dir: an empty path; leave it unset (null) for RUN_DIR/weights")


@dataclass
class CheckpointConfig:
    """slimish/trainer/checkpoint.py: run_dir/checkpoints/step_NNNNNNNN, written atomically."""

    every: int = doc(0, "steps; 0 = only at the end")
    keep: int = doc(2, "newest checkpoints kept; 0 = all")
    resume: str | None = doc(None, "auto (newest in run_dir, or a fresh start) | a checkpoint directory | None")

    def __post_init__(self) -> None:
        at_least(0, self, "checkpoint.", "every", "keep")


@dataclass
class SFTConfig:
    steps: int = doc(0, "supervised warm-start steps before RL; 0 = none")
    source: str | None = doc(None, "JSONL with prompt and response, or `task:NAME` (the task's demonstrations)")
    batch_size: int = 32
    lr: float = 1e-4
