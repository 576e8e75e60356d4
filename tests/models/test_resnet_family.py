"""The built-in ResNet family (chipset.models.resnet): a non-transformer model through the contract.

Parallel runs (`chipset train --nproc 2`, dp and ZeRO-3) must equal one process within the
fp32 reduction-order bounds of tests/parity.py, and the same check must reject a run whose
gradients are summed over the ranks instead of averaged (the family below, selected by
``module:factory`` from this file, injects exactly that fault).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import forked_cli
import parity
from chipset.models.resnet import IMAGE_SIZE, ResNetFamily, SyntheticImages
from chipset.train.config import load_config
from testenv import SideBySide, chipset_train, family_env, selected

HERE = Path(__file__).resolve().parent

WIDTH, BLOCKS, CLASSES, BATCH, STEPS = 4, 2, 5, 8, 3
SIZE = [f"model.hidden_size={WIDTH}", f"model.num_hidden_layers={BLOCKS}", f"model.num_classes={CLASSES}"]

# Longest single reduction: a convolution weight's gradient sums over batch x image positions.
# Longest chain, forward: stem conv and GroupNorm (2), per block conv, norm, conv, norm (4),
# average pool, head, log-sum-exp, mean (4); the backward walks it again, plus the weight sum.
N_REDUCE = BATCH * IMAGE_SIZE * IMAGE_SIZE
DEPTH = 2 * (2 + 4 * BLOCKS + 4) + 1


def _cfg(*sets: str):
    return load_config(None, ['model.family="resnet"', *SIZE, *sets])


def test_flops_per_sample_equals_what_torch_counts():
    """The family's closed form (used for MFU) equals torch's FLOP counter on one training step."""
    cfg = _cfg()
    fam = ResNetFamily()
    model = fam.build(cfg)
    x, y = fam.data(cfg).batch(0)
    with FlopCounterMode(display=False) as counter:
        fam.loss(model, x, y).backward()
    assert fam.flops_per_sample(cfg) == counter.get_total_flops() / x.shape[0]


def test_full_recompute_runs_each_block_again_in_backward_with_equal_gradients():
    """train.recompute = "full" for a family: each block's forward runs a second time in
    backward (its activations were not kept) and the gradients are those of a plain step."""
    from chipset.parallel.recompute import apply_recompute

    cfg = _cfg()
    fam = ResNetFamily()
    x, y = fam.data(cfg).batch(0)
    grads, runs = [], []
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = fam.build(cfg)
        count = [0]
        for block in fam.blocks(model):
            original = block.forward

            def counted(*a, _f=original, _count=count, **k):
                _count[0] += 1
                return _f(*a, **k)

            block.forward = counted
        apply_recompute(model, mode=mode, family=fam)
        fam.loss(model, x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        runs.append(count[0])
    units = len(fam.blocks(model))
    assert runs == [units, 2 * units]
    for n, g in grads[0].items():
        assert torch.equal(grads[1][n], g), n


def test_images_are_the_same_on_every_layout():
    """Two dp ranks' shares, concatenated, are the one-process batch; another seed differs."""
    data = SyntheticImages(CLASSES, BATCH, seed=3)
    x1, y1 = data.batch(2)
    halves = [data.batch(2, dp_rank=r, dp=2) for r in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x1)
    assert torch.equal(torch.cat([h[1] for h in halves]), y1)
    micro = [data.batch(2, dp_rank=1, dp=2, micro=m, micro_batches=2)[0] for m in (0, 1)]
    assert torch.equal(torch.cat(micro), halves[1][0])
    assert x1.shape == (BATCH, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert not torch.equal(SyntheticImages(CLASSES, BATCH, seed=4).batch(2)[0], x1)


class _SumOverRanks(torch.autograd.Function):
    """Identity forward; backward multiplies by the world size: the engine's average over dp
    ranks then becomes a sum (the fault the parity check must catch)."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return grad * world


class SummedGradients(ResNetFamily):
    def loss(self, model, inputs, targets):
        return _SumOverRanks.apply(super().loss(model, inputs, targets))


def summed_gradients() -> SummedGradients:
    return SummedGradients()


def _train(run_dir: Path, nproc: int, *sets: str, family: str = "resnet", cwd=None) -> subprocess.CompletedProcess:
    args = [f'model.family="{family}"', *SIZE, f"train.steps={STEPS}", f"train.global_batch={BATCH}",
            "train.lr=0.01", "train.checkpoint_every=0", *sets]
    return chipset_train(run_dir, nproc, args, env=family_env(str(HERE)), timeout=600, cwd=cwd)


# The parallel layouts, each against the one-process reference. ZeRO-3 alone is not a layout
# of its own: it is under both zero3-recompute and dp2-pp2-zero3 (it was, beside them, one
# more 2-rank job testing the same sharding).
LAYOUTS = {
    "dp2": (2, ("parallel.zero=0",), {"dp": 2, "zero": 0}),
    # Pipeline stages cut from the chain stem, block 0, block 1, head (2 micro-batches).
    "pp2": (2, ("parallel.pp=2", "parallel.micro_batches=2"), {"dp": 1, "pp": 2}),
    "dp2-pp2-zero3": (4, ("parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=3"), {"dp": 2, "pp": 2, "zero": 3}),
    "zero3-recompute": (2, ("parallel.zero=3", 'train.recompute="full"'), {"dp": 2, "zero": 3}),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The jobs of this file's multi-rank tests that this session runs, side by side
    (testenv.SideBySide): {key: (CompletedProcess, run directory)}; "ref" is the one-process
    reference of the layouts and the negative control."""
    root = tmp_path_factory.mktemp("runs")

    def job(key, nproc, *sets, **kw):
        return lambda: (_train(root / key, nproc, *sets, **kw), root / key)

    jobs = {}
    layouts = selected(request, test_parallel_runs_match_one_process)
    if layouts or selected(request, test_parity_check_rejects_summed_gradients):
        jobs["ref"] = job("ref", 1)
    if selected(request, test_parity_check_rejects_summed_gradients):
        # From this directory with it on PYTHONPATH, as ``PYTHONPATH=. chipset train`` would.
        jobs["summed"] = job("summed", 2, family="test_resnet_family:summed_gradients", cwd=HERE)
    for key in sorted(layouts, key=lambda k: -LAYOUTS[k][0]):  # the 4-rank job first
        nproc, sets, _ = LAYOUTS[key]
        jobs[key] = job(key, nproc, *sets)
    if selected(request, test_image_folder_trains_on_two_ranks_like_one_process):
        folder = root / "imgs"
        sets = ('data.source="images"', f'data.path="{folder}"', "model.num_classes=3")

        def images():  # one process, then ZeRO-3 on two ranks, over the same folder
            _image_folder(folder)
            return [(_train(root / k, n, *sets, *extra), root / k) for k, n, extra in
                    [("img-one", 1, ()), ("img-two", 2, ("parallel.zero=3",))]]

        jobs["images"] = images
    started = SideBySide(jobs)
    yield started
    started.close()


def _reference(runs):
    r, run = runs["ref"]
    assert r.returncode == 0, r.stderr[-3000:]
    return parity.run_metrics(run)


@pytest.mark.multirank
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_parallel_runs_match_one_process(runs, key):
    reference = _reference(runs)
    r, run = runs[key]
    assert r.returncode == 0, r.stderr[-3000:]
    parity.assert_run_matches(run, reference, n=N_REDUCE, depth=DEPTH, layout=LAYOUTS[key][2])


@pytest.mark.multirank
def test_parity_check_rejects_summed_gradients(runs):
    """Negative control: gradients summed over the 2 ranks fail the same check at step 0.

    Run from this directory with it on PYTHONPATH, as ``PYTHONPATH=. chipset train`` would:
    the ranks start with PYTHONSAFEPATH=1, so their first sys.path entry is that PYTHONPATH
    entry and must not be dropped as if ``python -m`` had put the current directory there
    (before the fix every rank failed with "No module named 'test_resnet_family'")."""
    reference = _reference(runs)
    r, run = runs["summed"]
    assert r.returncode == 0, r.stderr[-3000:]
    losses, norms = parity.run_metrics(run)
    assert losses[0] == pytest.approx(reference[0][0], rel=parity.trajectory_rtol(N_REDUCE, DEPTH, 0))
    with pytest.raises(AssertionError, match="gradient norm at step 0"):
        parity.assert_grad_norms_close(norms, reference[1], n=N_REDUCE, depth=DEPTH)


def test_listed_as_built_in_and_counted_for_mfu(tmp_path):
    """`chipset models` lists it; a run on a backend that declares its peak reports MFU from
    the family's flops_per_sample (samples/s x FLOPs per sample / peak)."""
    env = family_env(str(HERE))
    listed = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "models", "--json"],
                            capture_output=True, text=True, env=env, timeout=300)
    fams = {f["name"]: f for f in json.loads(listed.stdout)["families"]}
    assert fams["resnet"]["source"] == "built-in" and fams["resnet"]["layouts"] == ["dp", "pp", "zero1", "zero2", "zero3"]
    env["CHIPSET_BACKEND"] = "cpu_sim"
    run = tmp_path / "run"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--run-dir", str(run),
                        *[a for s in [*SIZE, 'model.family="resnet"', "train.steps=2", "train.checkpoint_every=0"]
                          for a in ("--set", s)]], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mfu" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    cfg = _cfg()
    assert summary["model_flops_per_token"] * cfg.train.seq_len == pytest.approx(ResNetFamily().flops_per_sample(cfg))
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    peak = summary["devices"]["peak_flops"][cfg.train.dtype]
    samples_per_s = rec["tokens_per_s"] / cfg.train.seq_len
    assert rec["mfu"] == pytest.approx(samples_per_s * ResNetFamily().flops_per_sample(cfg) / peak)


