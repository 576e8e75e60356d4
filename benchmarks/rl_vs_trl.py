"""chipset rl vs TRL's GRPOTrainer: the same task, model, start and settings; reward and seconds per step.

    python benchmarks/rl_vs_trl.py [--steps 100] [--reps 3] [--config examples/rl-sort.toml]
                                   [--workdir runs/rl_vs_trl] [--json OUT] [--set SECTION.KEY=VALUE ...]

Needs ``trl`` (and the transformers, accelerate and datasets it uses); without it the script says
how to install it and exits 2. What it does, all on CPU, one process and one thread per trainer:

1. a brief supervised warm-up on the task's format (docs/rl.md, "A warm start": 30 steps), saved
   and exported with ``chipset export --format hf``: the starting weights of both trainers;
2. per repetition, ``chipset rl CONFIG`` from that export, then TRL's ``GRPOTrainer`` from the same
   export (chipset, TRL, chipset, TRL, ... so that load on a shared host falls on both alike);
   repetition ``i`` samples with seed ``train.seed + i`` in both;
3. prints the mean reward and seconds per step of each trainer per ten steps, and the ratio of
   their step times (TRL / chipset: above 1 means chipset is faster).

The TRL run mirrors the config: the task's prompts in the same order (``chipset.rl.tasks``, no
shuffling) and its reward function; ``rl.group_size`` completions per prompt, ``train.global_batch``
completions per step, ``rl.updates_per_batch`` optimizer updates on each step's rollouts
(``num_iterations``; one TRL optimizer step per update), ``max_new_tokens``, temperature, top-p, the
newline as the stop token, the clip range, KL weight (``beta``), token averaging (TRL's ``dapo``
loss: the mean over every completion token of the step) or sequence averaging (``grpo``), group
scaling of the advantages, AdamW with chipset's betas, epsilon, weight decay, gradient clipping and
constant learning rate, fp32, no gradient checkpointing. What differs: the sampled completions
(each framework's own random streams), TRL's standard deviation of a group is Bessel-corrected
(chipset's: population), and each framework's own kernels and AdamW. A step's time is the wall
time from the end of the previous step to the end of this one: rollouts, rewards, old log-probs
and every update of the step (chipset's ``step_time_s``; for TRL between its callbacks).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_STEPS, SFT_BATCH, SFT_SEQ, SFT_LR, SFT_SEED = 30, 16, 12, 3e-3, 123  # tests/rl/rl_jobs.py's warm-up
WINDOW = 10
NEEDED = ("trl", "transformers", "accelerate", "datasets", "tokenizers")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CHIPSET_BACKEND="cpu")
    env.pop("CHIPSET_SIM_FAULTS", None)
    return env


def _run(cmd: list[str], what: str) -> dict:
    """Run ``cmd``; its wall time and CPU time (user + system, its processes together: on a loaded
    host the CPU time moves much less than the wall time)."""
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{what}: {' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime}


def _config(path: str, overrides: list[str]):
    from chipset.train.config import load_config

    return load_config(path, overrides)


# --- children ---------------------------------------------------------------------------


def sft_child(config: str, overrides: list[str], out: Path) -> None:
    """The warm-up of docs/rl.md through chipset.api, saved as a checkpoint under ``out``."""
    from chipset import api
    from chipset.rl.tasks import PromptSource, sft_batch

    cfg = api.config(config, overrides, train={"steps": SFT_STEPS, "global_batch": SFT_BATCH, "seq_len": SFT_SEQ,
                                               "lr": SFT_LR, "warmup_steps": 0, "lr_schedule": "constant"})
    cfg.model.init_from = ""
    backend = api.init(cfg)
    engine = api.parallelize(cfg, backend)
    source = PromptSource(task=cfg.rl.task, seed=SFT_SEED)  # not the RL runs' prompt stream
    for step in range(SFT_STEPS):
        api.step(engine, [sft_batch(source, step, SFT_BATCH, SFT_SEQ)], api.lr_at(cfg, step))
    ckpt = api.checkpointer(cfg, backend, engine, out)
    ckpt.save(SFT_STEPS)
    ckpt.finish()
    api.finish_rank(backend)


def byte_tokenizer(vocab_size: int, stop_id: int):
    """A Hugging Face tokenizer of chipset's byte vocabulary: token id = ASCII code (ids from 128 on,
    which the model may sample, are placeholders), the stop token as eos, id 0 as padding."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {(chr(i) if i < 128 else f"<{i}>"): i for i in range(vocab_size)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chr(stop_id), pad_token=chr(0))


