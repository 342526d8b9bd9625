"""The gateway's protocol adapters: each turns its API's request into a `TurnRequest` (OpenAI chat
messages and tools) for `Gateway.turn`, and the `TurnResult` back into its API's reply and
stream events. Token bookkeeping lives in the core, never here."""
