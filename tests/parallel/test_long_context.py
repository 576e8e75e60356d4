"""Long context: fused ring and Ulysses cp equal one process (fp32, GQA), document masks,
chunked loss and activation offload (issue 34).

A 2-rank and a 4-rank torchrun job run the cp variants beside one single-process job that
runs the references (tests/multirank.py); losses per step, gradient norms and final parameters must
match within the bounds of tests/parity.py, as in tests/parallel/test_engine_tp.py. ``kv1`` models
have one kv head for four query heads: fewer kv heads than the cp degree, so Ulysses repeats
them. Document-mask variants use a small vocabulary so the end-of-document id occurs in
every window. This file is also the jobs' script (``__main__`` below).
"""

from __future__ import annotations

import dataclasses
import io
import re
import sys
from pathlib import Path

import pytest
import torch

import multirank
import parity
from multirank import merge as _merge

HERE = Path(__file__).resolve()
STEPS = 6
BASE = {
    "model": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": STEPS, "global_batch": 4, "seq_len": 32, "lr": 1e-2, "grad_clip": 0.5, "seed": 7},
    "parallel": {"bucket_mb": 0.02},
}
KV1 = {"model": {"num_key_value_heads": 1}}
DOCS = {"model": {"vocab_size": 16}, "data": {"document_mask": True, "eos_id": 3}}
REFS = {"ref": {}, "ref_kv1": KV1, "ref_docs": DOCS}
VARIANTS = {  # name -> (overrides, reference, ranks)
    "cp2_ring": ({"parallel": {"cp": 2, "cp_attention": "ring"}}, "ref", 2),
    "cp2_ring_kv1_selective": ({"parallel": {"cp": 2, "cp_attention": "ring"}, "train": {"recompute": "selective"},
                                **KV1}, "ref_kv1", 2),
    "cp2_ulysses": ({"parallel": {"cp": 2, "cp_attention": "ulysses"}}, "ref", 2),
    "cp2_ulysses_kv1": ({"parallel": {"cp": 2, "cp_attention": "ulysses"}, **KV1}, "ref_kv1", 2),
    "cp2_ring_docs": (_merge(DOCS, {"parallel": {"cp": 2, "cp_attention": "ring"}}), "ref_docs", 2),
    "cp2_ulysses_docs_offload_chunked": (_merge(DOCS, {"parallel": {"cp": 2, "cp_attention": "ulysses"},
                                                       "train": {"offload_activations": True, "loss_chunk": 24}}),
                                         "ref_docs", 2),
    "cp2_allgather_docs": (_merge(DOCS, {"parallel": {"cp": 2}}), "ref_docs", 2),
    # cp 4: one kv head repeated for four ranks; ring with four hops, document masks and blocks
    # recomputed in backward (which read the documents of their forward again).
    "cp4_ulysses_kv1": ({"parallel": {"cp": 4, "cp_attention": "ulysses"}, **KV1}, "ref_kv1", 4),
    "cp4_ring_docs_full_recompute": (_merge(DOCS, {"parallel": {"cp": 4, "cp_attention": "ring"},
                                                   "train": {"recompute": "full"}}), "ref_docs", 4),
    # hybrid: Ulysses inside pairs of cp ranks, ring across the two pairs; one kv head repeated
    # for the pair, and document masks through both axes.
    "cp4_hybrid_kv1": ({"parallel": {"cp": 4, "cp_attention": "hybrid", "cp_ulysses": 2}, **KV1}, "ref_kv1", 4),
    "cp4_hybrid_docs": (_merge(DOCS, {"parallel": {"cp": 4, "cp_attention": "hybrid", "cp_ulysses": 2}}),
                        "ref_docs", 4),
    "cp4_allgather": ({"parallel": {"cp": 4}}, "ref", 4),
}


OFFLOADED = "cp2_ulysses_docs_offload_chunked"


def _without_streams(b):
    """``b`` declaring no streams: activation offload copies synchronously (parallel/offload.py)."""
    return dataclasses.replace(b, capabilities=dataclasses.replace(b.capabilities, streams=False))


