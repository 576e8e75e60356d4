"""The optimizer seam and frozen parameters, on real processes.

``train.optimizer = "sgd"`` (runtime/optim.py) trains under dp with ZeRO 0-3, tp and pp and
gives the per-step losses of the same SGD run in one process; a run checkpointed halfway and
resumed ends with the uninterrupted run's digest bit for bit (its momentum is in the
checkpoint as ``optim.momentum.*``). A frozen parameter (``requires_grad=False``) gets a
value-only bucket: no gradient, no master weights, no optimizer state, no checkpoint optimizer
entries, and it does not move. This file is also the jobs' script (``__main__`` below).

Tolerances: tests/parity.py's fp32 reduction bounds for the losses (the optimizer does not
enter them: every layout applies the same update to the same reduced gradient).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import multirank
import parity
from multirank import merge as _merge

HERE = Path(__file__).resolve()
STEPS = 4
BASE = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "lr": 0.5, "grad_clip": 0.0, "seed": 7,
              "optimizer": "sgd", "momentum": 0.9},
    "parallel": {"bucket_mb": 0.02},
}
LAYOUTS = {
    "zero0": {"parallel": {"zero": 0}}, "zero1": {"parallel": {"zero": 1}},
    "zero2": {"parallel": {"zero": 2}}, "zero3": {"parallel": {"zero": 3}},
    "tp2": {"parallel": {"tp": 2}}, "pp2": {"parallel": {"pp": 2, "micro_batches": 2}},
}
N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])


def _cfg(b, over: dict):
    from chipset.train.config import RunConfig

    return RunConfig.from_dict(_merge(BASE, over)).validate(world_size=b.collective.world_size())


def _train(b, over: dict, run_dir=None, resume: str = "none") -> dict:
    from chipset.train import train

    res = train(_cfg(b, over), b, run_dir, out=io.StringIO(), resume=resume)
    return {"losses": res.losses, "digest": res.summary["params_digest"]}


def _frozen(b, zero: int, over: dict | None = None) -> dict:
    """Freeze the embedding and the first block's attention, train 2 steps, report what the engine holds."""
    from chipset.models.registry import resolve_family
    from chipset.train.checkpoint.layout import engine_pieces, kinds
    from chipset.train.loop import build_model, make_dims, rank_batches, train_step, wrap

    cfg = _cfg(b, _merge({"parallel": {"zero": zero}}, over or {}))
    dims = make_dims(cfg, b.collective.world_size())
    bound = build_model(cfg, b, dims, resolve_family(cfg.model.family))
    frozen = {n for n, p in bound.module.named_parameters() if n.startswith(("embed_tokens", "layers.0.self_attn"))}
    for n, p in bound.module.named_parameters():
        p.requires_grad_(n not in frozen)
    engine = wrap(bound, cfg, b, dims)
    from chipset.data.datasets import make_dataset

    data = make_dataset(cfg)
    before = engine.full_parameters()
    for step in range(2):
        train_step(engine, rank_batches(data, step, engine, cfg.parallel.micro_batches), cfg.train.lr)
    after = engine.full_parameters()
    optim_names = {name for kind in kinds(engine) if kind != "model"
                   for name, _, _ in engine_pieces(engine, kind, for_load=True)}
    frozen_buckets = [bk for bk in engine.buckets if bk.frozen]
    return {
        "frozen": sorted(frozen),
        "frozen_in_trainable_buckets": sorted(n for bk in engine.buckets if not bk.frozen for n in bk.names
                                              if n in frozen),
        "frozen_bucket_state": [(bk.grad is None, bk.grad_shard_buf is None, bk.master is None, bk.state == {})
                                for bk in frozen_buckets],
        "frozen_grads": [p.grad is None for bk in frozen_buckets for p in bk.params],
        "optim_names": sorted(optim_names),
        "unchanged": sorted(n for n in before if torch.equal(before[n], after[n])),
        "names": sorted(before),
    }


def _sync_api(b, zero: int) -> dict:
    """The public gradient-sync API: backward passes under ``no_sync`` then ``start_grad_sync``
    give the same update as the overlapped step; both engines satisfy the Engine protocol."""
    from chipset.runtime.engine import Engine
    from chipset.train import build
    from chipset.train.loop import rank_batches

    cfg = _cfg(b, {"parallel": {"zero": zero, "micro_batches": 2}})
    params = []
    for deferred in (False, True):
        engine, data, _ = build(cfg, b)
        batches = rank_batches(data, 0, engine, 2)
        if deferred:
            with engine.no_sync():
                for x, y in batches:
                    engine.forward_backward(x, y, last=True)
            launched_during_backward = len(engine.launch_log)
            engine.start_grad_sync()
        else:
            engine.forward_backward_step(batches)
        engine.step(cfg.train.lr)
        params.append(engine.full_parameters())
    pp_engine, _, _ = build(_cfg(b, LAYOUTS["pp2"]), b)
    return {"equal": all(torch.equal(params[0][n], params[1][n]) for n in params[0]),
            "moved": any(not torch.equal(params[0][n], before) for n, before in _initial(b, cfg).items()),
            "launched_during_backward": launched_during_backward,
            "protocol": [isinstance(engine, Engine), isinstance(pp_engine, Engine)]}


