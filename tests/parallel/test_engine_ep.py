"""Expert parallelism (MoE): the router's rules by hand, and ep runs equal one process.

Unit tests check top-k, gate normalisation, capacity dropping order and the
load-balancing loss against hand computations, and the layer (output and every gradient,
on cpu_sim with the reference loops, on cpu with its fused grouped_mlp kernel) against a
per-token loop.
The parity tests run two torchrun jobs (ep2 on 2 ranks; ep2 x edp2 and ep4 on 4 ranks)
and one single-process job with the same seed and global batch (tests/multirank.py).
Tolerances are derived in tests/parity.py, so they hold on any CPU: fp32 per-step losses
and clipped gradient norms within ``trajectory_rtol`` on every step where the reference's
routing margin makes a top-k flip impossible (``unflippable_steps``; step 0 must be one,
asserted), final parameters (logical full tensors by their single-process names) within
AdamW's worst case. A negative control (expert gradients not reduced over the
expert-data-parallel group) must fail the same checks. Capacity dropping is active in the
softmax variants (asserted: the sharded runs drop exactly as many assignments as the
single process on the first batch). This file is also the jobs' script.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
import multirank
import parity
from multirank import merge as _merge

HERE = Path(__file__).resolve()
STEPS = 10
BASE = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
              "capacity_factor": 1.0, "router_aux_loss_coef": 0.01},
    "train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.5, "seed": 11},
    "parallel": {"bucket_mb": 0.02},
}
SIGMOID = {"model": {"router": "sigmoid", "num_experts_per_tok": 1, "capacity_factor": 0.0, "moe_every": 2}}
# mode -> {variant: overrides}; "ref" runs in one process and holds the references.
JOBS = {
    "w2": {
        "ep2_zero0": {"parallel": {"ep": 2, "zero": 0}},
        "ep2_zero1_accum": {"parallel": {"ep": 2, "zero": 1, "micro_batches": 2}},
        "ep2_sigmoid_zero2": {**SIGMOID, "parallel": {"ep": 2, "zero": 2}},
    },
    "w4": {
        "ep2_edp2_zero0": {"parallel": {"ep": 2, "zero": 0}},
        "ep2_edp2_zero2_full": {"parallel": {"ep": 2, "zero": 2}, "train": {"recompute": "full"}},
        "ep4_sigmoid_zero1": {**SIGMOID, "parallel": {"ep": 4, "zero": 1}},
        "ep2_edp2_zero3_accum": {"parallel": {"ep": 2, "zero": 3, "micro_batches": 2}},
    },
    "ref": {"ref": {}, "ref_sigmoid": SIGMOID},
}
# name -> (mode, overrides): deliberately wrong computations the checks must reject.
WRONG = {"ep2_edp2_zero0_no_edp_reduce": ("w4", {"parallel": {"ep": 2, "zero": 0}})}
N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])
REF_OF = {"ep2_zero0": "ref", "ep2_zero1_accum": "ref", "ep2_edp2_zero0": "ref", "ep2_edp2_zero2_full": "ref", "ep2_edp2_zero3_accum": "ref",
          "ep2_sigmoid_zero2": "ref_sigmoid", "ep4_sigmoid_zero1": "ref_sigmoid"}


# --------------------------------------------------------------------------------------
# Router and layer unit tests (one process)
# --------------------------------------------------------------------------------------


def _logits_for(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log()  # softmax(log p) = p


def test_top1_softmax_gates_capacity_and_aux_loss_by_hand():
    from chipset.layers.moe import route

    # Three tokens, two experts: t0 -> e1 (0.75), t1 -> e1 (0.8), t2 -> e0 (0.9).
    logits = _logits_for([[0.25, 0.75], [0.2, 0.8], [0.9, 0.1]])
    r = route(logits, top_k=1, router="softmax", capacity_factor=1.0)
    assert r.experts.squeeze(-1).tolist() == [[1, 1, 0]]
    torch.testing.assert_close(r.gates.squeeze(-1), torch.tensor([[0.75, 0.8, 0.9]]), rtol=1e-6, atol=0)
    assert r.capacity == 2 and r.keep.all()  # ceil(1.0 * 3 * 1 / 2) = 2
    # f = (1/3, 2/3), P = ((.25+.2+.9)/3, (.75+.8+.1)/3) = (.45, .55): aux = 2 * (.15 + .55*2/3)
    assert math.isclose(float(r.aux_loss), 2 * (0.45 / 3 + 0.55 * 2 / 3), rel_tol=1e-6)
    # Capacity 1: expert 1 takes t0 (earlier position) and drops t1; t2 keeps e0.
    r = route(logits, top_k=1, capacity_factor=0.5)
    assert r.capacity == 1 and r.keep.squeeze(-1).tolist() == [[True, False, True]]
    assert math.isclose(float(r.aux_loss), 2 * (0.45 / 3 + 0.55 * 2 / 3), rel_tol=1e-6)  # f counts before dropping


def test_top2_first_choices_are_admitted_before_second_choices():
    from chipset.layers.moe import route

    # First choices e0, e1, e0; second choices e1, e0, e1. Capacity ceil(0.5*3*2/2) = 2.
    logits = _logits_for([[0.6, 0.4], [0.3, 0.7], [0.55, 0.45]])
    r = route(logits, top_k=2, capacity_factor=0.5)
    assert r.experts.tolist() == [[[0, 1], [1, 0], [0, 1]]]
    # e0's queue: t0 (1st), t2 (1st), t1 (2nd, dropped); e1's: t1 (1st), t0 (2nd), t2 (2nd, dropped).
    assert r.keep.tolist() == [[[True, True], [True, False], [True, False]]]
    # With two experts and top-2 the renormalised gates are the probabilities; every expert
    # gets every token (f = 1/2), so aux = 2 * sum(P_i / 2) = 1 whatever the probabilities.
    torch.testing.assert_close(r.gates.sum(-1), torch.ones(1, 3, dtype=torch.float32))
    assert math.isclose(float(r.aux_loss), 1.0, rel_tol=1e-6)


def test_sigmoid_router_gates_and_normalised_scores_in_the_aux_loss():
    from chipset.layers.moe import route

    logits = torch.tensor([[[0.0, 2.0, -1.0], [1.0, 0.0, 0.5]]])
    s = logits.sigmoid()
    r = route(logits, top_k=2, router="sigmoid")
    top = s.topk(2, dim=-1).values
    torch.testing.assert_close(r.gates, top / top.sum(-1, keepdim=True))
    p = (s / s.sum(-1, keepdim=True)).mean(1)[0]
    f = torch.tensor([2.0, 1.0, 1.0]) / 4  # t0: e1, e0; t1: e0, e2
    assert r.experts[0].tolist() == [[1, 0], [0, 2]]
    assert math.isclose(float(r.aux_loss), float(3 * (f * p).sum()), rel_tol=1e-6)
    r1 = route(logits, top_k=1, router="sigmoid")
    torch.testing.assert_close(r1.gates.squeeze(-1), s.max(-1).values)  # top-1: the raw score


def test_capacity_is_per_sequence_so_any_batch_split_drops_the_same_tokens():
    from chipset.layers.moe import route

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, 4, generator=g) * 3
    whole = route(logits, top_k=2, capacity_factor=0.75)
    parts = [route(logits[i:i + 2], top_k=2, capacity_factor=0.75) for i in (0, 2, 4)]
    assert not whole.keep.all()
    assert torch.equal(whole.keep, torch.cat([p.keep for p in parts]))
    torch.testing.assert_close(whole.aux_loss, torch.stack([p.aux_loss for p in parts]).mean())


@pytest.mark.parametrize("backend", ["cpu_sim", "cpu"])  # experts: the reference loops; the cpu grouped_mlp
@pytest.mark.parametrize("top_k,capacity_factor,router,shared", [(2, 0.6, "softmax", 0), (3, 0.8, "sigmoid", 6)])
def test_moe_layer_and_its_gradients_equal_a_per_token_loop(backend, top_k, capacity_factor, router, shared,
                                                             monkeypatch):
    from chipset.discovery import records
    from chipset.errors import BackendUnavailableError
    from chipset.layers.moe import MoE, route
    from chipset.loader import backend as load
    from chipset.models.config import ModelConfig

    monkeypatch.delenv("CHIPSET_DISABLE_PLUGINS", raising=False)  # the suite hides cpu (tests/testenv.py)
    records.clear_cache()
    try:
        k = load(backend).kernels
    except BackendUnavailableError as e:
        pytest.skip(f"backend {backend} unavailable here: {e}")
    cfg = ModelConfig(hidden_size=8, intermediate_size=12, num_experts=4, num_experts_per_tok=top_k,
                      capacity_factor=capacity_factor, router=router, shared_expert_intermediate_size=shared)
    torch.manual_seed(0)
    layer = MoE(cfg, k)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w_out = torch.randn(3, 5, 8)  # an output gradient without symmetries
    params = [x, *layer.parameters()]
    y = layer(x)
    got = [y, *torch.autograd.grad((y * w_out).sum(), params)]
    r = layer.last_routing
    assert not r.keep.all()  # dropping active
    # The loop: every kept (token, choice) through its expert, weighted by its gate (the same
    # routing recomputed, so the gates carry the router's gradient here too).
    gates = route(layer.router(x), top_k=top_k, router=router, capacity_factor=capacity_factor).gates
    ex = layer.experts
    rows = []
    for bi in range(3):
        for t in range(5):
            y = torch.zeros(8)
            for j in range(top_k):
                if r.keep[bi, t, j]:
                    e = int(r.experts[bi, t, j])
                    h = k.swiglu(ex.gate_proj[e] @ x[bi, t], ex.up_proj[e] @ x[bi, t])
                    y = y + gates[bi, t, j] * (ex.down_proj[e] @ h)
            rows.append(y)
    want_y = torch.stack(rows).view(3, 5, 8)
    if shared:
        want_y = want_y + torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)
    want = [want_y, *torch.autograd.grad((want_y * w_out).sum(), params)]
    # Same products, other summation orders: reductions of at most 3*5*3 terms (weight
    # gradients over assignments), chained six deep (two matmuls and the gated sum, and back).
    rtol = parity.reduction_rtol(3 * 5 * top_k, 6)
    for name, a, b in zip(["output", "x", *(n for n, _ in layer.named_parameters())], got, want, strict=True):
        err = float((a - b).detach().norm() / b.detach().norm())
        assert err <= rtol, f"{name}: relative difference {err:.2e} > {rtol:.2e}"


def test_moe_config_errors_say_what_to_do():
    from chipset.errors import ConfigError
    from chipset.train.config import RunConfig

    cases = [
        ({"parallel": {"ep": 2}}, "parallel.ep = 2 needs a mixture-of-experts model"),
        ({"model": {"num_experts": 3}, "parallel": {"ep": 2}}, "parallel.ep (2) must divide model.num_experts (3)"),
        ({"model": {"num_experts": 4}, "parallel": {"ep": 4}}, "parallel.ep (4) must divide parallel.dp (2)"),
        ({"model": {"num_experts": 4, "num_experts_per_tok": 5}},
         "model.num_experts_per_tok (5) must be <= model.num_experts (4)"),
        ({"model": {"num_experts": 4, "router": "relu"}}, "model.router = 'relu': expected one of softmax, sigmoid"),
        ({"model": {"num_experts": 4, "capacity_factor": -1.0}}, "model.capacity_factor = -1.0"),
    ]
    for raw, expect in cases:
        with pytest.raises(ConfigError) as err:
            RunConfig.from_dict(raw).validate(world_size=2)
        assert expect in str(err.value), (raw, str(err.value))
    RunConfig.from_dict({"model": {"num_experts": 4}, "parallel": {"ep": 2}}).validate(world_size=2)


def test_planner_reads_the_engines_moe_keys():
    import chipset
    from chipset.models import Transformer
    from chipset.models.config import ModelConfig
    from chipset.planner.model import from_engine_model_config

    cfg = ModelConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_every=2)
    spec = from_engine_model_config(cfg, seq_len=16)
    assert (spec.num_experts, spec.top_k, spec.moe_layers) == (4, 2, 2)
    # The planner counts the engine's MoE model exactly: all parameters, and those in experts.
    named = dict(Transformer(cfg, chipset.backend().kernels).named_parameters())
    assert sum(p.numel() for p in named.values()) == spec.num_params()
    assert sum(p.numel() for n, p in named.items() if ".experts." in n) == spec.expert_params()


def test_expert_groups_are_carved_out_of_dp_ep_fastest():
    from chipset.parallel.dims import ParallelDims

    d = ParallelDims(dp=4, ep=2, world_size=4)
    assert d.group_ranks("ep") == [[0, 1], [2, 3]] and d.group_ranks("edp") == [[0, 2], [1, 3]] and d.edp == 2
    d = ParallelDims(dp=4, ep=4, world_size=4)
    assert d.group_ranks("ep") == [[0, 1, 2, 3]] and d.group_ranks("edp") == [[0], [1], [2], [3]]


# --------------------------------------------------------------------------------------
# The jobs (run under torchrun or as one process)
# --------------------------------------------------------------------------------------


def _cfg(b, overrides: dict):
    from chipset.train.config import RunConfig

    return RunConfig.from_dict(_merge(BASE, overrides)).validate(world_size=b.collective.world_size())


def _dropped_on_first_batch(b, overrides: dict) -> list[int]:
    """Assignments dropped per MoE layer on step 0's batch, summed over the data-parallel ranks."""
    from chipset.layers.moe import MoE
    from chipset.train import build

    engine, data, _ = build(_cfg(b, overrides), b)
    tokens, targets = data.batch(0, engine.dp_rank, engine.dp, device=engine.device)
    with torch.no_grad():
        engine.model.loss(tokens, targets)
    moe = [m for m in engine.model.modules() if isinstance(m, MoE)]
    dropped = torch.tensor([float((~m.last_routing.keep).sum()) for m in moe])
    if engine.dp > 1:
        b.collective.all_reduce(dropped, "sum", group=engine.group)
    return [int(x) for x in dropped]