def unsupported(cfg) -> list[str]:
    """What of chipset's config ``cfg`` this script cannot mirror in TRL (empty: all of it)."""
    rl, tr = cfg.rl, cfg.train
    stops = [int(x) for x in rl.stop_ids.split(",") if x.strip()]
    return [what for bad, what in (
        (rl.advantage != "grpo", f"rl.advantage = {rl.advantage!r} (GRPOTrainer has group-normalised advantages only)"),
        (len(stops) != 1 or stops[0] >= 128, f"rl.stop_ids = {rl.stop_ids!r} (one ASCII stop token here)"),
        (tr.lr_schedule != "constant" or tr.warmup_steps > 0, "a learning-rate schedule (this script maps constant only)"),
        (tr.optimizer != "adamw", f"train.optimizer = {tr.optimizer!r} (this script maps adamw only)"),
        (tr.dtype != "float32", f"train.dtype = {tr.dtype!r} (this script compares fp32)"),
        (not rl.task, "rl.task = \"\" (this script runs a built-in task)"),
        (cfg.parallel.dp * cfg.parallel.tp > 1 or cfg.parallel.micro_batches != 1, "a parallel layout or micro-batches "
         "(this script compares one process)"),
    ) if bad]


def trl_args(cfg, out: Path, seed: int):
    """GRPOConfig mirroring chipset's config ``cfg`` (checked by :func:`unsupported` first)."""
    import trl

    rl, tr = cfg.rl, cfg.train
    u = rl.updates_per_batch
    return trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=tr.global_batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=rl.group_size, num_iterations=u, max_steps=tr.steps * u,
        max_completion_length=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p, top_k=0,
        learning_rate=tr.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=tr.weight_decay,
        adam_beta1=tr.beta1, adam_beta2=tr.beta2, adam_epsilon=tr.eps, max_grad_norm=tr.grad_clip,
        beta=rl.kl_coef, epsilon=rl.clip_eps, loss_type="dapo" if rl.loss_averaging == "token" else "grpo",
        scale_rewards="group" if rl.scale_rewards else "none", shuffle_dataset=False, seed=seed,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, dataloader_num_workers=0,
        save_strategy="no", report_to="none", logging_steps=10**9, disable_tqdm=True, log_completions=False)


