"""Tolerances for "a parallel run equals one process", derived instead of tuned.

Two fp32 runs of the same model on the same global batch differ only in the order of
floating-point reductions (a 2-rank average of half-batch gradients vs one mean, split
matmuls under tp, stage-wise norm partial sums under pp). These helpers turn that into
bounds that hold on any IEEE-754 CPU (AVX2, AVX-512, NEON: only the order and the
blocking of sums change) and still fail on a wrong reduction (see the negative controls
in tests/runtime/test_engine_parity.py).

Three checks, from tight to loose:

* per-step losses (``assert_losses_close``) and per-step global gradient norms
  (``assert_grad_norms_close``) with ``trajectory_rtol``: rounding of reductions, tight;
* parameters after several AdamW steps (``assert_params_within_adam_bound``): the
  worst case AdamW allows, loose on purpose (AdamW's update of an element with a ~0
  gradient is ``lr * g / (|g| + eps)``, so last-bit noise in ``g`` can move it by up to
  lr). Alone it would not catch a bug; the trajectory checks do.

A gradient summed instead of averaged leaves AdamW's update almost unchanged (AdamW is
invariant to the gradient's scale), so only the gradient-norm check can see it; a dropped
rank changes the gradient's direction and norm, so both trajectory checks see it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: spacing of fp32 numbers near 1


def run_metrics(run_dir: Path) -> tuple[list[float], list[float]]:
    """Per-step losses and gradient norms of a ``chipset train`` run (its metrics.jsonl)."""
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs], [r["grad_norm"] for r in recs]


def assert_run_matches(run_dir: Path, reference: tuple[list[float], list[float]], *, n: int, depth: int,
                       layout: dict[str, int]) -> None:
    """A ``chipset train`` run in ``run_dir`` equals the one-process ``reference`` (its
    ``run_metrics``) step by step, the reference really trained, and the run used ``layout``
    (keys of summary.json's layout, e.g. ``{"dp": 2, "pp": 2}``)."""
    losses, norms = run_metrics(run_dir)
    assert_losses_close(losses, reference[0], n=n, depth=depth)
    assert_grad_norms_close(norms, reference[1], n=n, depth=depth)
    assert reference[0][-1] < reference[0][0], "the reference run did not train (its loss did not fall)"
    got = json.loads((Path(run_dir) / "summary.json").read_text())["layout"]
    assert {k: got[k] for k in layout} == layout, got


def reduction_rtol(n: int, depth: int) -> float:
    """Relative error of one forward/backward pass whose longest chain has ``depth`` reductions of <= ``n`` terms.

    One sum of n fp32 terms in any order (sequential, pairwise, blocked SIMD) has a
    relative error of at most (n-1)*u (u = eps/2), and in practice (rounding errors are
    independent and zero-mean: Higham & Mary, 2019) about sqrt(n)*u. Two orders of the
    same sum differ by at most twice that: sqrt(n)*eps. Errors of chained reductions
    (matmul -> norm -> matmul ... -> log-sum-exp -> mean) add to first order, hence
    ``depth``. The absolute-value / condition factors are ~1 here: losses and norms are
    sums of positive terms.
    """
    return depth * math.sqrt(n) * EPS32


def trajectory_rtol(n: int, depth: int, step: int) -> float:
    """Allowed relative difference of a loss or gradient norm at ``step`` (0-based).

    Step 0 sees only the reduction order: ``reduction_rtol``. Each further step adds
    one pass's rounding, and the previous difference is carried on by a map that is
    close to the identity (few steps of a small lr: the Jacobian of one update is
    I - lr*H with lr*|H| << 1), so differences add: (step + 1) * reduction_rtol. AdamW's
    amplified elements (see the module docstring) do not enter to first order: they are
    the ones whose gradient is ~0, so they change the loss by ~ |g| * lr ~ 0.
    """
    return (step + 1) * reduction_rtol(n, depth)


def _assert_trajectory(what: str, got: list[float], want: list[float], n: int, depth: int,
                       first_step: int = 0) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} steps, reference has {len(want)}"
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=first_step):
        tol = trajectory_rtol(n, depth, step)
        rel = abs(g - w) / abs(w)
        assert rel <= tol, (f"{what} at step {step}: {g!r} vs reference {w!r}, relative difference "
                            f"{rel:.2e} > {tol:.2e} allowed (fp32 reductions of <= {n} terms, depth {depth})")


def assert_losses_close(got: list[float], want: list[float], *, n: int, depth: int, first_step: int = 0) -> None:
    """Per-step losses within ``trajectory_rtol``; ``got[0]`` is step ``first_step`` (0-based)."""
    _assert_trajectory("loss", got, want, n, depth, first_step)


def assert_grad_norms_close(got: list[float], want: list[float], *, n: int, depth: int) -> None:
    """Per-step global gradient norms (before clipping) within ``trajectory_rtol``.

    The tight gradient check: the norm at step 0 is a function of the first gradient
    only, so a gradient scaled by the dp degree or missing one rank's part shows here
    even where AdamW's scale invariance hides it from losses and parameters.
    """
    _assert_trajectory("gradient norm", got, want, n, depth)


