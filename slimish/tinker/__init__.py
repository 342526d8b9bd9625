"""`slimish tinker`: the Tinker training API (SDK `tinker` 0.38) served by slimish: LoRA adapters on one base
model, trained in this process, sampled through a built-in engine."""