def trl_child(config: str, overrides: list[str], hf: Path, out: Path) -> None:
    """One GRPOTrainer run from ``hf``; writes per-step reward and time to ``out``/trl.json."""
    import torch
    import transformers
    import trl
    from datasets import Dataset

    from chipset.rl.tasks import PromptSource

    torch.set_num_threads(1)
    cfg = _config(config, overrides)
    rl, tr = cfg.rl, cfg.train
    args = trl_args(cfg, out / "trainer", tr.seed)
    source = PromptSource(task=rl.task, seed=cfg.data.seed)  # chipset's prompt stream, in its order
    prompts = [source.prompt(i) for i in range(tr.steps * tr.global_batch // rl.group_size)]
    data = Dataset.from_list([{"prompt": p.text, **p.meta} for p in prompts])
    seen: list[float] = []
    lengths: list[float] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        r = source.reward(prompts, completions, **kwargs)
        seen.append(sum(r) / len(r))
        lengths.append(sum(map(len, completion_ids)) / len(completion_ids))  # tokens, the stop token included
        return r

    reward.__name__ = rl.task
    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tok = byte_tokenizer(cfg.model.vocab_size, int(rl.stop_ids.split(",")[0]))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                              processing_class=tok, callbacks=[Clock()])
    trainer.train()
    u = rl.updates_per_batch
    if len(seen) != tr.steps or len(marks) != tr.steps * u + 1:
        raise SystemExit(f"TRL scored {len(seen)} batches in {len(marks) - 1} optimizer steps; expected {tr.steps} "
                         f"batches in {tr.steps * u} steps (one generation per {u} updates)")
    times = [marks[(k + 1) * u] - marks[k * u] for k in range(tr.steps)]
    (out / "trl.json").write_text(json.dumps({"reward_mean": seen, "step_time_s": times, "response_length": lengths,
                                              "trl": trl.__version__, "transformers": transformers.__version__}))


# --- the comparison ----------------------------------------------------------------------


def chipset_run(config: str, overrides: list[str], hf: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "chipset.cli.main", "rl", config, "--run-dir", str(out), "--resume", "none",
           *[a for o in overrides for a in ("--set", o)], "--set", f"model.init_from={hf}",
           "--set", "train.checkpoint_every=0"]
    used = _run(cmd, "chipset rl")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {key: [r[key] for r in recs] for key in ("reward_mean", "step_time_s", "response_length")} | used


def trl_run(config: str, overrides: list[str], hf: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", "trl", "--config", config, "--workdir", str(out), "--hf", str(hf),
           *[a for o in overrides for a in ("--set", o)]]
    used = _run(cmd, "TRL GRPOTrainer")
    return {**json.loads((out / "trl.json").read_text()), **used}


def table(got: dict[str, list[dict]], steps: int) -> str:
    """Per ten steps: mean reward and median seconds per step of each (over all repetitions), and the ratio."""
    def per_window(name, key, agg):
        cols = [[run[key][i] for run in got[name] for i in range(w, min(w + WINDOW, steps))]
                for w in range(0, steps, WINDOW)]
        return [agg(c) for c in cols]

    rows = ["| steps | chipset reward | TRL reward | chipset s/step | TRL s/step | **TRL / chipset** |",
            "|---|---|---|---|---|---|"]
    cr, tr_ = per_window("chipset", "reward_mean", statistics.fmean), per_window("trl", "reward_mean", statistics.fmean)
    cs, ts = (per_window("chipset", "step_time_s", statistics.median),
              per_window("trl", "step_time_s", statistics.median))
    for w in range(len(cr)):
        lo, hi = w * WINDOW + 1, min((w + 1) * WINDOW, steps)
        rows.append(f"| {lo}-{hi} | {cr[w]:.3f} | {tr_[w]:.3f} | {cs[w]:.3f} | {ts[w]:.3f} | **{ts[w] / cs[w]:.2f}** |")
    c_all = statistics.median(t for run in got["chipset"] for t in run["step_time_s"])
    t_all = statistics.median(t for run in got["trl"] for t in run["step_time_s"])
    rows.append(f"| all | {statistics.fmean(r for run in got['chipset'] for r in run['reward_mean']):.3f} | "
                f"{statistics.fmean(r for run in got['trl'] for r in run['reward_mean']):.3f} | {c_all:.3f} | "
                f"{t_all:.3f} | **{t_all / c_all:.2f}** |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="GRPO steps per run (train.steps)")
    p.add_argument("--reps", type=int, default=3, help="runs per trainer, interleaved, seeds train.seed + i")
    p.add_argument("--config", default=str(ROOT / "examples" / "rl-sort.toml"), help="chipset rl config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a key of the config, for both trainers")
    p.add_argument("--workdir", type=Path, default=Path("runs/rl_vs_trl"), help="run folders (replaced)")
    p.add_argument("--json", type=Path, default=None, help="write every run's per-step records here")
    p.add_argument("--child", choices=("sft", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child == "sft":
        sft_child(ns.config, ns.overrides, ns.workdir)
        return 0
    if ns.child == "trl":
        trl_child(ns.config, ns.overrides, ns.hf, ns.workdir)
        return 0
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"rl_vs_trl: {', '.join(missing)} not installed; this benchmark runs TRL's GRPOTrainer beside "
              "chipset rl. Install it with `pip install trl` (it brings transformers, accelerate, datasets), or "
              "without touching your environment's torch: `pip install --target DIR --no-deps trl` and put DIR "
              "on PYTHONPATH", file=sys.stderr)
        return 2
    if ns.steps < 1 or ns.reps < 1:
        print(f"--steps ({ns.steps}) and --reps ({ns.reps}) must be >= 1", file=sys.stderr)
        return 2
    overrides = [*ns.overrides, f"train.steps={ns.steps}"]
    cfg = _config(ns.config, overrides)
    if unsupported(cfg):
        print(f"rl_vs_trl: cannot mirror in TRL: {'; '.join(unsupported(cfg))}", file=sys.stderr)
        return 2
    work = ns.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    sft, hf = work / "sft", work / "sft-hf"
    _run([sys.executable, __file__, "--child", "sft", "--config", ns.config, "--workdir", str(sft),
          *[a for o in ns.overrides if o.startswith(("model.", "rl.task")) for a in ("--set", o)]], "warm-up")
    _run([sys.executable, "-m", "chipset.cli.main", "export", str(sft), "--out", str(hf), "--format", "hf"], "export")
    got: dict[str, list[dict]] = {"chipset": [], "trl": []}
    for rep in range(ns.reps):
        ov = [*overrides, f"train.seed={cfg.train.seed + rep}"]
        got["chipset"].append(chipset_run(ns.config, ov, hf, work / f"chipset-{rep + 1}"))
        got["trl"].append(trl_run(ns.config, ov, hf, work / f"trl-{rep + 1}"))
        c, t = got["chipset"][-1], got["trl"][-1]
        print(f"run {rep + 1}: median s/step chipset {statistics.median(c['step_time_s']):.3f}, TRL "
              f"{statistics.median(t['step_time_s']):.3f} (TRL / chipset {statistics.median(t['step_time_s']) / statistics.median(c['step_time_s']):.2f}); "
              f"whole process (start, load, run) chipset {c['wall_s']:.0f} s wall / {c['cpu_s']:.0f} s CPU, "
              f"TRL {t['wall_s']:.0f} s wall / {t['cpu_s']:.0f} s CPU", flush=True)
    rl, tr = cfg.rl, cfg.train
    print(f"{rl.task}: {tr.global_batch // rl.group_size} prompts x G={rl.group_size} per step, "
          f"{rl.updates_per_batch} updates per step, lr {tr.lr}, {ns.steps} steps, {ns.reps} run(s) each; "
          f"TRL {got['trl'][0]['trl']}, transformers {got['trl'][0]['transformers']}")
    print(table(got, ns.steps))
    print("mean completion length (tokens, the stop token included): " + ", ".join(
        f"{name} {statistics.fmean(x for run in runs for x in run['response_length']):.2f}" for name, runs in got.items()))
    if ns.json:
        ns.json.write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
