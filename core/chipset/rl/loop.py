"""What ``chipset rl`` runs on each rank: rollouts, rewards, advantages, GRPO updates, metrics.

One step (``train.steps`` of them): the policy's weights stream into the rollout engine; this
rank samples ``rl.group_size`` completions for each of its prompts (``train.global_batch /
group_size`` prompts per step, split over dp; every tp rank of a dp index samples the same);
the rewards score them; advantages are formed per group; the sampling policy's (and the
reference's) log-probabilities are taken by a forward-only pass; then ``rl.updates_per_batch``
optimizer updates minimise the GRPO loss through the engine (dp, ZeRO 0-3, tp, ep; not pp or cp). Rank 0
writes metrics.jsonl and summary.json; checkpoints and resume are those of ``chipset train``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chipset.errors import ConfigError
from chipset.models.registry import resolve_family
from chipset.rl.grpo import STD_EPS, GRPOBatch, group_advantages, grpo_token_loss
from chipset.rl.logprobs import forward_logprobs, per_token_loss
from chipset.rl.rewards import RewardError, resolve_rewards, score
from chipset.rl.rollout import LocalRollout, SamplingParams, stream_weights
from chipset.rl.tasks import decode, encode, prompt_source
from chipset.train.config import RunConfig
from chipset.train.loop import build_model, lr_at, make_dims, train_step, wrap
from chipset.train.progress import Progress, fmt_duration
from chipset.train.rundir import atomic_write_text, finite_json, read_run_id, strict_dumps

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["RLResult", "check", "run", "rollout_seed"]


@dataclass
class RLResult:
    """What one rank saw: per-step records (the same on every rank) and the final summary."""

    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def check(cfg: RunConfig, world_size: int) -> None:
    """The [rl] rules tied to the layout and the model; ConfigError listing every problem."""
    par, tr, rl = cfg.parallel, cfg.train, cfg.rl
    problems = []
    for key, degree, what in (("pp", par.pp, "pipeline"), ("cp", par.cp, "context")):
        if degree > 1:
            problems.append(f"parallel.{key} = {degree}: chipset rl runs dp, ZeRO 0-3, tp (with or without sequence "
                            f"parallelism) and ep layouts, not {what} parallelism; set parallel.{key} = 1")
    if cfg.islands.count > 1:
        problems.append(f"islands.count = {cfg.islands.count}: chipset rl runs one job-wide layout, not islands; "
                        "set islands.count = 1")
    if tr.global_batch % rl.group_size:
        problems.append(f"train.global_batch ({tr.global_batch}) counts completions per step and must be a "
                        f"multiple of rl.group_size ({rl.group_size})")
    else:
        prompts = tr.global_batch // rl.group_size
        dp = make_dims(cfg, world_size).dp
        if prompts % dp:
            problems.append(f"train.global_batch / rl.group_size = {prompts} prompts per step must be divisible "
                            f"by dp ({dp}): each rank holds whole groups")
        elif (prompts // dp * rl.group_size) % par.micro_batches:
            problems.append(f"each rank's {prompts // dp * rl.group_size} completions must split into "
                            f"parallel.micro_batches ({par.micro_batches}) equal micro-batches")
    family = resolve_family(cfg.model.family)
    if family.throughput(cfg)[0] != "tokens":
        problems.append(f"model.family = {cfg.model.family!r} reads its own data, not token sequences "
                        "(its throughput() counts samples, not tokens): chipset rl post-trains decoders (token ids in, next-token logits out: transformer, gpt2, "
                        "a Hugging Face decoder or your own decoder family)")
    if rl.task and cfg.model.vocab_size < 128:
        problems.append(f"model.vocab_size = {cfg.model.vocab_size}: the built-in tasks use a byte vocabulary "
                        "(ASCII); set model.vocab_size >= 128 (256 for any byte)")
    if problems:
        raise ConfigError("; ".join(problems))


def rollout_seed(seed: int, step: int, prompt: int) -> int:
    """The sampling seed of global prompt ``prompt`` at ``step``: the same on every layout."""
    return (seed * 1_000_003 + step) * 1_000_033 + prompt


def _reference(cfg, backend: Backend, dims, family):
    """The frozen reference policy: the starting weights, under the same layout, no optimizer state."""
    bound = build_model(cfg, backend, dims, family)
    for p in bound.module.parameters():
        p.requires_grad_(False)
    return wrap(bound, cfg, backend, dims)


def _pad(rows: list[torch.Tensor], device, multiple: int = 1) -> torch.Tensor:
    """Right-padded with 0 to a length that is a multiple of ``multiple`` (sequence parallelism
    splits the sequence over tp); the padding is outside every completion mask."""
    n = -(-max(r.numel() for r in rows) // multiple) * multiple
    out = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out.to(device)


def _all_or_none(col, ok: bool, error: Exception | None) -> None:
    """Every rank raises when any rank's rewards failed (no rank waits at a collective alone)."""
    flag = torch.tensor([0.0 if ok else 1.0])
    if col.world_size() > 1:
        col.all_reduce(flag, "sum")
    if float(flag) > 0:
        raise error if error is not None else RewardError("a reward function failed on another rank (its message "
                                                          "is in that rank's output)")