def _expert_inf_run(b, zero: int) -> list[int]:
    """Only the last rank's expert gradient overflows at step 1: every rank must skip that step."""
    from chipset.train import build

    engine, data, _ = build(_cfg(b, {"parallel": {"ep": 2, "zero": zero}}), b)
    rank, last = b.collective.rank(), b.collective.world_size() - 1
    skipped = []
    for step in range(3):
        tokens, targets = data.batch(step, engine.dp_rank, engine.dp, device=engine.device)
        engine.forward_backward(tokens, targets)
        if step == 1 and rank == last:
            engine.model.layers[0].mlp.experts.gate_proj.grad.view(-1)[0] = math.inf
        skipped.append(float(engine.step(1e-2)["skipped"]))
    flags = torch.tensor(skipped)
    b.collective.all_reduce(flags, "sum")
    return [int(x) for x in flags]


def record_margins(run):
    """Run ``run()`` and return its routing margins, one per step (the smallest over MoE layers).

    Single-process reference only: one MoE forward per layer per step (no micro-batches,
    no recompute), so calls group into steps by the number of MoE layers.
    """
    from chipset.layers.moe import MoE

    seen: list[float] = []
    orig = MoE.forward

    def forward(self, x):
        with torch.no_grad():
            seen.append(parity.router_margin(x, self.router.weight, self.router(x), self.top_k))
        return orig(self, x)

    MoE.forward = forward
    try:
        res = run()
    finally:
        MoE.forward = orig
    per_step = len(seen) // STEPS
    assert per_step * STEPS == len(seen), f"{len(seen)} MoE forwards in {STEPS} steps"
    return res, [min(seen[i * per_step:(i + 1) * per_step]) for i in range(STEPS)]


