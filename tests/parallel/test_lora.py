"""LoRA fine-tuning of a Hugging Face Llama (model.init_from + model.lora_rank; docs/lora.md).

``chipset train`` runs the same 4 steps under one process, dp2 x ZeRO-3, tp2 x ZeRO-3 and tp2 with
sequence parallelism (the adapters' column-in-region and row paths, each with and without sequence parallelism). Every layout must
leave the base weights bit-identical to the file while the adapters move and the loss falls,
and equal one process under the parity rules of tests/parity.py. A run resumed from the step-2
checkpoint ends bit for bit where the uninterrupted one did. The exports: merged HF weights load
in transformers, a PEFT adapter folder loads with ``peft`` on the base model, and both give the
logits chipset computes with its unmerged adapters.

Tolerances: the parity bounds of tests/parity.py with the adapters' extra reductions counted
(each adapted matmul becomes two chained ones, x A^T then h B^T: one more reduction on the
longest path per adapted layer, forward and backward). Logits: as tests/models/test_hf.py (1e-5
relative in fp32; a wrong merge scale moves them by more than 1e-2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "models"))  # test_hf, its reference model

from test_hf import BASE as HF_BASE  # noqa: E402
from test_hf import hf_logits, make_family, rel_diff  # noqa: E402

import forked_cli  # noqa: E402
import multirank  # noqa: E402
import parity  # noqa: E402

pytestmark = pytest.mark.multirank

STEPS, SEQ, BATCH, RANK, ALPHA = 4, 16, 4, 4, 8.0
TRAIN = ["--set", f"train.steps={STEPS}", "--set", f"train.seq_len={SEQ}", "--set", f"train.global_batch={BATCH}",
         "--set", "train.lr=0.05", "--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=0",
         "--set", f"model.lora_rank={RANK}", "--set", f"model.lora_alpha={ALPHA}"]
LAYOUTS = {"dp2_zero3": (["--set", "parallel.zero=3"], {"dp": 2, "zero": 3}),
           "tp2_zero3": (["--set", "parallel.tp=2", "--set", "parallel.zero=3"], {"tp": 2, "zero": 3}),
           "tp2_sp": (["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"], {"tp": 2})}
LAYERS = HF_BASE["num_hidden_layers"]
N_REDUCE = max(BATCH * SEQ, HF_BASE["vocab_size"], HF_BASE["hidden_size"], HF_BASE["intermediate_size"])
# 4 adapted stages per layer (q/k/v, o, gate/up, down): one more reduction each, forward and backward.
DEPTH = parity.model_depth(LAYERS) + 2 * 4 * LAYERS
RTOL = 1e-5


def _train(log: Path, *args: str):
    """``chipset train`` started (forked, tests/forked_cli.py), its output to ``log``."""
    return forked_cli.popen([*forked_cli.CLI, "train", *TRAIN, *args], env=multirank.env(), log=log)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base model, the one-process reference and its resumed copy, and the two 2-rank layouts."""
    multirank.require(2)
    root = tmp_path_factory.mktemp("lora")
    base = make_family("llama", "LlamaConfig", {}, root)
    init = ["--set", f"model.init_from={base}"]
    ref = _train(root / "ref.log", *init, "--run-dir", str(root / "ref"))
    procs = {name: _train(root / f"{name}.log", *init, *extra, "--nproc", "2", "--run-dir", str(root / name))
             for name, (extra, _) in LAYOUTS.items()}
    assert ref.wait(timeout=600) == 0, (root / "ref.log").read_text()[-4000:]
    procs["resumed"] = _train(root / "resumed.log", *init, "--resume", str(root / "ref" / "checkpoints" / "step-00000002"),
                              "--run-dir", str(root / "resumed"))
    for name, p in procs.items():
        p.wait(timeout=600)
        assert p.returncode == 0, f"{name}:\n{(root / f'{name}.log').read_text()[-4000:]}"
    return root, base


