"""Floating-point inputs follow the compute dtype (issue 37: bf16 crashed every image family).

Token ids stay integers; images and features become the parameters' dtype before the model
sees them (runtime/precision.py ``compute_input``), in the data-parallel engine, the pipeline's
first stage and evaluation alike.
"""

from __future__ import annotations

import sys

import pytest
import torch

import forked_cli
import testenv
from chipset.runtime.precision import compute_input
from conftest import ROOT


def test_float_inputs_take_the_compute_dtype_and_token_ids_do_not():
    images = torch.randn(2, 3, 4, 4)
    assert compute_input(images, torch.bfloat16).dtype == torch.bfloat16
    assert compute_input(images, torch.float32) is images
    ids = torch.randint(0, 10, (2, 8))
    assert compute_input(ids, torch.bfloat16) is ids


@pytest.mark.parametrize(("example", "path"), [("resnet-tiny.toml", None), ("custom-model.toml", "examples")])
def test_image_and_custom_families_train_in_bfloat16(tmp_path, example, path):
    """Before the fix both exited 1 with 'Input type (torch.FloatTensor) and weight type
    (CPUBFloat16Type) should be the same'."""
    env = testenv.family_env(str(ROOT / path)) if path else testenv.clean_env()
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", str(ROOT / "examples" / example),
                        "--set", "train.dtype=bfloat16", "--set", "train.steps=2",
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "bfloat16" in r.stdout