def _skip_edp_reduce(run):
    """Negative control: expert buckets are divided by dp but never all-reduced over edp (zero 0/1)."""
    from chipset.runtime import data_parallel

    orig = data_parallel.Bucket.launch_reduce

    def broken(self):
        if self.engine.edp_group is not None and self.group is self.engine.edp_group:
            n, self.n = self.n, 1
            try:
                orig(self)
            finally:
                self.n = n
        else:
            orig(self)

    data_parallel.Bucket.launch_reduce = broken
    try:
        return run()
    finally:
        data_parallel.Bucket.launch_reduce = orig


def _result(res) -> dict:
    return {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics], "params": res.params}


def _job(mode: str, out_path: str) -> None:
    from chipset.train import train

    b = multirank.start()
    results: dict = {"world_size": b.collective.world_size()}
    for name, over in JOBS[mode].items():
        def run(over=over):
            return train(_cfg(b, over), b, None, out=io.StringIO(), keep_params=True)
        if mode == "ref":
            res, margins = record_margins(run)
            results[name] = {**_result(res), "margins": margins}
        else:
            results[name] = _result(run())
    for name, (m, over) in WRONG.items():
        if m == mode:
            results[name] = _result(_skip_edp_reduce(
                lambda over=over: train(_cfg(b, over), b, None, out=io.StringIO(), keep_params=True)))
    first = next(iter(JOBS[mode]))
    results["dropped"] = _dropped_on_first_batch(b, JOBS[mode][first])
    if mode == "w2":  # expert weights and their gradients live on one rank only (edp = 1)
        results["expert_inf"] = {z: _expert_inf_run(b, z) for z in (0, 1)}
    multirank.finish(b, results, out_path)