def _checkpoint_tensors(run: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of the run's newest checkpoint, unmerged (masters where they exist)."""
    from chipset.train.checkpoint import store
    from chipset.train.checkpoint.export import _Weights, find_checkpoint
    from chipset.train.config import RunConfig

    ckpt = find_checkpoint(run, None)
    state = json.loads((ckpt / store.STATE).read_text())
    reader = store.safe_reader(ckpt)
    md = reader.read_metadata().state_dict_metadata
    shapes = {n: list(s) for n, s in state["shapes"].items()}
    kinds = {n: "optim.master" if f"optim.master.{n}" in md else "model" for n in shapes}
    return _Weights(reader, kinds, shapes, RunConfig.from_dict(state["config"])).read(shapes, merged=False)


@pytest.mark.parametrize("name", ["ref", *LAYOUTS])
def test_only_the_adapters_train(runs, name):
    from safetensors.torch import load_file

    from chipset.models.hf.names import to_hf
    from chipset.parallel.lora import is_adapter

    root, base = runs
    got = _checkpoint_tensors(root / name)
    start = load_file(str(base / "model.safetensors"))
    adapters = [n for n in got if is_adapter(n)]
    assert len(adapters) == 2 * 7 * LAYERS  # q, k, v, o, gate, up, down in every layer: A and B
    for n, t in got.items():
        if not is_adapter(n):
            assert torch.equal(t, start[to_hf(n)]), f"{n}: the frozen base weight changed"
    assert all(got[n].abs().max() > 0 for n in adapters if ".lora_B." in n), "a B matrix is still zero"
    losses, _ = parity.run_metrics(root / name)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_process(runs, name):
    root, _ = runs
    parity.assert_run_matches(root / name, parity.run_metrics(root / "ref"), n=N_REDUCE, depth=DEPTH,
                              layout=LAYOUTS[name][1])


def test_a_resumed_run_ends_where_the_uninterrupted_one_did(runs):
    root, _ = runs
    summary = {n: json.loads((root / n / "summary.json").read_text()) for n in ("ref", "resumed")}
    assert summary["resumed"]["resumed_step"] == 2
    assert summary["resumed"]["params_digest"] == summary["ref"]["params_digest"]


def _chipset_logits(run: Path, tokens: torch.Tensor) -> torch.Tensor:
    """One-process chipset logits with the run's unmerged adapters (the forward that trained them)."""
    import chipset
    from chipset.models import Transformer
    from chipset.models.registry import resolve_family
    from chipset.parallel.lora import apply_lora, lora_of
    from chipset.train.config import load_config

    cfg = load_config(run / "config.toml")
    model = Transformer(cfg.model, chipset.backend().kernels)
    apply_lora(model, lora_of(cfg, resolve_family(cfg.model.family)), seed=0)
    model.load_state_dict(_checkpoint_tensors(run))
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.fixture(scope="module")
def exported(runs):
    from chipset.cli.main import main

    root, _ = runs
    for fmt in ("hf", "peft"):
        assert main(["export", str(root / "ref"), "--format", fmt, "--out", str(root / f"ref-{fmt}")]) == 0
    tokens = torch.randint(0, HF_BASE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(0))
    return root, tokens, _chipset_logits(root / "ref", tokens)


def test_merged_export_gives_chipsets_logits(exported):
    root, tokens, mine = exported
    assert rel_diff(hf_logits(root / "ref-hf", tokens), mine) < RTOL


def test_peft_adapter_folder_loads_with_peft_and_gives_chipsets_logits(exported, runs):
    peft = pytest.importorskip("peft")
    import transformers

    root, tokens, mine = exported
    _, base = runs
    names = json.loads((root / "ref-peft" / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.0.self_attn.q_proj" in names
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, root / "ref-peft")
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert b.abs().max() > 0, "the adapters were not loaded"
    with torch.no_grad():
        theirs = model.eval()(tokens).logits
    assert rel_diff(theirs, mine) < RTOL


def test_the_example_config_takes_a_model_directory(runs):
    from chipset.errors import ConfigError
    from chipset.train.config import load_config

    _, base = runs
    example = HERE.parents[2] / "examples" / "lora-finetune.toml"
    with pytest.raises(ConfigError, match="model.init_from = 'path/to/your-hf-model'"):
        load_config(example)
    cfg = load_config(example, [f"model.init_from={base}", "data.source=synthetic", "train.seq_len=32"])
    cfg.validate(world_size=4)
    assert cfg.model.lora_rank == 16 and cfg.parallel.tp == 2 and cfg.parallel.zero == 3


def test_bad_lora_settings_are_refused_before_launch(runs, tmp_path):
    from chipset.errors import ConfigError
    from chipset.train.config import load_config

    _, base = runs
    with pytest.raises(ConfigError, match=r"model.lora_dropout = 1.5: expected a probability in \[0, 1\)"):
        load_config(None, ["model.lora_rank=4", "model.lora_dropout=1.5"]).validate(world_size=1)
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--set", f"model.init_from={base}",
                        "--set", "model.lora_rank=4", "--set", "model.lora_targets=layers.*.self_attn.qq_proj",
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, env=multirank.env(), timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pattern 'layers.*.self_attn.qq_proj' matches no module of the model" in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