def _run(b, overrides: dict) -> dict:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(_merge(BASE, overrides)).validate(world_size=b.collective.world_size())
    res = train(cfg, b, None, out=io.StringIO(), keep_params=True)
    return {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics], "params": res.params}


# The memory check: 4096 tokens on 2 cp ranks with ring attention, offload, a chunked loss and document
# masks (the long-context example, shortened): the offloaded attention's backward is the step's peak.
MEMORY = {
    "model": {"vocab_size": 2048, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 172, "max_position_embeddings": 4096},
    "parallel": {"cp": 2, "cp_attention": "ring"},
    "train": {"steps": 1, "global_batch": 1, "seq_len": 4096, "loss_chunk": 256, "offload_activations": True},
    "data": {"document_mask": True, "eos_id": 0},
}


def _peaks(b) -> list[int]:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(MEMORY).validate(world_size=b.collective.world_size())
    return train(cfg, b, None, out=io.StringIO()).metrics[-1]["peak_memory_bytes_per_rank"]


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    world = b.collective.world_size()
    todo = REFS if mode == "ref" else {k: over for k, (over, _, n) in VARIANTS.items() if n == world}
    got = {"memory": _peaks(b)} if world == 2 else {}  # first: nothing left by earlier runs
    if world == 2:
        got["offload_synchronous"] = _run(_without_streams(b), VARIANTS[OFFLOADED][0])
    multirank.finish(b, {**got, **{name: _run(b, over) for name, over in todo.items()}}, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(4)
    got = multirank.run_jobs(HERE, [{"w2": 2, "w4": 4, "ref": 1}], tmp_path_factory.mktemp("longctx"))
    return {**got["w2"], **got["w4"]}, got["ref"]


N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])


@pytest.mark.multirank
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_long_context_layout_equals_single_process(runs, variant):
    got, ref = runs
    mine, want = got[variant], ref[VARIANTS[variant][1]]
    parity.assert_losses_close(mine["losses"], want["losses"], n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(mine["grad_norms"], want["grad_norms"], n=N_REDUCE, depth=DEPTH)
    parity.assert_params_within_adam_bound(mine["params"], want["params"], lrs=[BASE["train"]["lr"]] * STEPS,
                                           beta1=0.9, beta2=0.95)
    assert want["losses"][-1] < want["losses"][0] - 0.05  # it learned: equality is not vacuous


@pytest.mark.multirank
def test_offload_on_a_side_stream_equals_synchronous_copies(runs):
    """The cp offload variant copies on a side stream where the backend declares streams (cpu_sim
    does); the same run with streams declared off copies synchronously: bit-identical (copies only)."""
    import chipset

    if not chipset.backend().capabilities.streams:
        pytest.skip("the backend declares no streams: both runs copy synchronously")
    got, want = runs[0][OFFLOADED], runs[0]["offload_synchronous"]
    assert got["losses"] == want["losses"] and got["grad_norms"] == want["grad_norms"]
    assert all(torch.equal(got["params"][n], want["params"][n]) for n in want["params"])


@pytest.mark.multirank
def test_offloaded_long_context_peak_memory_is_predicted_within_10_percent(runs):
    """cpu_sim's measured peak on each rank against the planner (chipset.planner.run) plus the rotary
    tables the model keeps for max_position_embeddings (cos and sin, float32), which the launcher adds
    too. The peak is the ring attention's backward of an offloaded block: its saved tensors back on the
    device, its working set and score tiles; counting the whole block's saved tensors back at once
    (the model before) predicts +23%."""
    import chipset
    from chipset.planner.run import peak_memory_per_rank
    from chipset.train.config import RunConfig

    if chipset.backend().name != "cpu_sim":
        pytest.skip("exact memory accounting is cpu_sim's")
    got = runs[0]["memory"]
    m = MEMORY["model"]
    tables = 2 * 4 * m["max_position_embeddings"] * (m["hidden_size"] // m["num_attention_heads"])
    pred = peak_memory_per_rank(RunConfig.from_dict(MEMORY).validate(world_size=2), 2)
    assert pred[0].phase == "block backward"
    for rank, (g, p) in enumerate(zip(got, pred, strict=True)):
        err = (p.total + tables) / g - 1
        assert abs(err) <= 0.10, f"rank {rank}: predicted {(p.total + tables) / 2**20:.2f} MiB, measured {g / 2**20:.2f} MiB ({err:+.1%})"


# --------------------------------------------------------------------------------------
# One process: document masks, chunked loss, offload
# --------------------------------------------------------------------------------------


def _model(vocab=16, **over):
    from chipset.kernels import KernelRegistry
    from chipset.models.config import ModelConfig
    from chipset.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, **over)
    return Transformer(cfg, KernelRegistry("reference"), seed=3)


def test_packed_window_loss_is_the_token_weighted_mean_of_its_documents():
    """Each document of a packed window, run alone from position 0, gives the same per-token
    losses as inside the window with data.document_mask: the window's mean is their
    token-weighted mean. Bound: fp32 reductions of the window's longest sum (tests/parity.py)."""
    from chipset.kernels import KernelRegistry

    eos = 3
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 16, (1, 25), generator=g)
    tokens[0, [6, 13, 14]] = eos  # documents [0:7], [7:14], [14:15], [15:25]
    targets = torch.randint(0, 16, (1, 25), generator=g)
    model = _model()
    model.document_eos = eos
    packed = model.loss(tokens, targets).detach()
    model.document_eos = None
    parts = [(0, 7), (7, 14), (14, 15), (15, 25)]
    weighted = sum(model.loss(tokens[:, a:b], targets[:, a:b]).detach() * (b - a) for a, b in parts) / 25
    tol = parity.reduction_rtol(25 * 64, parity.model_depth(2))
    assert abs(float(packed) - float(weighted)) <= tol * abs(float(weighted)), (float(packed), float(weighted))
    unmasked = model.loss(tokens, targets).detach()  # attending across documents: outside the bound
    assert abs(float(unmasked) - float(weighted)) > tol * abs(float(weighted))
    assert KernelRegistry("reference").backend == "reference"


