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
from testenv import SideBySide, chipset_train, family_env, selected

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


LAYOUTS = {
    "dp2-tp2-pp2": (8, ("parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"), {"dp": 2, "tp": 2, "pp": 2}),
    "dp2-pp2-zero3": (4, ("parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=3"), {"dp": 2, "pp": 2, "zero": 3}),
}
# The negative control: right on one process, wrong under tp = 2. The weights are drawn wider
# (init_std 0.5) so that attention is not uniform at step 0: with near-zero scores every head
# split averages the same values and the bug would hide until training sharpens them.
WIDE, HEADS_FROM_CONFIG = "model.init_std=0.5", "test_gpt2_family:heads_from_config"


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The jobs of this file's multi-rank tests that this session runs, side by side
    (testenv.SideBySide): {key: (CompletedProcess, run directory)}; "ref" is the one-process
    reference."""
    root = tmp_path_factory.mktemp("runs")

    def job(key, nproc, *sets, **kw):
        return lambda: (_train(root / key, nproc, *sets, **kw), root / key)

    jobs = {}
    layouts = selected(request, test_parallel_runs_match_one_process)
    if layouts or selected(request, test_a_pipelined_checkpoint_resumes_on_one_process):
        jobs["ref"] = job("ref", 1)
    for key in layouts:
        nproc, sets, _ = LAYOUTS[key]
        jobs[key] = job(key, nproc, *sets)
    if selected(request, test_parity_check_rejects_heads_read_from_the_config):
        jobs["bug-one"] = job("bug-one", 1, WIDE, family=HEADS_FROM_CONFIG)
        jobs["bug-tp"] = job("bug-tp", 2, WIDE, "parallel.tp=2", family=HEADS_FROM_CONFIG)
        jobs["ok-tp"] = job("ok-tp", 2, WIDE, "parallel.tp=2")
    if selected(request, test_a_pipelined_checkpoint_resumes_on_one_process):
        def resumed():  # saved by two pipeline stages, then resumed by one process
            run = root / "resumed"
            saved = _train(run, 2, "parallel.pp=2", "parallel.micro_batches=2", "train.steps=2", "train.checkpoint_every=2")
            return saved, (_train(run, 1, "train.checkpoint_every=2") if saved.returncode == 0 else None), run

        jobs["resumed"] = resumed
    started = SideBySide(jobs)
    yield started
    started.close()


def _ok(runs, key: str) -> Path:
    r, run = runs[key]
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.multirank
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_parallel_runs_match_one_process(runs, key):
    reference = parity.run_metrics(_ok(runs, "ref"))
    parity.assert_run_matches(_ok(runs, key), reference, n=N_REDUCE, depth=DEPTH, layout=LAYOUTS[key][2])


@pytest.mark.multirank
def test_a_pipelined_checkpoint_resumes_on_one_process(runs):
    """Saved by two pipeline stages, resumed by one process (resharded by name): the step after
    the resume equals the uninterrupted run's."""
    reference = parity.run_metrics(_ok(runs, "ref"))
    saved, r, run = runs["resumed"]
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    losses, norms = parity.run_metrics(run)
    assert len(losses) == STEPS
    parity.assert_losses_close(losses, reference[0], n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(norms, reference[1], n=N_REDUCE, depth=DEPTH)


@pytest.mark.multirank
def test_parity_check_rejects_heads_read_from_the_config(runs):
    """Negative control (WIDE, HEADS_FROM_CONFIG above): the buggy family on two tp ranks fails
    the check against itself on one process; the correct family under the same wide weights passes."""
    want = parity.run_metrics(_ok(runs, "bug-one"))
    losses, _ = parity.run_metrics(_ok(runs, "bug-tp"))
    with pytest.raises(AssertionError, match="loss at step 0"):
        parity.assert_losses_close(losses, want[0], n=N_REDUCE, depth=DEPTH)
    # The correct family under the same wide weights passes the same check.
    parity.assert_losses_close(parity.run_metrics(_ok(runs, "ok-tp"))[0], want[0], n=N_REDUCE, depth=DEPTH)


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
