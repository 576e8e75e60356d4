"""Pipeline parallelism combined with sequence parallelism, context parallelism and ZeRO-3.

One 4-rank torchrun job (gloo, default backend) trains each combination in turn in one
process group, beside a single-process reference job (tests/multirank.py); this file is
also the jobs' script (``__main__`` below):

* ``tp2_pp2_sp``: tp 2 with sequence parallelism x pp 2 (interleaved 1F1B, 2 chunks per
  rank): stages exchange each tp rank's slice of the sequence only.
* ``cp2_pp2``: cp 2 x pp 2 (1F1B): each cp rank pipelines its share of every sequence.
* ``dp2_pp2_zero3``: dp 2 x pp 2 with ZeRO-3 (1F1B): each stage's parameters sharded over dp.

Each saves a checkpoint at step 5, which the same job then resumes under another of the
combinations (save and load of every new layout, across layouts).

Tolerances: derived in tests/parity.py (fp32 reduction order for per-step losses and
gradient norms, AdamW's worst case for parameters), so they hold on any CPU.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

import multirank
import parity
from multirank import merge

HERE = Path(__file__).resolve()
STEPS = 10
SAVE = 5
BASE = {
    "model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64},
    "train": {"steps": STEPS, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "grad_clip": 0.5, "seed": 7},
    "parallel": {"bucket_mb": 0.02, "micro_batches": 4},
}
VARIANTS = {
    "tp2_pp2_sp": {"parallel": {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "interleaved_1f1b",
                                "virtual_stages": 2}},
    "cp2_pp2": {"parallel": {"pp": 2, "cp": 2, "schedule": "1f1b"}},
    "dp2_pp2_zero3": {"parallel": {"pp": 2, "dp": 2, "zero": 3, "schedule": "1f1b"}},
}
# resumed run -> (the variant whose step-SAVE checkpoint it loads, the variant whose layout it runs)
RESUMED = {
    "cp2_pp2_from_sp": ("tp2_pp2_sp", "cp2_pp2"),
    "zero3_from_cp": ("cp2_pp2", "dp2_pp2_zero3"),
    "sp_from_zero3": ("dp2_pp2_zero3", "tp2_pp2_sp"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_configs_of_the_combinations_validate(variant):
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(merge(BASE, VARIANTS[variant])).validate(world_size=4)
    assert cfg.parallel.pp == 2 and cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp == 4


def test_chipset_train_accepts_pp_with_sp_cp_and_zero3_overrides(capsys):
    from chipset.cli.main import main

    for extra in (["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.cp=2"],
                  ["parallel.dp=2", "parallel.zero=3"]):
        args = ["train", "--print-schedule", "--nproc", "4", "--set", "parallel.pp=2", "--set",
                "parallel.micro_batches=4", "--set", "model.num_hidden_layers=4"]
        for kv in extra:
            args += ["--set", kv]
        assert main(args) == 0, capsys.readouterr()
        assert "pipeline schedule 1f1b: 2 ranks, 4 micro-batches" in capsys.readouterr().out


def _run(b, overrides: dict, run_dir=None, resume: str = "none") -> dict:
    from chipset.train import train
    from chipset.train.config import RunConfig

    cfg = RunConfig.from_dict(merge(BASE, overrides)).validate(world_size=b.collective.world_size())
    res = train(cfg, b, run_dir, out=io.StringIO(), keep_params=True, resume=resume)
    return {"losses": {m["step"]: m["loss"] for m in res.metrics},
            "grad_norms": {m["step"]: m["grad_norm"] for m in res.metrics}, "params": res.params}


def _job(mode: str, out_path: str) -> None:
    b = multirank.start()
    results: dict = {}
    if mode == "ref":
        results["ref"] = _run(b, {})
    else:
        # Every rank must name the same directory: derived from the output path rank 0 writes.
        root = Path(out_path).with_suffix(".runs")
        for name, over in VARIANTS.items():
            results[name] = _run(b, merge(over, {"train": {"checkpoint_every": SAVE}}), root / name)
        for name, (source, layout) in RESUMED.items():
            ckpt = root / source / "checkpoints" / f"step-{SAVE:08d}"
            results[name] = _run(b, VARIANTS[layout], root / name, resume=str(ckpt))
    multirank.finish(b, results, out_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    multirank.require(4)
    got = multirank.run_jobs(HERE, [{"w4": 4, "ref": 1}], tmp_path_factory.mktemp("pp_combos"))
    return {k: v for res in got.values() for k, v in res.items()}


N_REDUCE = parity.model_reduction_size(BASE)
DEPTH = parity.model_depth(BASE["model"]["num_hidden_layers"])


def _steps(per_step: dict) -> list[float]:
    """{step: value} as a list in step order."""
    return [per_step[s] for s in sorted(per_step)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_combination_losses_and_params_equal_single_process(runs, variant):
    ref, got = runs["ref"], runs[variant]
    assert sorted(got["losses"]) == list(range(1, STEPS + 1))
    parity.assert_losses_close(_steps(got["losses"]), _steps(ref["losses"]), n=N_REDUCE, depth=DEPTH)
    parity.assert_grad_norms_close(_steps(got["grad_norms"]), _steps(ref["grad_norms"]), n=N_REDUCE, depth=DEPTH)
    tr = BASE["train"]
    parity.assert_params_within_adam_bound(got["params"], ref["params"], lrs=[tr["lr"]] * STEPS,
                                           beta1=0.9, beta2=0.95)
    assert ref["losses"][STEPS] < ref["losses"][1] - 0.05  # training moved: equality is not vacuous
    assert all(n > BASE["train"]["grad_clip"] for n in ref["grad_norms"].values())  # clipping: global norm matters


@pytest.mark.parametrize("resumed", list(RESUMED))
def test_combination_checkpoint_resumes_under_another_combination(runs, resumed):
    ref, got = runs["ref"], runs[resumed]
    assert sorted(got["losses"]) == list(range(SAVE + 1, STEPS + 1))  # it started from the checkpoint
    want = {s: ref["losses"][s] for s in got["losses"]}
    # Steps are 1-based here: the first resumed one is step SAVE (0-based) of the whole run.
    parity.assert_losses_close(_steps(got["losses"]), _steps(want), n=N_REDUCE, depth=DEPTH, first_step=SAVE)
    tr = BASE["train"]
    parity.assert_params_within_adam_bound(got["params"], ref["params"], lrs=[tr["lr"]] * STEPS,
                                           beta1=0.9, beta2=0.95)


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