def test_document_positions_restart_after_each_end_of_document():
    from chipset.layers.documents import document_ids, document_positions

    t = torch.tensor([[5, 3, 7, 7, 3, 3, 9]])
    docs = document_ids(t, 3)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def _loss_and_grads(model, tokens, targets):
    model.zero_grad()
    loss = model.loss(tokens, targets)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_chunked_loss_and_offloaded_activations_equal_the_plain_step():
    """train.loss_chunk: the loss and every gradient of the chunked head equal the unchunked
    ones within fp32 reduction order; train.offload_activations: bit-identical (copies only)."""
    import chipset
    from chipset.parallel.offload import apply_offload

    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 24), generator=g), torch.randint(0, 64, (2, 24), generator=g)
    model = _model(vocab=64)
    want_loss, want = _loss_and_grads(model, tokens, targets)
    model.loss_chunk = 10  # 5 columns of 2 sequences per chunk: uneven last chunk
    got_loss, got = _loss_and_grads(model, tokens, targets)
    tol = parity.reduction_rtol(48 * 64, parity.model_depth(2))
    assert abs(got_loss - want_loss) <= tol * abs(want_loss)
    for n in want:
        scale = float(want[n].abs().max())
        assert float((got[n] - want[n]).abs().max()) <= tol * scale, n

    model.loss_chunk = 0
    apply_offload(list(model.layers), chipset.backend().memory)
    off_loss, off = _loss_and_grads(model, tokens, targets)
    assert off_loss == want_loss and all(torch.equal(off[n], want[n]) for n in want)