def run(cfg: RunConfig, backend: Backend, run_dir: str | Path | None = None, *, out=None, resume: str = "none",
        rollout=None) -> RLResult:
    """Run ``cfg``'s RL job on this rank (process group up, device set). ``rollout``: a
    :class:`chipset.rl.rollout.RolloutEngine` to sample with instead of the in-process one."""
    out = out or sys.stdout
    col = backend.collective
    rank, world = col.rank(), col.world_size()
    check(cfg, world)
    tr, rl = cfg.train, cfg.rl
    dims = make_dims(cfg, world)
    family = resolve_family(cfg.model.family)
    engine = wrap(build_model(cfg, backend, dims, family), cfg, backend, dims)
    ref = _reference(cfg, backend, dims, family) if rl.kl_coef > 0 else None
    source = prompt_source(rl, cfg.data.seed)
    rewards = resolve_rewards(rl.rewards, source.reward, rl.task or "reward")
    rollout = rollout if rollout is not None else LocalRollout(family, cfg, engine.device, backend.kernels)
    params = SamplingParams(rl.max_new_tokens, rl.temperature, rl.top_p,
                            tuple(int(x) for x in rl.stop_ids.split(",") if x.strip()))
    run_dir = Path(run_dir) if run_dir is not None else None
    ckpt = None
    if run_dir is not None and (tr.checkpoint_every or resume != "none"
                                or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")):
        from chipset.train.checkpoint import Checkpointer

        ckpt = Checkpointer(cfg, backend, engine, run_dir, out=out)
    start = ckpt.resume(resume) if ckpt is not None else 0
    metrics_file = sinks = None
    if run_dir is not None and rank == 0:
        from chipset.train.sinks import open_sinks

        run_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(run_dir / "metrics.jsonl", "a" if start else "w")
        sinks = open_sinks(cfg, run_dir)
    progress = Progress(cfg, out, start_step=start, enabled=rank == 0)
    progress.line(f"chipset rl: backend {backend.name}, world {world}, layout "
                  + " ".join(f"{k}={v}" for k, v in dims.layout().items())
                  + f", task {rl.task or rl.prompts}, rewards {', '.join(r.name for r in rewards)}, "
                  f"G={rl.group_size}, advantage {rl.advantage}")
    res = RLResult()
    prompts_per_step = tr.global_batch // rl.group_size
    dp_rank = dims.coords(rank)["dp"]
    mine = prompts_per_step // dims.dp
    t_start = time.perf_counter()
    try:
        for step in range(start, tr.steps):
            col.notify_step(step)
            t0 = time.perf_counter()
            rollout.load_weights(stream_weights(engine, cfg))
            rec = _step(cfg, engine, ref, rollout, params, source, rewards, step,
                        range(dp_rank * mine + step * prompts_per_step, (dp_rank + 1) * mine + step * prompts_per_step))
            backend.device.synchronize()
            rec["step_time_s"] = time.perf_counter() - t0
            res.metrics.append(rec)
            if metrics_file is not None:
                metrics_file.write(strict_dumps(rec) + "\n")
                metrics_file.flush()
                sinks.log(rec["step"], rec)
            if ckpt is not None and ckpt.due(step + 1):
                ckpt.save(step + 1)
            if (step + 1) % tr.log_every == 0 or step + 1 == tr.steps:
                left = (time.perf_counter() - t_start) / (step + 1 - start) * (tr.steps - step - 1)
                progress.line(f"step {step + 1:>4}/{tr.steps}  reward {rec['reward_mean']:.3f} "
                              f"(+/- {rec['reward_std']:.3f})  loss {rec['loss']:8.4f}  kl {rec['kl']:.4f}  "
                              f"entropy {rec['entropy']:.3f}  clip {rec['clip_frac']:.3f}  "
                              f"len {rec['response_length']:.1f}  eta {fmt_duration(left)}")
        if ckpt is not None:
            ckpt.finish()
    finally:
        progress.close()
        if metrics_file is not None:
            metrics_file.close()
            sinks.close()
    digest = engine.params_digest()
    res.summary = {"steps": tr.steps, "world_size": world, "layout": dims.layout(), "backend": backend.name,
                   "final_reward": res.metrics[-1]["reward_mean"] if res.metrics else None,
                   "first_reward": res.metrics[0]["reward_mean"] if res.metrics else None,
                   "params_digest": digest, **(ckpt.summary() if ckpt is not None else {})}
    if rank == 0 and run_dir is not None:
        res.summary["run_id"] = read_run_id(run_dir)
        atomic_write_text(run_dir / "summary.json", json.dumps(finite_json(res.summary), indent=2) + "\n")
    return res


def _step(cfg, engine, ref, rollout, params, source, rewards, step: int, prompt_ids: range) -> dict:
    rl, tr = cfg.rl, cfg.train
    col, dev, G = engine.collective, engine.device, rl.group_size
    # 1. rollouts and rewards
    prompts = [source.prompt(i) for i in prompt_ids]
    rows, masks, texts, completions = [], [], [], []
    encoded = [torch.tensor(encode(p.text), dtype=torch.long) for p in prompts]
    drawn = rollout.generate(encoded, G, params, [rollout_seed(tr.seed, step, i) for i in prompt_ids])
    for ids, p, (toks, mask) in zip(encoded, prompts, drawn, strict=True):
        toks, mask = toks.cpu(), mask.cpu()
        for g in range(G):
            n = int(mask[g].sum())
            rows.append(torch.cat([ids, toks[g, :n]]))
            masks.append((ids.numel(), n))
            texts.append(p.text)
            completions.append(decode(toks[g, :n].tolist()))
    meta = {k: [p.meta[k] for p in prompts for _ in range(G)] for k in (prompts[0].meta if prompts else {})}
    error = None
    try:
        total, each = score(rewards, texts, completions, meta)
    except RewardError as exc:
        error, total, each = exc, [], {}
    _all_or_none(col, error is None, error)
    r = torch.tensor(total, dtype=torch.float64).view(-1, G)  # sums of float64 rewards: exact on any layout
    adv = group_advantages(r, rl.advantage, rl.scale_rewards).view(-1)
    # 2. global sums over dp (one all-reduce): rewards, per-reward, lengths, tokens, advantage moments
    lens = torch.tensor([n for _, n in masks], dtype=torch.float64)
    names = [x.name for x in rewards]
    sums = [r.sum(), (r ** 2).sum(), float(r.numel()), lens.sum(), adv.double().sum(),
            (adv.double() ** 2).sum()]
    for n in names:
        v = torch.tensor(each[n], dtype=torch.float64)
        sums += [v.sum(), (v ** 2).sum()]
    g = torch.tensor([float(x) for x in sums], dtype=torch.float64, device=dev)
    if engine.dp > 1:
        col.all_reduce(g, "sum", group=engine.group)
    g = g.cpu().tolist()
    count, n_tok = g[2], g[3]
    if rl.advantage == "reinforce++":  # normalised over the whole batch
        mean = g[4] / count
        std = math.sqrt(max(g[5] / count - mean * mean, 0.0))
        adv = (adv - mean) / (std + STD_EPS)
    # 3. micro-batches: prompt + completion, right-padded; old (and reference) log-probs
    mb = engine.micro_batches
    per = len(rows) // mb
    multiple = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    scale = mb * engine.dp
    batches, ent_sum = [], 0.0
    for m in range(mb):
        sl = slice(m * per, (m + 1) * per)
        tokens = _pad(rows[sl], dev, multiple)
        s = tokens.shape[1] - 1
        mask = torch.zeros(per, s, device=dev)
        weights = torch.zeros(per, s, device=dev)
        for j, (plen, n) in enumerate(masks[sl]):
            mask[j, plen - 1:plen - 1 + n] = 1.0
            w = 1.0 / n_tok if rl.loss_averaging == "token" else 1.0 / (max(n, 1) * count)
            weights[j] = w * scale
        a = adv[sl].to(dev)[:, None].expand(per, s)
        old, ent = forward_logprobs(engine, tokens, with_entropy=True)
        ent_sum += float((ent * mask).sum())
        refl = forward_logprobs(ref, tokens) if ref is not None else None
        batches.append((tokens, GRPOBatch(mask, a, old, refl, weights)))
    # 4. updates
    lr = lr_at(cfg, step)
    for _ in range(rl.updates_per_batch):
        acc: dict = {}

        def fn(lp, b, acc=acc):
            return grpo_token_loss(lp, b, clip_eps=rl.clip_eps, kl_coef=rl.kl_coef, stats=acc)

        with per_token_loss(engine, fn):
            loss, stats = train_step(engine, batches, lr)
    st = torch.tensor([acc.get("kl", 0.0) / scale, acc.get("clip_frac", 0.0) / scale, ent_sum],
                      dtype=torch.float64, device=dev)
    if engine.dp > 1:
        col.all_reduce(st, "sum", group=engine.group)
    kl, clip, ent = st.cpu().tolist()
    mean = g[0] / count
    rec = {"step": step + 1, "loss": loss, "reward_mean": mean,
           "reward_std": math.sqrt(max(g[1] / count - mean * mean, 0.0)),
           "kl": kl, "entropy": ent / max(n_tok, 1.0), "clip_frac": clip, "response_length": n_tok / count,
           "grad_norm": stats["grad_norm"], "lr": lr, "skipped": stats["skipped"]}
    for k, n in enumerate(names):
        mu = g[6 + 2 * k] / count
        rec[f"reward/{n}_mean"] = mu
        rec[f"reward/{n}_std"] = math.sqrt(max(g[7 + 2 * k] / count - mu * mu, 0.0))
    return rec
