"""Bring your own model: a family defined in THIS file trains through ``chipset train``.

The model below (a tiny CNN with an MLP head on synthetic images) lives outside chipset; the
runs select it with ``model.family = "test_model_family:family"`` and this folder on
PYTHONPATH, exactly as a user's script would be. Parallel runs must equal one process
within the fp32 reduction-order bounds of tests/parity.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch
from torch import nn

import forked_cli
import parity
from chipset.models.family import ModelFamily
from testenv import SideBySide, chipset_train, family_env, selected

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# --- the user's model (not in chipset) --------------------------------------------------

IMAGE, CLASSES, BATCH, STEPS = 8, 5, 16, 4


@dataclass
class TinyCNNConfig:
    """The family's own [model] keys (ModelFamily.config_class): set with --set model.channels=..."""

    channels: int = 2
    hidden: int = 16
    head_hidden: int = 8

    def __post_init__(self):
        if self.channels < 1:
            raise ValueError(f"model.channels = {self.channels}: expected >= 1")


class TinyCNN(nn.Module):
    """A chain of units (conv, fc1, fc2, head) so pipeline stages can be cut from it."""

    def __init__(self, own: TinyCNNConfig):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, own.channels, 3, padding=1), nn.GELU(), nn.Flatten())
        self.fc1 = nn.Sequential(nn.Linear(own.channels * IMAGE * IMAGE, own.hidden), nn.GELU())
        self.fc2 = nn.Sequential(nn.Linear(own.hidden, own.head_hidden), nn.GELU())
        self.head = nn.Linear(own.head_hidden, CLASSES)

    def forward(self, x):
        return self.head(self.fc2(self.fc1(self.conv(x))))


class Images:
    """Synthetic labelled images; sample i is the same whatever the layout."""

    def __init__(self, global_batch: int):
        self.global_batch = global_batch
        self.teacher = torch.randn(CLASSES, 3 * IMAGE * IMAGE, generator=torch.Generator().manual_seed(7))

    def batch(self, step, dp_rank=0, dp=1, micro=0, micro_batches=1, device=None):
        per_rank = self.global_batch // dp
        mb = per_rank // micro_batches
        first = step * self.global_batch + dp_rank * per_rank + micro * mb
        x = torch.stack([torch.randn(3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1000 + first + j))
                         for j in range(mb)])
        y = (x.flatten(1) @ self.teacher.T).argmax(-1)
        return x.to(device), y.to(device)


class CNNFamily(ModelFamily):
    name = "tiny-cnn"
    layouts = frozenset({"dp", "zero1", "zero2", "zero3", "tp", "pp"})
    tp_plan = {"fc1.0": "colwise", "fc2.0": "rowwise"}
    config_class = TinyCNNConfig

    def build(self, cfg):
        return TinyCNN(self.options(cfg))

    def units(self, model):
        return [model.conv, model.fc1, model.fc2, model.head]

    def data(self, cfg):
        return Images(cfg.train.global_batch)


def family() -> CNNFamily:
    return CNNFamily()


# --- the runs ---------------------------------------------------------------------------

# Longest reduction: the conv weight's gradient sums over batch x positions; longest chain:
# conv, fc1, fc2, head, log-sum-exp, mean forward (6), the same backward plus the weight sums.
N_REDUCE = BATCH * IMAGE * IMAGE
DEPTH = 2 * 6 + 1


def _train(run_dir: Path, nproc: int, *sets: str, family_spec: str = "test_model_family:family",
           env: dict | None = None) -> subprocess.CompletedProcess:
    args = [f'model.family="{family_spec}"', f"train.steps={STEPS}", f"train.global_batch={BATCH}", "train.lr=0.01",
            *(OWN if family_spec == "test_model_family:family" else ())]
    return chipset_train(run_dir, nproc, [*args, *sets], env=env or family_env(str(HERE)))