@pytest.mark.parametrize(("over", "expect"), [
    ({"train": {"loss_chunk": -1}}, "train.loss_chunk = -1: expected a number of tokens >= 0"),
    ({"data": {"document_mask": True}}, "data.document_mask needs the end-of-document id: set data.eos_id"),
    ({"parallel": {"cp": 2, "pp": 2}, "train": {"offload_activations": True}},
     "train.offload_activations needs parallel.pp = 1 (found 2)"),
    ({"parallel": {"cp": 3, "cp_attention": "ulysses"}, "train": {"seq_len": 36}},
     "heads per tp rank (4/1) must be divisible by cp (3)"),
    ({"parallel": {"cp": 4, "cp_attention": "hybrid"}},
     "parallel.cp_attention = 'hybrid' needs parallel.cp_ulysses, the Ulysses degree, to be a divisor of cp (4) "
     "between 2 and cp/2 (found 0)"),
    ({"parallel": {"cp": 4, "cp_attention": "ring", "cp_ulysses": 2}},
     "parallel.cp_ulysses = 2 applies only with cp_attention = 'hybrid' (found 'ring')"),
    ({"parallel": {"cp": 6, "cp_attention": "hybrid", "cp_ulysses": 3}, "train": {"seq_len": 36}},
     "heads per tp rank (4/1) must be divisible by cp_ulysses (3)"),
], ids=["negative_chunk", "no_eos", "pp", "ulysses_heads", "hybrid_no_degree", "ulysses_degree_not_hybrid",
        "hybrid_heads"])
def test_long_context_keys_refuse_what_they_cannot_do(over, expect):
    from chipset.errors import ConfigError
    from chipset.train.config import RunConfig

    with pytest.raises(ConfigError, match=re.escape(expect)):
        RunConfig.from_dict(_merge(BASE, over)).validate(world_size=None)


def test_context_plan_recommends_the_savers_only_when_memory_needs_them():
    """planner/context.py on the example's model: a roomy device takes the plainest fastest
    layout; a device that the plain layouts exceed gets offload and a chunked loss."""
    from chipset.planner.cluster import resolve_cluster
    from chipset.planner.context import context_layouts
    from chipset.planner.layout import TrainSpec
    from chipset.planner.model import ModelSpec

    m = ModelSpec(name="t", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=172, vocab=2048, seq_len=32768,
                  kernels="reference", flash_attention=False).validate()
    train = TrainSpec(global_batch=1, dtype="float32", param_bytes=4, grad_bytes=4)
    roomy = context_layouts(m, train, resolve_cluster("1x2:sim-generic"), 32768)[0]
    assert roomy.fits and not roomy.layout.offload_activations and not roomy.layout.loss_chunk
    tight = context_layouts(m, train, resolve_cluster("1x2:sim-small"), 32768)
    best = tight[0]
    assert best.fits and best.layout.cp == 2, best.layout
    plain = [p for p in tight if not p.layout.offload_activations and not p.layout.loss_chunk]
    assert plain and not any(p.fits for p in plain)


def test_hybrid_plan_keeps_ulysses_inside_a_node_and_rings_across():
    """planner/comm.py on 2 nodes of 4: a hybrid cp of 8 as 4 Ulysses x 2 ring all-to-alls over the
    node's fast links and passes K/V between nodes; Ulysses over all 8 would all-to-all across nodes.
    The context plan offers the hybrid where the heads divide by its Ulysses degree."""
    from chipset.planner.cluster import resolve_cluster
    from chipset.planner.comm import communication
    from chipset.planner.context import context_layouts
    from chipset.planner.layout import Layout, TrainSpec
    from chipset.planner.model import ModelSpec

    m = ModelSpec(name="t", layers=4, hidden=512, heads=8, kv_heads=2, ffn_hidden=1376, vocab=2048,
                  seq_len=65536).validate()
    train = TrainSpec(global_batch=2)
    cl = resolve_cluster("2x4:sim-generic")
    hybrid = Layout(cp=8, cp_attention="hybrid", cp_ulysses=4).check()
    cp = {i.op: i for i in communication(m, hybrid, train, cl) if i.dim == "cp"}
    assert (cp["all_to_all"].group_size, cp["all_to_all"].intra_node) == (4, True)
    assert (cp["all_gather"].group_size, cp["all_gather"].intra_node) == (2, False)
    ulysses = [i for i in communication(m, Layout(cp=8, cp_attention="ulysses").check(), train, cl) if i.dim == "cp"]
    assert [(i.op, i.group_size, i.intra_node) for i in ulysses] == [("all_to_all", 8, False)]
    offered = {(p.layout.cp, p.layout.cp_ulysses) for p in context_layouts(m, train, cl, 65536)
               if p.layout.cp_attention == "hybrid"}
    assert offered == {(4, 2), (8, 2), (8, 4)}


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
