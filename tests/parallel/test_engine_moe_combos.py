"""MoE with tp, sequence parallelism, cp and pp (with and without ep, ZeRO 0-3) equals one process.

One torchrun job on 4 ranks (gloo, default backend) runs every variant in turn beside
one single-process job running the reference (tests/multirank.py); then one process
resumes three of the variants' step-5 checkpoints. As in
tests/parallel/test_engine_ep.py (``assert_moe_run_matches``, derivations in tests/parity.py):
fp32 per-step losses and clipped gradient norms within ``trajectory_rtol`` on the steps
where the reference's routing margin rules out a top-k flip, final parameters (logical
full tensors by single-process name) within AdamW's worst case; the first step's router
and expert gradients within one pass's reduction rounding (``reduction_rtol``) of their
largest element. A negative control (the ep dispatcher skipping its re-sort of arrived
tokens, so tokens reach the wrong local expert) must fail the same check. Capacity
dropping is active (softmax, top-2, capacity factor 1) and the dropped-assignment count
of the first batch is compared per layout: it only matches if the whole-sequence routing
survives the sequence split (sp, cp). This file is also the jobs' script.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch
from test_engine_ep import BASE, DEPTH, N_REDUCE, STEPS, assert_moe_run_matches, record_margins

import multirank
import parity
from multirank import merge as _merge

HERE = Path(__file__).resolve()
# Gradients after one step's reduction (zero 0, no ep: every rank holds whole MoE tensors).
GRAD_PROBES = {"dp2_tp2": {"parallel": {"tp": 2}}, "dp2_tp2_sp": {"parallel": {"tp": 2, "sequence_parallel": True}},
               "dp2_cp2": {"parallel": {"cp": 2}}}
# variant -> overrides, all on 4 ranks (dp fills what tp and cp leave).
W4 = {
    "ep2_tp2_zero1": {"parallel": {"tp": 2, "ep": 2, "zero": 1}},
    "dp2_tp2_sp_zero3": {"parallel": {"tp": 2, "sequence_parallel": True, "zero": 3}},
    "dp2_cp2_ep2": {"parallel": {"cp": 2, "ep": 2}},
    "tp2_cp2_ep2_sp_ring_full": {"parallel": {"tp": 2, "cp": 2, "ep": 2, "sequence_parallel": True,
                                             "cp_attention": "ring"},
                                 "train": {"recompute": "full"}},
    # pp: both blocks are MoE, so a non-last stage adds its aux loss to its backward.
    "dp2_pp2_ep2_zero1_1f1b": {"parallel": {"pp": 2, "ep": 2, "zero": 1, "schedule": "1f1b", "micro_batches": 4}},
    "dp2_pp2_ep2_zero3_gpipe": {"parallel": {"pp": 2, "ep": 2, "zero": 3, "schedule": "gpipe", "micro_batches": 2}},
    "tp2_pp2_interleaved": {"parallel": {"pp": 2, "tp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2,
                                         "micro_batches": 2}},
    # zero bubble: the MoE experts' grouped_mlp node (a custom autograd Function) on the frontier
    # of a split backward, tp's collectives on its input path, the aux loss on a non-last stage.
    "tp2_pp2_zero_bubble": {"parallel": {"pp": 2, "tp": 2, "schedule": "zero_bubble", "micro_batches": 4}},
}

# name -> overrides: run on 4 ranks with a broken ep dispatch (``_unsorted_dispatch``).
WRONG = {"ep2_tp2_zero1_unsorted_dispatch": {"parallel": {"tp": 2, "ep": 2, "zero": 1}}}


# Combinations that also save a checkpoint at step SAVE_AT; one process resumes each (wave 2).
SAVE_AT = 5
SAVES = ("ep2_tp2_zero1", "dp2_cp2_ep2", "dp2_pp2_ep2_zero1_1f1b")


def _ckpt(root: Path, run: str) -> Path:
    return root / run / "checkpoints" / f"step-{SAVE_AT:08d}"


def _cfg(b, overrides: dict):
    from chipset.train.config import RunConfig

    return RunConfig.from_dict(_merge(BASE, overrides)).validate(world_size=b.collective.world_size())


def _dropped_on_first_batch(b, overrides: dict) -> list[int]:
    """Assignments dropped per MoE layer on step 0's batch, summed over the ranks holding different tokens."""
    from chipset.layers.moe import MoE
    from chipset.train import build

    engine, data, dims = build(_cfg(b, overrides), b)
    tokens, targets = data.batch(0, dims.coords(b.collective.rank())["dp"], dims.dp, device=engine.device)
    with torch.no_grad():
        engine.model.loss(tokens, targets)
    moe = [m for m in engine.model.modules() if isinstance(m, MoE)]
    dropped = torch.tensor([float((~m.last_routing.keep).sum()) for m in moe])
    if engine.dp > 1:  # dp x cp: disjoint tokens (tp ranks hold the same ones)
        b.collective.all_reduce(dropped, "sum", group=engine.group)
    return [int(x) for x in dropped]


