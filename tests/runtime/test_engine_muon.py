"""Muon and light Adam state (runtime/optim.py, runtime/matrices.py) on real processes.

``train.optimizer = "muon"`` trains under dp with ZeRO 1 and 3 and under tp like one process:
every layout orthogonalises the same logical matrices (gathered over the ZeRO shard and over
tp), so only the gradient's reduction order differs. A run checkpointed halfway and resumed
gives the uninterrupted run's losses and digest. This file is also the jobs' script.

Tolerances: tests/parity.py's fp32 reduction bounds for the losses.
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
BASE = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": 4, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.0, "seed": 7,
              "optimizer": "muon"},
    "parallel": {"bucket_mb": 0.02},
}
LAYOUTS = {"zero0": {"parallel": {"zero": 0}}, "zero1": {"parallel": {"zero": 1}}, "zero3": {"parallel": {"zero": 3}}, "tp2": {"parallel": {"tp": 2}}}
N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])


def _train(b, over: dict, run_dir=None, resume: str = "none") -> dict:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, over)).validate(world_size=b.collective.world_size())
    res = train(cfg, b, run_dir, out=io.StringIO(), resume=resume)
    return {"losses": res.losses, "digest": res.summary["params_digest"]}


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    results: dict = {}
    if mode == "ref":
        results["ref"] = _train(b, {})
        results["ref_adamw"] = _train(b, {"train": {"optimizer": "adamw"}})
        results["ref_bf16"] = _train(b, {"train": {"optimizer": "adamw", "optimizer_state_dtype": "bfloat16"}})
    else:
        for name, over in LAYOUTS.items():
            results[name] = _train(b, over)
        results["zero1_bf16"] = _train(b, {"parallel": {"zero": 1},
                                           "train": {"optimizer": "adamw", "optimizer_state_dtype": "bfloat16"}})
        tmp = Path(out_path).parent
        over = {"parallel": {"zero": 2}, "train": {"checkpoint_every": 2, "optimizer_state_dtype": "bfloat16"}}
        whole = _train(b, over)
        part = _train(b, _merge(over, {"train": {"steps": 2}}), tmp / "ckpt")
        resumed = _train(b, over, tmp / "ckpt", resume="auto")
        results["checkpoint"] = {"whole": whole, "first": part, "resumed": resumed}
    multirank.finish(b, results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(2)
    got = multirank.run_jobs(HERE, [{"w2": 2, "ref": 1}], tmp_path_factory.mktemp("muon"), timeout=400)
    return got["w2"], got["ref"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_trains_under_every_layout_like_one_process(runs, layout):
    got, ref = runs
    parity.assert_losses_close(got[layout]["losses"], ref["ref"]["losses"], n=N_REDUCE, depth=DEPTH)
    assert ref["ref"]["losses"][-1] < ref["ref"]["losses"][0] - 0.05


def test_muon_zero_stages_agree_bit_for_bit(runs):
    """At dp = 2 every ZeRO stage reduces the same two gradients (a + b is exact to commute), so
    the gathered matrices, and the trained parameters, are bit-identical to ZeRO-0's, which
    gathers nothing. This catches a wrong gather that the loss bounds can miss: a matrix cut by
    the ZeRO-3 shard boundary is one of a block's seven."""
    got, _ = runs
    assert got["zero1"]["digest"] == got["zero0"]["digest"] == got["zero3"]["digest"]


def test_muon_is_not_adamw(runs):
    _, ref = runs  # the negative control: the matrices really take Muon's update
    with pytest.raises(AssertionError):
        parity.assert_losses_close(ref["ref_adamw"]["losses"], ref["ref"]["losses"], n=N_REDUCE, depth=DEPTH)


def test_bf16_optimizer_state_trains_under_zero_like_one_process(runs):
    got, ref = runs  # the same rounding of the same elementwise state in every layout
    parity.assert_losses_close(got["zero1_bf16"]["losses"], ref["ref_bf16"]["losses"], n=N_REDUCE, depth=DEPTH)
    assert ref["ref_bf16"]["losses"] != ref["ref_adamw"]["losses"]  # the state really is rounded


