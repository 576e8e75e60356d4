"""chipset rl (docs/rl.md): sampling with a KV cache, advantages and the GRPO loss, checked rewards,
the warm-up batches, the rollout replica of MoE and LoRA policies, refused layouts, and whole
runs: GRPO raises a warmed-up model's sort reward from below 0.3 to above 0.7, dp=2 ZeRO-3 and
tp=2 equal one process, a killed rank restarts and the reward curve continues bit for bit, a bad
reward is exit 2, an external rollout engine (a test double) gets the weights after each update."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
import testenv
from parity import EPS32, assert_grad_norms_close, model_depth, reduction_rtol, trajectory_rtol

HERE = Path(__file__).resolve().parent
JOBS = HERE / "rl_jobs.py"
MODEL = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "max_position_embeddings": 32}


# --- pieces -------------------------------------------------------------------------------------

def _models():
    from chipset.kernels import KernelRegistry
    from chipset.models.config import ModelConfig
    from chipset.models.gpt2 import GPT2
    from chipset.models.transformer import Transformer

    cfg = ModelConfig(**{**MODEL, "num_key_value_heads": 2})
    return {"transformer": Transformer(cfg, KernelRegistry("reference"), seed=1),
            "gpt2": GPT2(128, 64, 2, 4, 128, 32)}


@pytest.mark.parametrize("name", ["transformer", "gpt2"])
def test_kv_cache_logits_equal_the_full_forward(name):
    from chipset.models.sampling import KVCache, decoder_step

    torch.manual_seed(0)
    model = _models()[name].eval()
    step, layers = decoder_step(model)
    tokens = torch.randint(0, 128, (3, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(layers)
        parts = [step(model, tokens[:, :5], cache)]  # prefill, then one token at a time
        parts += [step(model, tokens[:, t:t + 1], cache) for t in range(5, 12)]
    cached = torch.cat(parts, dim=1)
    # Same sums in another order (attention over a cache, not a masked square): fp32 rounding
    # of reductions of <= 128 terms through the model's depth, relative to the logits' scale.
    tol = reduction_rtol(128, model_depth(2)) * float(full.abs().max())
    assert float((cached - full).abs().max()) <= tol


def test_sampling_is_seeded_per_group_and_stops():
    from chipset.models.sampling import filter_top_p, sample

    model = _models()["transformer"].eval()
    prompt = torch.tensor([[51, 43, 52, 61]])

    def draw(rows, seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return sample(model, prompt.expand(rows, -1), max_new_tokens=6, temperature=1.0, stop_ids=(10, 7),
                      generator=gens, vocab_size=128)

    alone, _ = draw(4, [5])
    together, mask = draw(8, [9, 5])  # the group seeded 5 samples alike next to another group
    assert torch.equal(together[4:], alone)
    assert not torch.equal(together[:4], alone)
    for row, m in zip(together, mask, strict=True):  # the mask ends at the first stop id, included
        n = int(m.sum())
        assert all(int(t) not in (10, 7) for t in row[:n - 1]) and (n == 6 or int(row[n - 1]) in (10, 7))
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(filter_top_p(p, 0.8), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    assert torch.equal(filter_top_p(p, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0.0]]))


def test_advantages_follow_their_formulas():
    from chipset.rl.grpo import STD_EPS, group_advantages

    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    grpo = group_advantages(r, "grpo")
    assert torch.allclose(grpo[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + STD_EPS))
    assert torch.equal(grpo[1], torch.zeros(4))  # equal rewards teach nothing
    rloo = group_advantages(r, "rloo")  # r_i - mean of the others
    assert torch.allclose(rloo[0], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    assert torch.allclose(group_advantages(r, "grpo", scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_grpo_loss_gradient_and_clipping():
    from chipset.rl.grpo import GRPOBatch, grpo_token_loss

    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not a completion token
    w = torch.full((1, 3), 0.5)
    lp = old.clone().requires_grad_(True)
    stats: dict = {}
    loss = grpo_token_loss(lp, GRPOBatch(mask, adv, old, None, w), clip_eps=0.2, kl_coef=0.0, stats=stats)
    loss.backward()
    assert torch.allclose(lp.grad, -adv * w * mask)  # at ratio 1: d/dlogp = -A w on completion tokens
    assert stats["clip_frac"] == 0.0
    lp2 = (old + torch.tensor([[0.5, 0.0, 0.0]])).requires_grad_(True)  # ratio e^0.5 > 1.2, A > 0: clipped
    stats = {}
    grpo_token_loss(lp2, GRPOBatch(mask, adv, old, None, w), clip_eps=0.2, kl_coef=0.0, stats=stats).backward()
    assert lp2.grad[0, 0] == 0.0 and lp2.grad[0, 1] != 0.0
    assert stats["clip_frac"] == pytest.approx(0.5)
    ref = old - 0.3  # k3 KL: exp(ref - lp) - (ref - lp) - 1 >= 0, and its gradient pulls towards ref
    lp3 = old.clone().requires_grad_(True)
    kl_loss = grpo_token_loss(lp3, GRPOBatch(mask, torch.zeros(1, 3), old, ref, w), clip_eps=0.2, kl_coef=1.0)
    kl_loss.backward()
    d = -0.3
    assert float(kl_loss.detach()) == pytest.approx(2 * 0.5 * (math_exp(d) - d - 1), rel=1e-6)
    assert float(lp3.grad[0, 0]) > 0  # lowering logp lowers the KL: the gradient is positive


def math_exp(x: float) -> float:
    import math

    return math.exp(x)


def test_reward_failures_name_the_function():
    from chipset.rl.rewards import Reward, RewardError, score

    def boom(p, c, **_):
        raise KeyError("answer")

    cases = {"raises": boom, "short": lambda p, c, **_: [1.0], "nan": lambda p, c, **_: [float("nan")] * len(c),
             "text": lambda p, c, **_: "1"}
    for name, fn in cases.items():
        with pytest.raises(RewardError, match=f"reward {name} "):
            score([Reward(name, fn)], ["a", "b"], ["x", "y"], {})
    total, each = score([Reward("one", lambda p, c, **_: [1.0, 0.0], 0.5),
                         Reward("two", lambda p, c, answer, **_: [float(x == a) for x, a in zip(c, answer, strict=True)], 2.0)],
                        ["a", "b"], ["x", "y"], {"answer": ["x", "z"]})
    assert total == [2.5, 0.0] and each["two"] == [1.0, 0.0]


def test_what_chipset_rl_does_not_run_is_refused_naming_the_key():
    from chipset.errors import ConfigError
    from chipset.rl.loop import check
    from chipset.train.config import load_config

    cases = {"parallel.pp=2": "parallel.pp = 2: chipset rl runs dp, ZeRO 0-3, tp",
             "parallel.cp=2": "not context parallelism; set parallel.cp = 1",
             "islands.count=2": "islands.count = 2: chipset rl runs one job-wide layout",
             'model.family="resnet"': "model.family = 'resnet' reads its own data, not token sequences",
             "train.global_batch=12": "must be a multiple of rl.group_size (8)"}
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            check(load_config(None, ["rl.group_size=8", "train.global_batch=16", override]), 2)
    for ok in ("parallel.tp=2", "parallel.zero=3", "model.num_experts=4"):  # accepted (runs: docs/rl.md)
        check(load_config(None, ["rl.group_size=8", "train.global_batch=16", ok]), 2)


def test_chipset_rl_refuses_a_pipeline_layout_with_exit_2_before_launch(tmp_path):
    p = _rl(tmp_path / "run", ["parallel.pp=2"], nproc=2)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "parallel.pp = 2: chipset rl runs dp, ZeRO 0-3, tp" in p.stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_warm_up_batches_teach_completions_the_task_rewards_fully():
    """sft_batch's targets, decoded, are completions its task's reward scores 1 (target_sum's
    ``answer`` is the target, so its batches use ``demo``: with the answer they would score 0)."""
    from chipset.rl.tasks import TASKS, PromptSource, decode, sft_batch

    for task, (_, reward) in TASKS.items():
        source = PromptSource(task=task, seed=5)
        _, y = sft_batch(source, 0, 32, 12)
        prompts = [source.prompt(j) for j in range(32)]
        completions = [decode([int(t) for t in row if t >= 0]) for row in y]
        meta = {k: [p.meta[k] for p in prompts] for k in prompts[0].meta}
        assert reward([p.text for p in prompts], completions, **meta) == [1.0] * 32, task


# --- whole runs ------------------------------------------------------------------------------------

def _env():
    e = testenv.clean_env(keep_settings=True)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = ":".join([str(HERE), *([e["PYTHONPATH"]] if e.get("PYTHONPATH") else [])])
    return e


def _rl(run_dir, sets, nproc=1, timeout=600, args=(), env_extra=None):
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "rl", "--nproc", str(nproc), "--run-dir",
                           str(run_dir), *args, *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env={**_env(), **(env_extra or {})}, timeout=timeout)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A model briefly (30 steps) supervised on the sort task's format, exported (tests/rl/rl_jobs.py sft)."""
    out = tmp_path_factory.mktemp("rl")
    p = forked_cli.run([sys.executable, str(JOBS), "sft", str(out)], capture_output=True, text=True, env=_env(),
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def _sets(warm, **extra):
    base = {f"model.{k}": v for k, v in MODEL.items()}
    base.update({"model.init_from": str(warm / "hf"), "train.lr": 1e-3, "train.global_batch": 128,
                 "rl.task": "sort", "rl.group_size": 8, "rl.max_new_tokens": 4, "rl.updates_per_batch": 2,
                 "train.checkpoint_every": 0})
    base.update(extra)
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in base.items()]


