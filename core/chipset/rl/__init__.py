"""Reinforcement learning on the engine: GRPO post-training with verifiable rewards (docs/rl.md).

The room's pieces, bottom up: :mod:`~chipset.rl.tasks` (built-in verifiable tasks and JSONL
prompts, byte vocabulary), :mod:`~chipset.rl.rewards` (reward callables, checked),
:mod:`~chipset.models.sampling` (batched sampling with a KV cache, shared with `chipset generate`), :mod:`~chipset.rl.logprobs`
(per-token log-probabilities under every layout, and the per-token loss hook),
:mod:`~chipset.rl.grpo` (advantages and the clipped loss), :mod:`~chipset.rl.rollout` (the rollout
engine interface and the weight stream an external one is fed from) and :mod:`~chipset.rl.loop`
(what ``chipset rl`` runs on each rank).
"""
