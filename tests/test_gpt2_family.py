"""The GPT-2-style family (chipset.models.gpt2): a second decoder through the contract alone.

It trains under dp x tp x pp (and ZeRO-3 with pp) with no engine code of its own, and each run
equals one process within the fp32 reduction-order bounds of tests/parity.py. The negative
control is a family with a classic tensor-parallel bug (the head count read from the config,
so a rank's half of the heads is viewed as all of them with half the width): the same check
must reject it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import parity
from chipset.models import gpt2
from chipset.train.config import load_config
from testenv import chipset_train, family_env

HERE = Path(__file__).resolve().parent

LAYERS, HIDDEN, HEADS, INNER, VOCAB, SEQ, BATCH, STEPS = 2, 32, 4, 64, 128, 16, 8, 3
SIZE = [f"model.hidden_size={HIDDEN}", f"model.num_hidden_layers={LAYERS}", f"model.num_attention_heads={HEADS}",
        f"model.intermediate_size={INNER}", f"model.vocab_size={VOCAB}", f"train.seq_len={SEQ}"]

# Longest single reduction: the weight gradients' sum over the step's tokens (or the vocab).
N_REDUCE = max(BATCH * SEQ, VOCAB, HIDDEN, INNER)
# Longest chain, forward per block: LayerNorm (mean, variance), q/k/v, scores, softmax,
# scores x V, o_proj, LayerNorm (2), fc_in, fc_out (11); then LayerNorm (2), lm_head,
# log-sum-exp, mean (5). Backward walks it again and adds the weight-gradient sum.
DEPTH = 2 * (11 * LAYERS + 5) + 1


def _cfg(*sets: str):
    return load_config(None, ['model.family="gpt2"', *SIZE, *sets])


def test_flops_per_sample_equals_what_torch_counts():
    cfg = _cfg()
    fam = gpt2.GPT2Family()
    model = fam.build(cfg)
    ids = torch.randint(VOCAB, (2, SEQ))
    # The math kernel: torch's counter has no formula for the fused CPU attention kernel.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fam.loss(model, ids, ids).backward()
    assert fam.flops_per_sample(cfg) == counter.get_total_flops() / 2


def test_pipeline_units_chain_to_the_forward():
    """The contract's promise the engine relies on: the units, applied in turn, are the model."""
    cfg = _cfg()
    fam = gpt2.GPT2Family()
    torch.manual_seed(0)
    model = fam.build(cfg)
    ids = torch.randint(VOCAB, (2, SEQ))
    x = ids
    for unit in fam.pipeline_units(model):
        x = unit(x)
    assert torch.equal(x, model(ids))


class _HeadsFromConfig(torch.nn.Module):
    """Attention that views q, k, v with the configured head count, whatever their width: right
    on one process, wrong under tp (each rank then attends over half-width "heads")."""

    def __init__(self, inner: gpt2.Attention, heads: int):
        super().__init__()
        self.inner, self.heads = inner, heads

    def forward(self, x):
        a, (b, s, _) = self.inner, x.shape

        def split(t):
            return t.view(b, s, self.heads, -1).transpose(1, 2)

        y = torch.nn.functional.scaled_dot_product_attention(split(a.q_proj(x)), split(a.k_proj(x)),
                                                             split(a.v_proj(x)), is_causal=True)
        return a.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class HeadsFromConfig(gpt2.GPT2Family):
    tp_plan = {k.replace("attn.", "attn.inner."): v for k, v in gpt2.GPT2Family.tp_plan.items()}

    def build(self, cfg):
        model = super().build(cfg)
        for block in model.h:
            block.attn = _HeadsFromConfig(block.attn, cfg.model.num_attention_heads)
        return model


def heads_from_config() -> HeadsFromConfig:
    return HeadsFromConfig()


def _train(run_dir: Path, nproc: int, *sets: str, family: str = "gpt2") -> subprocess.CompletedProcess:
    args = [f'model.family="{family}"', *SIZE, f"train.steps={STEPS}", f"train.global_batch={BATCH}",
            "train.lr=0.01", "train.checkpoint_every=0", *sets]
    return chipset_train(run_dir, nproc, args, env=family_env(str(HERE)), timeout=900)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    r = _train(run, 1)
    assert r.returncode == 0, r.stderr[-3000:]
    return parity.run_metrics(run)


@pytest.mark.multirank
@pytest.mark.parametrize("nproc, sets, want", [
    (8, ("parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"), {"dp": 2, "tp": 2, "pp": 2}),
    (4, ("parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=3"), {"dp": 2, "pp": 2, "zero": 3}),
], ids=["dp2-tp2-pp2", "dp2-pp2-zero3"])
def test_parallel_runs_match_one_process(tmp_path, reference, nproc, sets, want):
    r = _train(tmp_path / "run", nproc, *sets)
    assert r.returncode == 0, r.stderr[-3000:]
    parity.assert_run_matches(tmp_path / "run", reference, n=N_REDUCE, depth=DEPTH, layout=want)


@pytest.mark.multirank
def test_a_pipelined_checkpoint_resumes_on_one_process(tmp_path, reference):
    """Saved by two pipeline stages, resumed by one process (resharded by name): the step after
    the resume equals the uninterrupted run's."""
    run = tmp_path / "run"
    r = _train(run, 2, "parallel.pp=2", "parallel.micro_batches=2", "train.steps=2", "train.checkpoint_every=2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(run, 1, "train.checkpoint_every=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    losses, norms = parity.run_metrics(run)
    assert len(losses) == STEPS
    parity.assert_losses_close(losses, reference[0], n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(norms, reference[1], n=N_REDUCE, depth=DEPTH)


@pytest.mark.multirank
def test_parity_check_rejects_heads_read_from_the_config(tmp_path):
    """Negative control: right on one process, wrong under tp = 2. The weights are drawn wider
    (init_std 0.5) so that attention is not uniform at step 0: with near-zero scores every
    head split averages the same values and the bug would hide until training sharpens them."""
    wide, family = "model.init_std=0.5", "test_gpt2_family:heads_from_config"
    r = _train(tmp_path / "one", 1, wide, family=family)
    assert r.returncode == 0, r.stderr[-3000:]
    want = parity.run_metrics(tmp_path / "one")
    r = _train(tmp_path / "tp", 2, wide, "parallel.tp=2", family=family)
    assert r.returncode == 0, r.stderr[-3000:]
    losses, _ = parity.run_metrics(tmp_path / "tp")
    with pytest.raises(AssertionError, match="loss at step 0"):
        parity.assert_losses_close(losses, want[0], n=N_REDUCE, depth=DEPTH)
    # The correct family under the same wide weights passes the same check.
    r = _train(tmp_path / "ok", 2, wide, "parallel.tp=2")
    assert r.returncode == 0, r.stderr[-3000:]
    parity.assert_losses_close(parity.run_metrics(tmp_path / "ok")[0], want[0], n=N_REDUCE, depth=DEPTH)


@pytest.mark.parametrize("sets, expected", [
    (("parallel.tp=8",), "parallel.tp = 8 must divide model.num_attention_heads (4)"),
    (("parallel.cp=2",), "model family 'gpt2' does not support cp"),
    (("train.seq_len=512",), "train.seq_len (512) must be <= model.max_position_embeddings (256)"),
])
def test_unsupported_settings_are_refused_before_launch(tmp_path, sets, expected):
    run = tmp_path / "run"
    r = _train(run, 8 if "tp=8" in sets[0] else 2, *sets)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert expected in r.stderr
    assert not run.exists()