def _window(rewards: list[float], part: slice) -> float:
    w = rewards[part]
    return sum(w) / len(w)


def test_grpo_raises_the_reward_of_a_warmed_up_model(warm, tmp_path):
    """The acceptance of docs/rl.md, "What the test shows": from the 30-step warm-up, 100 GRPO steps
    of examples/rl-sort.toml (16 prompts x 8 completions, two updates each, lr 1e-3) raise the mean
    reward of the first ten steps, below 0.3, to above 0.7 over the last ten (0.21 -> 0.86 with this
    seed; 0.10-0.20 -> 0.87-0.91 with four other seeds of the warm-up and the run). A ten-step
    window averages 1280 completions (reward std <= 0.5): its standard error is below 0.02, and
    every seed tried cleared both thresholds by more than 0.09 (over 4 standard errors). With the advantages' sign flipped
    the reward falls instead (checked by hand)."""
    p = _rl(tmp_path / "run", _sets(warm, **{"train.steps": 100}))
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _metrics(tmp_path / "run")
    r = [m["reward_mean"] for m in recs]
    assert [m["step"] for m in recs] == list(range(1, 101))
    first, last = _window(r, slice(0, 10)), _window(r, slice(-10, None))
    assert first < 0.3, (first, last)
    assert last > 0.7, (first, last)
    for key in ("reward_std", "reward/sort_mean", "kl", "entropy", "clip_frac", "response_length", "loss"):
        assert key in recs[-1]
    from chipset.report import RL_PLOTS, write_report

    page = write_report(tmp_path / "run", png=False)[0].read_text()  # the curve in chipset report
    for pid in RL_PLOTS:
        figure = page.split(f'id="{pid}"', 1)[1].split("</figure>", 1)[0]
        assert "<polyline" in figure and "no data" not in figure, pid
    assert f"{r[0]:.4f} -&gt; {r[-1]:.4f}" in page