def _initial(b, cfg) -> dict:
    from chipset.train import build

    engine, _, _ = build(cfg, b)
    return engine.full_parameters()


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    results: dict = {"world_size": b.collective.world_size()}
    if mode == "ref":
        results["ref"] = _train(b, {})
        results["ref_adamw"] = _train(b, {"train": {"optimizer": "adamw", "lr": 1e-2}})
        results["frozen"] = {0: _frozen(b, 0)}
    else:
        for name, over in LAYOUTS.items():
            results[name] = _train(b, over)
        tmp = Path(out_path).parent
        over = {"parallel": {"zero": 3}, "train": {"checkpoint_every": 2}}
        whole = _train(b, over)
        part = _train(b, _merge(over, {"train": {"steps": 2}}), tmp / "ckpt")
        resumed = _train(b, over, tmp / "ckpt", resume="auto")
        results["checkpoint"] = {"whole": whole, "first": part, "resumed": resumed}
        results["frozen"] = {z: _frozen(b, z) for z in (0, 1, 2, 3)}
        results["frozen_pp"] = _frozen(b, 1, LAYOUTS["pp2"])
        results["sync_api"] = {z: _sync_api(b, z) for z in (0, 2, 3)}
    multirank.finish(b, results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(2)
    got = multirank.run_jobs(HERE, [{"w2": 2, "ref": 1}], tmp_path_factory.mktemp("optim"), timeout=400)
    return got["w2"], got["ref"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sgd_trains_under_every_layout_like_one_process(runs, layout):
    got, ref = runs
    parity.assert_losses_close(got[layout]["losses"], ref["ref"]["losses"], n=N_REDUCE, depth=DEPTH)
    assert ref["ref"]["losses"][-1] < ref["ref"]["losses"][0] - 0.05  # SGD really trained


def test_sgd_is_not_adamw(runs):
    # The negative control: the optimizer reaches the update (AdamW's trajectory differs).
    _, ref = runs
    with pytest.raises(AssertionError):
        parity.assert_losses_close(ref["ref_adamw"]["losses"], ref["ref"]["losses"], n=N_REDUCE, depth=DEPTH)


def test_sgd_round_trips_through_a_checkpoint(runs):
    c = runs[0]["checkpoint"]
    assert c["first"]["losses"] == c["whole"]["losses"][:2]
    assert c["resumed"]["losses"] == c["whole"]["losses"][2:]
    assert c["resumed"]["digest"] == c["whole"]["digest"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_frozen_parameters_get_no_gradient_and_no_optimizer_state(runs, zero):
    f = runs[0]["frozen"][zero]
    assert f["frozen"] and f["frozen_in_trainable_buckets"] == []
    assert f["frozen_bucket_state"] and all(all(x) for x in f["frozen_bucket_state"])
    assert all(f["frozen_grads"])
    assert set(f["optim_names"]) == set(f["names"]) - set(f["frozen"])  # checkpoints hold no optimizer state for them
    assert set(f["unchanged"]) == set(f["frozen"])  # frozen ones stay put, every other parameter moved


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_no_sync_then_start_grad_sync_equals_the_overlapped_step(runs, zero):
    r = runs[0]["sync_api"][zero]
    assert r["launched_during_backward"] == 0  # no_sync really held the reductions back
    assert r["moved"] and r["equal"]
    assert r["protocol"] == [True, True]


def test_frozen_parameters_under_a_pipeline(runs):
    f = runs[0]["frozen_pp"]
    assert f["frozen"] and set(f["unchanged"]) == set(f["frozen"])
    assert all(all(x) for x in f["frozen_bucket_state"]) and all(f["frozen_grads"])


def test_frozen_parameters_in_one_process(runs):
    f = runs[1]["frozen"][0]
    assert set(f["unchanged"]) == set(f["frozen"]) and set(f["optim_names"]) == set(f["names"]) - set(f["frozen"])


def test_sgd_update_equals_torch_sgd():
    """The update rule against torch.optim.SGD (momentum, Nesterov), and decoupled decay by its formula."""
    from chipset.runtime.optim import SGD

    g = [torch.randn(10, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for nesterov in (False, True):
        w = torch.randn(10, generator=torch.Generator().manual_seed(9))
        ref = w.clone().requires_grad_(True)
        opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, nesterov=nesterov)
        state = {"momentum": torch.zeros(10)}
        mine = SGD(momentum=0.9, nesterov=nesterov)
        for step, gi in enumerate(g, 1):
            ref.grad = gi.clone()
            opt.step()
            mine.update(w, gi.clone(), state, step, 0.1, kernels=None)
        torch.testing.assert_close(w, ref.detach())  # fp32 defaults: the same operations in the same order
    w = torch.ones(4)
    SGD(momentum=0.0, weight_decay=0.5).update(w, torch.zeros(4), {}, 1, 0.1, kernels=None)
    assert torch.equal(w, torch.full((4,), 1 - 0.1 * 0.5))
    assert SGD(momentum=0.0).state_names == () and SGD().state_names == ("momentum",)



def test_the_planner_counts_the_optimizers_state():
    """ZeRO's K follows the declared state: AdamW 2 tensors, SGD 1, plain SGD none; +4 for masters."""
    from chipset.planner.run import optimizer_bytes
    from chipset.train.config import load_config

    def k(optimizer: str, masters_are_params: bool, momentum: float = 0.9) -> int:
        cfg = load_config(None, [f'train.optimizer="{optimizer}"', f"train.momentum={momentum}"])
        return optimizer_bytes(cfg.train, masters_are_params)

    assert (k("adamw", False), k("adamw", True)) == (12, 8)
    assert (k("sgd", False), k("sgd", True), k("sgd", True, momentum=0.0)) == (8, 4, 0)


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