# --------------------------------------------------------------------------------------
# Parity tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(4)
    got = multirank.run_jobs(HERE, [{"w4": 4, "w2": 2, "ref": 1}], tmp_path_factory.mktemp("ep"), timeout=300)
    merged = {}
    for m, res in got.items():
        merged[f"{m}_world_size"] = res.pop("world_size")
        merged[f"{m}_dropped"] = res.pop("dropped")
        merged[f"{m}_expert_inf"] = res.pop("expert_inf", None)
        merged.update(res)
    return merged


def assert_moe_run_matches(got: dict, want: dict, *, n: int = N_REDUCE, depth: int = DEPTH) -> int:
    """The MoE parity check; returns how many leading steps were checked tightly.

    Losses and gradient norms within ``parity.trajectory_rtol`` on the steps where the
    reference's routing margin rules out a top-k flip (at least step 0: the seed is chosen
    so; if it ever is not, this fails saying so instead of comparing across a flip);
    parameters after all steps within AdamW's worst case, which holds flips or not.
    """
    margins = want["margins"]
    steps = parity.unflippable_steps(margins, n=n, depth=depth)
    assert steps >= 1, (f"step 0's smallest routing margin {margins[0]:.2e} is within rounding "
                        f"(2 x {parity.trajectory_rtol(n, depth, 0):.2e}): pick another seed")
    parity.assert_losses_close(got["losses"][:steps], want["losses"][:steps], n=n, depth=depth)
    parity.assert_grad_norms_close(got["grad_norms"][:steps], want["grad_norms"][:steps], n=n, depth=depth)
    tr = BASE["train"]
    parity.assert_params_within_adam_bound(got["params"], want["params"], lrs=[tr["lr"]] * len(want["losses"]),
                                           beta1=0.9, beta2=0.95)
    return steps