PARITY_STEPS = 4


def _parity_sets(warm):
    """Four steps of 32 completions, two updates each, KL to the reference on."""
    return _sets(warm, **{"train.steps": PARITY_STEPS, "train.global_batch": 32, "rl.kl_coef": 0.05})


@pytest.fixture(scope="module")
def zero3(warm, tmp_path_factory):
    """An uninterrupted dp=2 ZeRO-3 run: the parity test's and the restart test's reference."""
    import multirank

    multirank.require(2)
    run = tmp_path_factory.mktemp("zero3") / "run"
    p = _rl(run, [*_parity_sets(warm), "parallel.zero=3"], nproc=2)
    assert p.returncode == 0, p.stdout + p.stderr
    return run


@pytest.mark.multirank
def test_dp2_zero3_and_tp2_match_one_process(warm, zero3, tmp_path):
    """Four steps (two updates each, KL to the reference on) of one process, of dp=2 ZeRO-3 and of
    tp=2: the same rewards, losses, KL and gradient norms (tests/parity.py's bounds). A gradient
    counted twice (the tp logits gathered with a summing backward, or the loss's dp factor
    dropped) fails the gradient-norm check by a factor of 2."""
    sets = _parity_sets(warm)
    runs = {"one": _rl(tmp_path / "one", sets),
            "tp2": _rl(tmp_path / "tp2", [*sets, "parallel.tp=2"], nproc=2)}
    for name, p in runs.items():
        assert p.returncode == 0, name + p.stdout + p.stderr
    a = _metrics(tmp_path / "one")
    n = max(32 * 16, MODEL["vocab_size"], MODEL["intermediate_size"])
    depth = model_depth(2)
    eps64 = torch.finfo(torch.float64).eps
    for name, run, layout in (("zero3", zero3, {"dp": 2, "zero": 3}), ("tp2", tmp_path / "tp2", {"tp": 2})):
        b = _metrics(run)
        # Rollouts are seeded per prompt group, so both sample the same completions: equal rewards
        # and lengths, up to the order of a float64 sum of 32 terms (partial sums, then the all-reduce).
        for x, y in zip(a, b, strict=True):
            for key in ("reward_mean", "reward_std", "response_length"):
                assert abs(x[key] - y[key]) <= 32 * eps64 * max(abs(x[key]), 1.0), (name, key, x[key], y[key])
        assert_grad_norms_close([m["grad_norm"] for m in b], [m["grad_norm"] for m in a], n=n, depth=depth)
        # The GRPO loss is a sum of +-A terms near zero: compared on the scale of its terms (|A| ~ 1).
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            tol = trajectory_rtol(n, depth, step)
            assert abs(x["loss"] - y["loss"]) <= tol, (name, step, x["loss"], y["loss"])
            assert abs(x["kl"] - y["kl"]) <= tol * max(abs(x["kl"]), 1.0) + EPS32, (name, step, x["kl"], y["kl"])
        got = json.loads((run / "summary.json").read_text())["layout"]
        assert {k: got[k] for k in layout} == layout