@pytest.mark.parametrize("sets, expected", [
    (("parallel.tp=2",), "model family 'resnet' does not support tp"),
    (("parallel.pp=2", 'parallel.pipeline_split="1,2"'),
     "parallel.pipeline_split = '1,2' sums to 3 units, expected the model's 4 pipeline units"),
    (("parallel.pp=2", "parallel.virtual_stages=4", 'parallel.schedule="interleaved_1f1b"', "parallel.micro_batches=2"),
     "pp*virtual_stages (8) exceeds the model's 4 pipeline units (stem, blocks.0, blocks.1, head)"),
    (('data.source="text"', 'data.path="corpus.txt"', "model.vocab_size=256"), "model family 'resnet' trains on images, synthetic or from a folder"),
    # the family's own [model] keys (ResNetConfig): checked by name, type and value before launch
    (("model.num_clases=3",), "model.num_clases: unknown key (value 3) (did you mean 'num_classes'?)"),
    (('model.num_classes="ten"',), "model.num_classes"),
    (("model.num_classes=1",), "model family 'resnet' refuses its keys: model.num_classes = 1: a classifier needs at least 2 classes"),
])
def test_unsupported_layouts_are_refused_before_launch(tmp_path, sets, expected):
    run = tmp_path / "run"
    r = _train(run, 2, *sets)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert expected in r.stderr
    assert not run.exists()