def test_the_planner_counts_light_state():
    from chipset.planner.run import optimizer_bytes
    from chipset.train.config import load_config

    def k(optimizer: str, sd: str) -> int:
        cfg = load_config(None, [f'train.optimizer="{optimizer}"', f'train.optimizer_state_dtype="{sd}"'])
        return optimizer_bytes(cfg.train, masters_are_params=False)

    assert (k("adamw", "float32"), k("adamw", "bfloat16"), k("muon", "bfloat16"), k("sgd", "bfloat16")) == (12, 8, 8, 6)


def test_muon_round_trips_through_a_checkpoint(runs):
    """Muon with bfloat16 state under ZeRO-2: resumed = uninterrupted, bit for bit."""
    c = runs[0]["checkpoint"]
    assert c["first"]["losses"] == c["whole"]["losses"][:2]
    assert c["resumed"]["losses"] == c["whole"]["losses"][2:]
    assert c["resumed"]["digest"] == c["whole"]["digest"]


def test_newton_schulz_orthogonalises():
    """Singular values of NS5's output lie in Muon's documented band (about 0.7-1.2), whatever
    the input's; the singular vectors are the input's (U V^T up to that band)."""
    from chipset.runtime.optim import newton_schulz

    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 40)
    for m in (g, g.T):
        s = torch.linalg.svdvals(newton_schulz(m, 5))
        assert s.min() > 0.6 and s.max() < 1.25, s
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity((u @ vh).reshape(-1), newton_schulz(g, 5).reshape(-1), dim=0)
    assert cos > 0.95


def test_muon_update_by_its_formula():
    """One matrix and one vector in a flat buffer: the matrix takes -lr 0.2 sqrt(max(A,B)) NS(g + m g)
    after decay, the vector takes AdamW's first step (-lr sign(g) up to eps)."""
    from chipset.kernels.reference import fused_adamw
    from chipset.runtime.optim import Muon, newton_schulz

    class Kernels:
        pass

    k = Kernels()
    k.fused_adamw = fused_adamw

    class Mats:  # what runtime/matrices.py gives one process: a 4x6 matrix, then 5 vector elements
        entries = [("w", 0, 24, 0, (4, 6), None)]
        elementwise = [(24, 29)]
        gathers = True

        def full(self, u):
            yield 0, 24, 0, u[:24].view(4, 6), lambda full: full.reshape(-1)

    g = torch.randn(29, generator=torch.Generator().manual_seed(1))
    w = torch.randn(29, generator=torch.Generator().manual_seed(2))
    before = w.clone()
    opt = Muon(weight_decay=0.1)
    state = {n: torch.zeros(29) for n in opt.state_names}
    opt.update(w, g, state, 1, 0.01, k, matrices=Mats())
    want = before[:24] * (1 - 0.01 * 0.1) - 0.01 * 0.2 * 6**0.5 * newton_schulz((g[:24] * 1.95).view(4, 6), 5).reshape(-1)
    torch.testing.assert_close(w[:24], want)
    torch.testing.assert_close(w[24:], before[24:] * (1 - 0.001) - 0.01 * g[24:].sign(), atol=1e-6, rtol=0)
    assert torch.equal(state["exp_avg"][:24], g[:24]) and torch.equal(state["exp_avg_sq"][:24], torch.zeros(24))


def test_hidden_matrices_leave_embeddings_head_norms_to_adamw():
    from chipset.models.registry import resolve_family
    from chipset.runtime.matrices import hidden_matrix_names
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict({"model": {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
                                         "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}})
    for family, block in (("transformer", "layers.0."), ("gpt2", "h.0.")):
        model = resolve_family(family).build(cfg)
        names = hidden_matrix_names(model)
        params = dict(model.named_parameters())
        assert names and all(n.startswith(block) and params[n].ndim == 2 for n in names), names
        rest = set(params) - names
        assert any("embed" in n or "wte" in n for n in rest) and any(n.endswith("lm_head.weight") for n in rest)


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
