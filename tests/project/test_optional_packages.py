"""A config feature whose optional package is missing exits 2 before launch, with the pip line, writing nothing.

The package is made missing for real: the subprocess's PYTHONPATH puts first a folder whose
``safetensors`` (or ``PIL``) raises ImportError on import, as an uninstalled one would.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from testenv import family_env

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             max_position_embeddings=64)


def _missing(tmp_path, module: str):
    """A folder that makes ``import module`` fail as if it were not installed."""
    d = tmp_path / "missing" / module
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(f'raise ImportError("No module named {module!r}")\n')
    return str(d.parent)


def _hf_dir(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    (d / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    return d


def _images(tmp_path):
    d = tmp_path / "images"
    for c in ("cats", "dogs"):
        (d / c).mkdir(parents=True)
        (d / c / "001.png").write_bytes(b"\x89PNG")
    return d


@pytest.mark.parametrize("module, sets, expect", [
    ("safetensors", lambda t: [f"model.init_from={_hf_dir(t)}"],
     "model.init_from = '{t}/llama' (reading its safetensors weights) needs the 'safetensors' package, which cannot "
     "be imported here (No module named 'safetensors'); install it: pip install 'chipset[hf]' (or pip install safetensors)"),
    ("PIL", lambda t: ["model.family=resnet", "model.num_classes=2", "data.source=images", f"data.path={_images(t)}"],
     "data.source = 'images' (decoding the images) needs the 'pillow' package, which cannot be imported here "
     "(No module named 'PIL'); install it: pip install 'chipset[images]' (or pip install pillow)"),
])
def test_a_missing_optional_package_exits_2_before_the_run_directory_exists(tmp_path, module, sets, expect):
    run_dir = tmp_path / "run"
    args = [a for s in sets(tmp_path) for a in ("--set", s)]
    r = run_cli("train", "--set", "train.steps=1", *args, "--run-dir", str(run_dir),
                env=family_env(_missing(tmp_path, module)))
    assert r.returncode == 2, r.stderr
    assert expect.format(t=tmp_path) in r.stderr
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_nothing_is_asked_of_a_config_that_needs_no_optional_package(tmp_path):
    from chipset.preflight import check_optional_packages
    from chipset.train.config import RunConfig

    check_optional_packages(RunConfig())  # synthetic data, no init_from: imports nothing, raises nothing
