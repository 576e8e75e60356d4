"""Jobs of tests/rl/test_rl.py, run as their own processes: ``python tests/rl/rl_jobs.py MODE OUT [HF]``.

* ``sft OUT``: a brief supervised warm-up (30 steps) on the sort task's format through chipset.api
  (the same pieces as ``chipset train``), saved as a checkpoint and exported to ``OUT/hf`` (Hugging
  Face).
* ``double OUT HF``: a short GRPO run from ``HF`` whose rollouts come from :class:`StreamDouble`, a
  stand-in for an external rollout engine (vLLM/SGLang, which this machine cannot run); it writes
  what the double received to ``OUT/double.json``.
* ``replica OUT``: for an MoE model and a LoRA model, one training step, then the in-process
  rollout engine's replica loaded from the weight stream; the replica's logits and the engine's
  on the same tokens go to ``OUT/replica.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "max_position_embeddings": 32}
SFT_STEPS = 30
SFT_SEQ = 12  # "sort 312:" + "123\n": 13 tokens, inputs and targets shifted by one


def sft(out: Path) -> None:
    from chipset import api
    from chipset.rl.tasks import PromptSource, sft_batch
    from chipset.train.checkpoint.export import export

    cfg = api.config(model=MODEL, train={"steps": SFT_STEPS, "global_batch": 16, "seq_len": SFT_SEQ, "lr": 3e-3})
    backend = api.init(cfg)
    engine = api.parallelize(cfg, backend)
    source = PromptSource(task="sort", seed=123)  # not the RL run's prompt stream (data.seed 0)
    for step in range(SFT_STEPS):
        api.step(engine, [sft_batch(source, step, 16, SFT_SEQ)], api.lr_at(cfg, step))
    ckpt = api.checkpointer(cfg, backend, engine, out / "sft")
    ckpt.save(SFT_STEPS)
    ckpt.finish()
    export(out / "sft", out / "hf")
    api.finish_rank(backend)


class StreamDouble:
    """A test double of an external rollout engine: it keeps the streamed weights by their HF names
    in a model of its own (chipset's replica) and samples from it; it records every load."""

    def __init__(self, inner):
        self.inner = inner
        self.loads: list[dict] = []

    def load_weights(self, weights) -> None:
        got = {}
        kept = []
        for name, t in weights:
            got[name] = [list(t.shape), float(t.double().norm())]
            kept.append((name, t.clone()))
        self.loads.append(got)
        self.inner.load_weights(kept)

    def generate(self, prompts, n, params, seeds):
        return self.inner.generate(prompts, n, params, seeds)


def double(out: Path, hf: str) -> None:
    from chipset import api
    from chipset.models.registry import resolve_family
    from chipset.rl import loop
    from chipset.rl.rollout import LocalRollout, RolloutEngine

    cfg = api.config(model={**MODEL, "init_from": hf}, train={"steps": 2, "global_batch": 16, "lr": 1e-3},
                     rl={"task": "sort", "group_size": 4, "max_new_tokens": 4})
    backend = api.init(cfg)
    d = StreamDouble(LocalRollout(resolve_family("transformer"), cfg, backend.device.torch_device(),
                                  backend.kernels))
    assert isinstance(d, RolloutEngine)
    res = loop.run(cfg, backend, None, rollout=d)
    (out / "double.json").write_text(json.dumps({"loads": d.loads, "rewards": [m["reward_mean"] for m in res.metrics]}))
    api.finish_rank(backend)


REPLICAS = {"moe": {"num_experts": 4, "num_experts_per_tok": 2}, "lora": {"lora_rank": 4}}


def replica(out: Path) -> None:
    import torch

    from chipset import api
    from chipset.models.registry import resolve_family
    from chipset.rl.rollout import LocalRollout

    found = {}
    backend = None
    for name, extra in REPLICAS.items():
        cfg = api.config(model={**MODEL, "num_key_value_heads": 2, **extra},
                         train={"steps": 1, "global_batch": 4, "seq_len": 12, "lr": 1e-2})
        backend = backend or api.init(cfg)
        engine = api.parallelize(cfg, backend)
        tokens = torch.randint(0, 128, (4, 13), generator=torch.Generator().manual_seed(0))
        api.step(engine, [(tokens[:, :-1], tokens[:, 1:])], 1e-2)  # moves LoRA's B off its zero start
        ro = LocalRollout(resolve_family("transformer"), cfg, backend.device.torch_device(), backend.kernels)
        ro.load_weights(api.stream_weights(engine, cfg))
        with torch.no_grad():
            engine.model.eval()
            want, got = engine.model(tokens).float(), ro.model(tokens).float()
        found[name] = {"diff": float((got - want).abs().max()), "scale": float(want.abs().max())}
    (out / "replica.json").write_text(json.dumps(found))
    api.finish_rank(backend)


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"sft": sft, "replica": replica}[mode](out) if mode != "double" else double(out, sys.argv[3])