def _moe_grads(b, overrides: dict) -> dict[str, torch.Tensor]:
    """Router and expert gradients of step 0's batch, reduced over the data-parallel ranks."""
    from chipset.train import build

    engine, data, dims = build(_cfg(b, overrides), b)
    tokens, targets = data.batch(0, dims.coords(b.collective.rank())["dp"], dims.dp, device=engine.device)
    engine.forward_backward(tokens, targets)
    for bucket in engine.buckets:
        bucket.wait()
    return {n: p.grad.detach().clone() for n, p in engine.model.named_parameters() if ".mlp.router" in n or ".experts." in n}


def _unsorted_dispatch(run):
    """Negative control: arrived tokens go to the experts in arrival (source-major) order.

    The dispatcher must re-sort the all-to-all's (source, expert) blocks into (expert,
    source) order; without it, with ep 2 and 2 local experts, a source's tokens for its
    second expert are run by the first one.
    """
    from chipset.parallel import experts as xp

    orig = xp.AllToAllDispatcher.__call__

    def broken(self, tokens, counts, experts):
        send = torch.tensor(counts, dtype=torch.int64, device=tokens.device)
        recv = torch.empty_like(send)
        self.collective.all_to_all(recv, send, group=self.group)
        in_splits = [sum(counts[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        out_splits = [int(x) for x in recv.view(self.ep, self.local).sum(1)]
        arrived = xp._AllToAll.apply(tokens, out_splits, in_splits, self.collective, self.group)
        per_expert = [int(x) for x in recv.view(self.ep, self.local).sum(0)]
        done = experts(arrived, per_expert)  # no (expert, source) sort: the bug
        return xp._AllToAll.apply(done, in_splits, out_splits, self.collective, self.group)

    xp.AllToAllDispatcher.__call__ = broken
    try:
        return run()
    finally:
        xp.AllToAllDispatcher.__call__ = orig


def _job(mode: str, out_path: str) -> None:
    from chipset.train import train

    b = multirank.start()
    variants = W4 if mode == "w4" else {"ref": {}}
    results: dict = {"world_size": b.collective.world_size()}
    root = Path(out_path).parent
    if mode == "resume":  # one process continues each combination's step-5 checkpoint
        for name in SAVES:
            res = train(_cfg(b, {}), b, root / f"resumed_{name}", out=io.StringIO(), resume=str(_ckpt(root, name)))
            results[name] = {"losses": res.losses, "resumed_step": res.summary.get("resumed_step")}
        multirank.finish(b, results, out_path)
    for name, over in variants.items():
        if name in SAVES:
            over = _merge(over, {"train": {"checkpoint_every": SAVE_AT, "keep_checkpoints": 0}})
        def run(over=over, name=name):
            return train(_cfg(b, over), b, root / name if name in SAVES else None, out=io.StringIO(),
                         keep_params=True)
        margins = None
        if mode == "ref":
            res, margins = record_margins(run)
        else:
            res = run()
        results[name] = {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics],
                         "params": res.params, "margins": margins}
    for name, over in (WRONG.items() if mode == "w4" else ()):
        res = _unsorted_dispatch(lambda over=over: train(_cfg(b, over), b, None, out=io.StringIO(),
                                                         keep_params=True))
        results[name] = {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics],
                         "params": res.params}
    results["dropped"] = {name: _dropped_on_first_batch(b, over) for name, over in variants.items()
                          if "pp" not in over.get("parallel", {})}  # a pipeline rank has no whole-model forward
    probes = GRAD_PROBES if mode == "w4" else {"ref": {}}
    results["grads"] = {name: _moe_grads(b, over) for name, over in probes.items()}
    multirank.finish(b, results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(4)
    return multirank.run_jobs(HERE, [{"w4": 4, "ref": 1}, {"resume": 1}], tmp_path_factory.mktemp("moe_combos"),
                              timeout=400)


@pytest.mark.parametrize("variant", list(W4))
def test_moe_layout_equals_single_process(runs, variant):
    assert runs["w4"]["world_size"] == 4 and runs["ref"]["world_size"] == 1
    got, want = runs["w4"][variant], runs["ref"]["ref"]
    steps = assert_moe_run_matches(got, want)
    print(f"{variant}: {steps}/{STEPS} steps checked tightly")
    assert want["losses"][-1] < want["losses"][0] - 0.05  # it trained, so equality is not vacuous
    assert all(n > BASE["train"]["grad_clip"] for n in want["grad_norms"])  # clipping active


@pytest.mark.parametrize("variant", list(WRONG))
def test_parity_check_rejects_a_wrong_expert_dispatch(runs, variant):
    """Negative control: the same check fails when tokens reach the wrong local expert."""
    with pytest.raises(AssertionError, match="at step 0") as caught:
        assert_moe_run_matches(runs["w4"][variant], runs["ref"]["ref"])
    print(caught.value)
    assert_moe_run_matches(runs["w4"]["ep2_tp2_zero1"], runs["ref"]["ref"])  # the correct dispatch passes


@pytest.mark.parametrize("variant", list(GRAD_PROBES))
def test_router_and_expert_gradients_equal_single_process(runs, variant):
    """Step 0's router and expert gradients, before AdamW amplifies rounding.

    Same weights, same batch, same routing (step 0's margin is checked): they differ only
    by reduction order, within ``reduction_rtol`` of their scale (the largest element).
    """
    got, want = runs["w4"]["grads"][variant], runs["ref"]["grads"]["ref"]
    assert parity.unflippable_steps(runs["ref"]["ref"]["margins"], n=N_REDUCE, depth=DEPTH) >= 1
    tol = parity.reduction_rtol(N_REDUCE, DEPTH)
    assert got.keys() == want.keys() and len(want) == 8  # 2 MoE layers x (router, 3 expert tensors)
    for k, v in want.items():
        scale = float(v.abs().max())
        assert scale > 0, k
        diff = float((got[k] - v).abs().max())
        assert diff <= tol * scale, f"{k}: abs diff {diff:.2e} > {tol:.1e} x {scale:.2e}"


@pytest.mark.parametrize("variant", [v for v in W4 if "pp" not in W4[v]["parallel"]])
def test_capacity_dropping_matches_single_process(runs, variant):
    want = runs["ref"]["dropped"]["ref"]
    assert all(n > 0 for n in want), want
    assert runs["w4"]["dropped"][variant] == want


@pytest.mark.parametrize("variant", SAVES)
def test_a_combinations_checkpoint_resumes_in_one_process(runs, variant):
    """Experts are stored as logical [E, ...] tensors whatever tp, cp, pp and ep held: one process
    resumes step 5 and continues with the uninterrupted single-process losses."""
    got, want = runs["resume"][variant], runs["ref"]["ref"]
    assert got["resumed_step"] == SAVE_AT and len(got["losses"]) == STEPS - SAVE_AT
    # Tight only on the steps where no routing flip is possible (tests/parity.py).
    steps = parity.unflippable_steps(want["margins"], n=N_REDUCE, depth=DEPTH)
    parity.assert_losses_close(got["losses"][:max(0, steps - SAVE_AT)], want["losses"][SAVE_AT:steps],
                               n=N_REDUCE, depth=DEPTH, first_step=SAVE_AT)
    assert all(math.isfinite(x) for x in got["losses"])


def test_config_checks_ep_against_dp_times_cp():
    from chipset.errors import ConfigError
    from chipset.train.config import RunConfig

    RunConfig.from_dict(_merge(BASE, {"parallel": {"cp": 2, "ep": 4, "dp": 2}})).validate(world_size=4)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(_merge(BASE, {"parallel": {"cp": 2, "ep": 4}})).validate(world_size=2)
    assert "parallel.ep (4) must divide dp*cp (1*2) (2)" in str(err.value)


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