# --- data.source = "images": a folder of class sub-folders ------------------------------------

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}


def _image_folder(root: Path) -> Path:
    """Three classes of six noisy solid-colour images, two sizes (resized on load), plus files
    that are not images (ignored)."""
    Image = pytest.importorskip("PIL.Image")
    gen = torch.Generator().manual_seed(0)
    for name, rgb in COLOURS.items():
        (root / name).mkdir(parents=True)
        for i in range(6):
            side = 16 if i % 2 else 24
            px = (torch.tensor(rgb).view(1, 1, 3) + 40 * torch.randn(side, side, 3, generator=gen)).clamp(0, 255)
            Image.fromarray(px.to(torch.uint8).numpy(), "RGB").save(root / name / f"{i:03d}.png")
    (root / "README.txt").write_text("not a class")
    (root / "red" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_labels_by_sorted_folder_and_shares_batches_across_layouts(tmp_path):
    from chipset.models.resnet import ImageFolder

    data = ImageFolder(_image_folder(tmp_path / "imgs"), global_batch=6, seed=1)
    assert data.classes == ["blue", "green", "red"] and len(data) == 18
    x, y = data.batch(4)  # step 4 crosses into the second epoch (18 images, 6 per step)
    assert x.shape == (6, 3, IMAGE_SIZE, IMAGE_SIZE) and -1 <= float(x.min()) and float(x.max()) <= 1
    for img, label in zip(x, y, strict=True):  # each image's strongest channel is its folder's colour
        assert int(img.mean(dim=(1, 2)).argmax()) == {"red": 0, "green": 1, "blue": 2}[data.classes[label]]
    halves = [data.batch(4, dp_rank=r, dp=2) for r in (0, 1)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
    epoch = torch.cat([data.batch(s)[1] for s in range(3)])  # one epoch: every image exactly once
    assert sorted(epoch.tolist()) == sorted(data.labels.tolist())


@pytest.mark.multirank
def test_image_folder_trains_on_two_ranks_like_one_process(runs):
    """One process and ZeRO-3 on two ranks over the same image folder (the runs fixture)."""
    (r1, one), (r, two) = runs["images"]
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = parity.run_metrics(one), parity.run_metrics(two)
    # Longest reduction: a convolution weight's gradient over batch x image positions, as above.
    parity.assert_losses_close(got[0], want[0], n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(got[1], want[1], n=N_REDUCE, depth=DEPTH)


def test_image_folder_problems_are_refused_before_launch(tmp_path):
    folder = _image_folder(tmp_path / "imgs")
    cases = [
        (("model.num_classes=5",), "model.num_classes (5) is the number of classes, and data.path has 3 class "
                                  "folders (blue, green, red); set model.num_classes = 3"),
        (("model.num_classes=3", f'data.path="{tmp_path / "nope"}"'), "expected a folder with one sub-folder"),
    ]
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    cases.append((("model.num_classes=2", f'data.path="{tmp_path / "empty"}"'), "class folder(s) cats hold no image"))
    for extra, expected in cases:
        run = tmp_path / "run"
        r = _train(run, 1, 'data.source="images"', f'data.path="{folder}"', *extra)
        assert r.returncode == 2, r.stderr[-2000:]
        assert expected in r.stderr
        assert not run.exists()
    (folder / "green" / "broken.png").write_bytes(b"not a png")
    r = _train(tmp_path / "run", 1, 'data.source="images"', f'data.path="{folder}"', "model.num_classes=3")
    assert r.returncode == 2 and "broken.png is not a readable image" in r.stderr, r.stderr[-2000:]


def test_evaluation_reports_loss_and_accuracy_on_held_out_images(tmp_path):
    """A classifier family evaluates (train.eval_every): eval_loss and eval_accuracy of the final
    model on held-out samples no step trained on, equal to computing them by hand; samples/s."""
    from chipset import api
    from chipset.models.resnet import ResNet
    from chipset.train import train

    cfg = _cfg("train.steps=4", "train.eval_every=4", "train.eval_steps=2", "train.global_batch=8")
    b = api.init(cfg)
    try:
        res = train(cfg, b, tmp_path / "run", keep_params=True)
    finally:
        api.shutdown(b)
    last = res.metrics[-1]
    assert "eval_ppl" not in last and res.summary["throughput_unit"] == "samples"
    fam = ResNetFamily()
    model = ResNet(cfg.model.hidden_size, cfg.model.num_hidden_layers, fam.options(cfg).num_classes)
    model.load_state_dict(res.params)
    model.eval()
    held = fam.eval_data(cfg)
    train_x, _ = fam.data(cfg).batch(0)
    x0, _ = held.batch(0)
    assert not any(torch.equal(a, t) for a in x0 for t in train_x), "held-out samples are not training samples"
    with torch.no_grad():
        batches = [held.batch(i) for i in range(2)]
        right = sum(int((model(x).argmax(-1) == y).sum()) for x, y in batches)
        loss = sum(float(torch.nn.functional.cross_entropy(model(x), y)) for x, y in batches) / 2
    assert last["eval_accuracy"] == right / 16
    # fp32 cross-entropy of 8 samples, averaged twice: a few ulps of a number near 1
    assert last["eval_loss"] == pytest.approx(loss, rel=64 * torch.finfo(torch.float32).eps)