def adam_step_bound(t: int, beta1: float, beta2: float) -> float:
    """Largest |m_hat / sqrt(v_hat)| AdamW can produce at step ``t`` (1-based), any gradients.

    With m_hat = sum_i a_i g_i / (1 - beta1^t), a_i = (1-beta1) beta1^(t-i), and
    v_hat = sum_i b_i g_i^2 / (1 - beta2^t), b_i = (1-beta2) beta2^(t-i), Cauchy-Schwarz
    gives |sum a_i g_i| <= sqrt(sum a_i^2 / b_i) * sqrt(sum b_i g_i^2), so the ratio is at
    most sqrt(sum a_i^2 / b_i) * sqrt(1 - beta2^t) / (1 - beta1^t). (eps only lowers it.)
    At t = 1 this is 1: the first update is lr * sign(g).
    """
    s = sum(((1 - beta1) * beta1 ** (t - i)) ** 2 / ((1 - beta2) * beta2 ** (t - i)) for i in range(1, t + 1))
    return math.sqrt(s) * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)


def adam_param_bound(lrs: list[float], beta1: float, beta2: float, weight_decay: float = 0.0,
                     max_abs_param: float = 0.0) -> float:
    """Largest |difference| of one parameter element between two AdamW runs from the same start.

    Each run moves the element at step t by at most lr_t * (adam_step_bound(t) +
    weight_decay * |p|), in either direction, so two runs drift apart by at most twice
    the sum. This holds whatever the gradients are, so it is the right bound for elements
    whose gradient is rounding noise; it is far too loose to catch a bug by itself.
    """
    return 2 * sum(lr * (adam_step_bound(t, beta1, beta2) + weight_decay * max_abs_param)
                   for t, lr in enumerate(lrs, start=1))


def assert_params_within_adam_bound(got: dict, want: dict, *, lrs: list[float], beta1: float,
                                    beta2: float, weight_decay: float = 0.0) -> None:
    """Every parameter element within ``adam_param_bound`` of the reference (and nothing missing)."""
    assert got.keys() == want.keys(), f"parameters differ: {sorted(got.keys() ^ want.keys())}"
    for k in want:
        a, b = got[k].float(), want[k].float()
        assert a.shape == b.shape, f"{k}: shape {tuple(a.shape)}, reference {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{k}: non-finite values"
        bound = adam_param_bound(lrs, beta1, beta2, weight_decay, float(b.abs().max()))
        diff = float((a - b).abs().max())
        assert diff <= bound, f"{k}: abs diff {diff:.2e} > {bound:.2e}, AdamW's worst case over {len(lrs)} steps"


def model_depth(num_layers: int) -> int:
    """Chained reductions on the longest path of one forward + backward of the tests' decoder.

    Per layer forward: RMSNorm, q/k/v matmul, scores, softmax, scores x V, o_proj, RMSNorm,
    gate/up matmul, down matmul (9); then final norm, lm_head, log-sum-exp, mean (4).
    Backward walks the same chain once more and adds the weight-gradient sum over tokens.
    """
    return 2 * (9 * num_layers + 4) + 1


def model_reduction_size(cfg: dict) -> int:
    """Longest single reduction in the tests' runs: tokens per step, vocab, hidden or intermediate."""
    m, tr = cfg["model"], cfg["train"]
    return max(tr["global_batch"] * tr["seq_len"], m["vocab_size"], m["hidden_size"], m["intermediate_size"])


# --------------------------------------------------------------------------------------
# Mixture of experts: top-k routing is a discontinuity
# --------------------------------------------------------------------------------------
#
# The bounds above assume the two runs follow the same smooth computation. A MoE router
# picks each token's top-k experts: if two router logits are closer than the runs'
# rounding difference, one run may pick another expert (or, with capacity dropping, admit
# tokens in another order), and from then on the runs legitimately differ by far more
# than rounding. So the MoE parity tests measure, in the single-process reference, each
# step's smallest routing margin (``router_margin``) and apply the tight trajectory bounds
# only on the steps where a flip is impossible (``unflippable_steps``); step 0 must be one
# of them (asserted, so the test's seed is a checked choice, not luck). The parameter
# bound (``adam_param_bound``) holds whatever the gradients were, flips included.


def router_margin(x: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, top_k: int) -> float:
    """Smallest gap between neighbouring logits among each token's top k+1, relative to its scale.

    A flip needs two of a token's first k+1 logits to swap order: the k-th and (k+1)-th
    decide the chosen set, the first k decide the admission order under capacity (first
    choices before second choices). ``logits = x @ weight.T`` over the last dim; the
    rounding of a dot product is relative to ``sum_j |x_j| |w_ij|`` (not to the logit, which
    may cancel), so each token's gaps are divided by the largest such sum over its experts.
    Softmax and sigmoid are monotonic, so gaps of logits decide the order of scores too.
    """
    lg = logits.detach().double().reshape(-1, logits.shape[-1])
    scale = (x.detach().double().abs().reshape(-1, x.shape[-1]) @ weight.detach().double().abs().T).amax(-1)
    top = lg.sort(dim=-1, descending=True).values[:, : top_k + 1]
    gaps = (top[:, :-1] - top[:, 1:]).amin(-1)
    return float((gaps / scale.clamp_min(torch.finfo(torch.float64).tiny)).min())


def unflippable_steps(margins: list[float], *, n: int, depth: int) -> int:
    """How many leading steps no correct parallel run can route differently from the reference.

    At step s the two runs' router logits differ by at most ``trajectory_rtol(n, depth, s)``
    times their scale (step 0: identical weights, only the forward's reduction order; then
    the same first-order argument as the losses), so a gap changes by at most twice that.
    A margin above 2 * trajectory_rtol means the same top-k, in the same order, in both.
    ``margins[s]`` is the smallest ``router_margin`` of any MoE layer at step s.
    """
    for s, m in enumerate(margins):
        if m <= 2 * trajectory_rtol(n, depth, s):
            return s
    return len(margins)