@pytest.mark.parametrize("variant", list(REF_OF))
def test_ep_losses_norms_and_params_equal_single_process(runs, variant):
    got, want = runs[variant], runs[REF_OF[variant]]
    assert runs["w2_world_size"] == 2 and runs["w4_world_size"] == 4 and runs["ref_world_size"] == 1
    steps = assert_moe_run_matches(got, want)
    print(f"{variant}: {steps}/{STEPS} steps checked tightly; margins {[f'{m:.1e}' for m in want['margins']]}")
    assert want["losses"][-1] < want["losses"][0] - 0.05  # it trained, so equality is not vacuous
    assert all(n > BASE["train"]["grad_clip"] for n in want["grad_norms"])  # clipping active


@pytest.mark.parametrize("variant", list(WRONG))
def test_parity_check_rejects_expert_gradients_not_reduced_over_edp(runs, variant):
    """Negative control: each edp rank steps its experts with half the batch's gradient."""
    with pytest.raises(AssertionError, match="gradient norm at step 0|loss at step") as caught:
        assert_moe_run_matches(runs[variant], runs["ref"])
    print(caught.value)
    assert_moe_run_matches(runs["ep2_edp2_zero0"], runs["ref"])  # the correct run of that layout passes


def test_capacity_dropping_is_active_and_identical_across_layouts(runs):
    assert runs["ref_dropped"] == runs["w2_dropped"] == runs["w4_dropped"]
    assert all(n > 0 for n in runs["ref_dropped"]), runs["ref_dropped"]


def test_an_overflow_in_one_ranks_experts_skips_the_step_on_every_rank(runs):
    # Summed over the 2 ranks: nobody skips steps 0 and 2, everybody skips step 1.
    assert runs["w2_expert_inf"] == {0: [0, 2, 0], 1: [0, 2, 0]}


def test_expert_weights_have_their_single_process_shapes(runs):
    p = runs["ep2_edp2_zero2_full"]["params"]
    assert p["layers.0.mlp.experts.gate_proj"].shape == (4, 48, 32)
    assert p["layers.1.mlp.experts.down_proj"].shape == (4, 32, 48)
    assert "layers.0.mlp.router.weight" in p


def test_chipset_train_runs_moe_with_ep2_on_two_ranks(tmp_path):
    """The command from issue 5: ``chipset train --set model.num_experts=4 --set parallel.ep=2 --nproc 2``."""
    import json

    import chipset
    from chipset.train.config import load_config

    b = chipset.backend()
    if not b.capabilities.multi_process or b.device.device_count() < 2:
        pytest.skip("needs multi_process and 2 devices")
    run_dir = tmp_path / "run"
    env = multirank.env()
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--set", "model.num_experts=4",
                        "--set", "parallel.ep=2", "--nproc", "2", "--set", "train.steps=6",
                        "--run-dir", str(run_dir)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"]["ep"] == 2 and summary["layout"]["dp"] == 2 and summary["world_size"] == 2
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    cfg = load_config(run_dir / "config.toml")
    assert cfg.model.num_experts == 4 and cfg.parallel.ep == 2


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