# Every run sets the family's own keys (TinyCNNConfig) from --set, the way a user would.
OWN = ("model.channels=3", "model.hidden=12")
LAYOUTS = {"dp2": ("parallel.zero=0",), "zero3": ("parallel.zero=3",), "tp2": ("parallel.tp=2", "parallel.zero=0"),
           "pp2": ("parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=0")}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The one-process reference and the selected layouts' two-rank runs, side by side
    (testenv.SideBySide): {"ref" or layout id: (CompletedProcess, run directory)}."""
    root = tmp_path_factory.mktemp("runs")

    def job(key, nproc, sets):
        return lambda: (_train(root / key, nproc, *sets), root / key)

    jobs = {"ref": job("ref", 1, ())}
    jobs.update({k: job(k, 2, LAYOUTS[k]) for k in selected(request, test_custom_family_two_ranks_match_one_process)})
    if selected(request, test_custom_model_example_trains):
        jobs["example"] = lambda: (_example(root / "example"), root / "example")
    started = SideBySide(jobs)
    yield started
    started.close()


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_custom_family_two_ranks_match_one_process(request, runs, layout):
    ref, ref_dir = runs["ref"]
    assert ref.returncode == 0, ref.stderr[-3000:]
    r, run = runs[request.node.callspec.id]
    assert r.returncode == 0, r.stderr[-3000:]
    losses, norms = parity.run_metrics(run)
    want_losses, want_norms = parity.run_metrics(ref_dir)
    parity.assert_losses_close(losses, want_losses, n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(norms, want_norms, n=N_REDUCE, depth=DEPTH)
    assert want_losses[-1] < want_losses[0]  # it really trained
    summary = json.loads((run / "summary.json").read_text())
    assert summary["layout"][layout[0].split(".")[1].split("=")[0] if "zero" not in layout[0] else "dp"] == 2
    written = tomllib.loads((run / "config.toml").read_text())["model"]
    assert (written["channels"], written["hidden"], written["head_hidden"]) == (3, 12, 8), \
        "the family's own keys, set (channels, hidden) and default (head_hidden), in the resolved config"


@pytest.mark.parametrize("nproc, sets, expected", [
    (2, ("parallel.ep=2",), "does not support ep"),
    (5, ("parallel.tp=5",), "fc1.0 (colwise) has out_features = 12, not divisible by parallel.tp = 5"),
    (1, ("model.chanels=4",), "model.chanels: unknown key (value 4) (did you mean 'channels'?)"),
    (1, ("model.channels=0",), "model family 'tiny-cnn' refuses its keys: model.channels = 0: expected >= 1"),
    (1, ("train.recompute=\"selective\"",), "model family 'tiny-cnn' supports full, none; use one of those"),
    (1, ("train.eval_every=2",), "model family 'tiny-cnn' has its own data() but no eval_data(cfg)"),
])
def test_unsupported_layout_refused_before_launch(tmp_path, nproc, sets, expected):
    """Refused in the launcher (exit 2), before any rank starts or the run directory exists."""
    run = tmp_path / "run"
    r = _train(run, nproc, *sets)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert expected in r.stderr
    assert not run.exists()  # refused before anything was written


def test_unknown_module_factory_is_a_usage_error(tmp_path):
    r = _train(tmp_path / "run", 1, family_spec="no_such_module_xyz:family")
    assert r.returncode == 2
    assert "no_such_module_xyz:family" in r.stderr and "cannot load it" in r.stderr


def _install_family(site: Path, dist: str, name: str, body: str) -> None:
    """A real installed distribution with a ``chipset.models`` entry point (as pip leaves it)."""
    pkg = dist.replace("-", "_")
    (site / pkg).mkdir(parents=True)
    (site / pkg / "__init__.py").write_text(textwrap.dedent(body))
    info = site / f"{pkg}-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text(f"[chipset.models]\n{name} = {pkg}:family\n")
    (info / "top_level.txt").write_text(pkg + "\n")


def test_entry_point_families_listed_broken_one_isolated_good_one_trains(tmp_path):
    site = tmp_path / "site"
    _install_family(site, "chipset-cnn", "cnn", "from test_model_family import family\n")
    _install_family(site, "chipset-broken-model", "broken", "raise ImportError('needs libfoo 2')\n")
    env = family_env(str(site), str(HERE))
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "models", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    fams = {f["name"]: f for f in json.loads(r.stdout)["families"]}
    assert fams["transformer"]["status"] == "ok"
    assert fams["cnn"]["status"] == "ok" and fams["cnn"]["distribution"] == "chipset-cnn"
    assert "tp" in fams["cnn"]["layouts"] and "ep" not in fams["cnn"]["layouts"]
    assert fams["broken"]["status"] == "import-error" and "needs libfoo 2" in fams["broken"]["reason"]
    table = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "models"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert table.returncode == 0 and "needs libfoo 2" in table.stdout
    # The good one trains by name; choosing the broken one is refused with its reason.
    ok = _train(tmp_path / "ok", 1, family_spec="cnn", env=env)
    assert ok.returncode == 0, ok.stderr[-3000:]
    bad = _train(tmp_path / "bad", 1, family_spec="broken", env=env)
    assert bad.returncode == 2 and "needs libfoo 2" in bad.stderr


def _example(run: Path) -> subprocess.CompletedProcess:
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", str(ROOT / "examples" / "custom-model.toml"),
                           "--nproc", "2", "--run-dir", str(run), "--set", "train.steps=3"],
                          capture_output=True, text=True, env=family_env(str(ROOT / "examples")), timeout=600)


@pytest.mark.multirank
def test_custom_model_example_trains(runs):
    """examples/custom-model.toml on two ranks (started beside the layouts above: the runs fixture)."""
    r, run = runs["example"]
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["throughput_unit"] == "samples"
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= last["eval_accuracy"] <= 1 and last["eval_loss"] > 0, "eval_data/eval_metrics of the example"
    assert "eval_ppl" not in last and "samples/s" in r.stdout


SEVEN = {"units", "loss", "pipeline_units", "pipeline_counts", "aux_loss", "output_loss", "unit_shapes"}


def test_engine_adds_no_attribute_to_the_users_module():
    """The engine pairs the user's module with its family (models/family.py ``BoundModel``)
    instead of patching methods onto it: after the build and a ZeRO-3 step, the module holds no
    instance attribute beyond those every ``nn.Module`` holds, and is still the user's class."""
    from chipset import api

    cfg = api.config(model={"family": "test_model_family:family"}, parallel={"zero": 3},
                     train={"steps": 1, "global_batch": 4, "lr": 0.01})
    b = api.init(cfg)
    try:
        engine = api.parallelize(cfg, b)
        api.step(engine, api.batches(api.dataset(cfg), 0, engine, cfg), 0.01)
        with torch.no_grad():  # the family's loss, through the binding (ZeRO-3 gathers in forward)
            loss = engine.bound.loss(*Images(4).batch(0, device=engine.device))
        engine.release_units()
    finally:
        api.shutdown(b)
    module = engine.model
    assert type(module) is TinyCNN and engine.bound.module is module
    assert not SEVEN & set(vars(module))
    assert set(vars(module)) == set(vars(nn.Module()))
    assert torch.isfinite(loss) and float(loss) > 0