@pytest.mark.multirank
def test_a_killed_rank_restarts_and_the_reward_curve_continues(warm, zero3, tmp_path):
    """The ZeRO-3 run again, checkpointing every 2 steps, with rank 1 killed as it starts step 4
    (cpu_sim's kill fault) and ``--max-restarts 1``: torchrun restarts both ranks, they resume from
    step 2, replay step 3 (its first record is dropped) and finish. Rollouts are seeded by (seed,
    step, prompt) and the checkpoint holds weights and optimizer state, so the curve continues
    exactly: every record and the final weights equal the uninterrupted run's, bit for bit."""
    run = tmp_path / "run"
    p = _rl(run, [*_parity_sets(warm), "parallel.zero=3", "train.checkpoint_every=2"], nproc=2,
            args=("--max-restarts", "1"),
            env_extra={"CHIPSET_SIM_FAULTS": "kill:rank=1,step=3", "CHIPSET_SIM_FAULT_DIR": str(tmp_path / "faults")})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fault injected (kill:rank=1,step=3)" in p.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1
    assert summary["resumed_step"] == 2 and summary["resumed_from"].endswith("step-00000002")
    ref = json.loads((zero3 / "summary.json").read_text())
    assert summary["params_digest"] == ref["params_digest"]
    got, want = _metrics(run), _metrics(zero3)
    assert [m["step"] for m in got] == list(range(1, PARITY_STEPS + 1))  # step 3 once, step 4 there
    timing = ("step_time_s",)
    assert [{k: v for k, v in m.items() if k not in timing} for m in got] == \
        [{k: v for k, v in m.items() if k not in timing} for m in want]


def test_a_bad_reward_is_exit_2_naming_it(warm, tmp_path):
    (tmp_path / "my_rewards.py").write_text("def wrong(prompts, completions, **kw):\n    return [0.0]\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    p = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "rl", "--run-dir", str(tmp_path / "run"),
                        *[a for s in _sets(warm, **{"train.steps": 2, "train.global_batch": 16,
                                                    "rl.rewards": "my_rewards:wrong",
                                                    "train.checkpoint_every": 1}) for a in ("--set", s)]],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "reward my_rewards:wrong returned 1 values for 16 completions" in p.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any update
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_the_rollout_replica_of_an_moe_or_lora_policy_computes_the_policy(tmp_path):
    """The in-process rollout engine samples from a replica filled by the weight stream (HF names,
    each expert of a stacked MoE tensor by its own name, LoRA adapters by theirs): after a
    training step its logits are the engine's, up to fp32 rounding of the model's reductions
    (<= 128 terms, depth 2) relative to the logits' scale. The replica without its LoRA
    adapters, or with two experts swapped, misses this by orders of magnitude (checked by hand)."""
    p = forked_cli.run([sys.executable, str(JOBS), "replica", str(tmp_path)], capture_output=True, text=True,
                       env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    found = json.loads((tmp_path / "replica.json").read_text())
    for name, r in found.items():
        assert r["diff"] <= reduction_rtol(128, model_depth(2)) * r["scale"], (name, r)


def test_an_external_rollout_engine_gets_hf_weights_after_each_update(warm, tmp_path):
    p = forked_cli.run([sys.executable, str(JOBS), "double", str(tmp_path), str(warm / "hf")],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    loads = json.loads((tmp_path / "double.json").read_text())["loads"]
    assert len(loads) == 2  # before each step's rollouts: the starting weights, then the updated ones
    hf = json.loads((warm / "hf" / "config.json").read_text())
    assert loads[0]["model.embed_tokens.weight"][0] == [hf["vocab_size"], hf["hidden_size"]]
    assert "lm_head.weight" in loads[0] and all(k.startswith(("model.", "lm_head")) for k in loads[0])
    moved = [k for k in loads[0] if loads[0][k][1] != loads[1][k][1]]
    assert moved, "the second load carried the same weights: the update was not streamed"
