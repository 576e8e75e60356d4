"""The prepared GPU check degrades cleanly where there is no GPU: every step recorded, reasons kept.

Its comparison steps (plugins/cuda/gpu_check_peers.py: torchtitan beside `chipset train`, FP8
beside bf16, LoRA beside a full fine-tune) are checked here as far as a machine without a GPU
allows: the shapes and configs of both sides, the commands, and the parsing of both sides' logs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import forked_cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "plugins" / "cuda" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run plugins/cuda/gpu_check.sh instead")
def test_gpu_check_without_a_gpu_records_each_step_with_the_reason(tmp_path):
    r = forked_cli.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = data["steps"]
    assert list(steps) == ["environment", "chipset_backends", "chipset_info", "probe_fork_safe", "interfaces",
                           "collective_nccl_world1", "kernels_vs_reference", "kernel_speed", "throughput",
                           "gemm_curve", "mpt_blocks", "train_gpt_1b", "engine_train", "plain_torch_gpu",
                           "conformance", "fp8_vs_bf16", "lora_memory", "torchtitan_peer"]
    assert steps["environment"]["ok"] and steps["environment"]["detail"]["torch"] == torch.__version__
    assert not data["all_ok"] and data["not_selected"] == []
    assert "cuda is unavailable" in steps["chipset_backends"]["error"]
    # torchtitan is not installed here: its step says so before it asks for a GPU, and is skipped
    titan = steps.pop("torchtitan_peer")
    assert titan["skipped"].startswith("torchtitan not importable: ") and "torchtitan" in titan["skipped"][27:], titan
    assert all("unavailable" in s["error"] for name, s in steps.items() if name not in ("environment", "probe_fork_safe"))
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "| chipset_backends | RuntimeError: cuda is unavailable" in summary
    assert "| torchtitan_peer | torchtitan not importable: " in summary


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_planners_measured_steps_are_the_shapes_the_gpu_check_trains():
    """chipset.planner.measured_steps costs the work of the GPU check's three training steps:
    its rows must stay the shapes and batches the check runs, or the comparison means nothing."""
    from chipset.planner.measured_steps import H200_STEPS

    gc = _gpu_check_module()
    shapes = {"train_gpt_1b": gc.TRAIN_GPT_SHAPE, "engine_train": gc.ENGINE_SHAPE, "plain_torch_gpu": gc.ENGINE_SHAPE}
    assert {r.step for r in H200_STEPS} == set(shapes)
    for r in H200_STEPS:
        s = shapes[r.step]
        m = r.model
        assert (m.hidden, m.layers, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len, r.batch) == (
            s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["ffn"], s["vocab"], s["seq"], s["batch"]), r.step


def test_the_summary_shows_each_step_beside_the_planner():
    gc = _gpu_check_module()
    detail = {"measured_step_ms": 234.0, "planner_step_ms": 237.3, "planner_error": -0.0139}
    data = {"started": "now", "steps": {"environment": {"ok": True, "detail": {}},
                                        "engine_train": {"ok": True, "detail": {**detail, "median_tokens_per_s": 1,
                                                                                "median_mfu": 0.5, "peak_memory_gib": 1,
                                                                                "loss_first_last": [2, 1]}}},
            "seconds": 1, "all_ok": True}
    text = gc.summary(data)
    assert "| engine_train | 234.0 | 237.3 | -1.4% |" in text


def test_the_mpt_blocks_the_gpu_check_times_are_the_planners_mpt_blocks():
    """Step mpt_blocks times stock-torch MPT blocks beside the planner's cost of ``_mpt``'s
    blocks: same parameters per block, and the block runs forward and backward (here on
    the CPU, small)."""
    import torch

    from chipset.planner.published import _mpt

    gc = _gpu_check_module()
    for cfg in gc.MPT_BLOCKS:
        stack = gc.mpt_block_stack(cfg["hidden"], cfg["heads"], 1).to("meta")
        spec = _mpt(cfg["hidden"], cfg["heads"], cfg["layers"])
        # the planner's norms carry a bias in its count (gpt3's layernorm); MPT's have none
        norm_bias = 2 * cfg["hidden"] if spec.norm == "layernorm" else 0
        assert sum(p.numel() for p in stack.parameters()) == spec.layer_params(False) - norm_bias, cfg["name"]
    small = gc.mpt_block_stack(64, 4, 2)
    x = torch.randn(2, 16, 64, requires_grad=True)
    small(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in small.parameters())


# --- the comparison steps (issues 38 and 33) ------------------------------------------------------
def _peers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_peers", ROOT / "plugins" / "cuda" / "gpu_check_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Parameters of torchtitan 0.3.0's model for each TITAN_SHAPES row, counted once by hand: the generated
# config module (peers.titan_module) imported with the torchtitan wheel on the path, its
# ``chipset_peer().model_spec.model.build()`` on the meta device, parameters summed (tied weights once).
TITAN_PARAMS = {"llama3_1b": 1_235_814_400, "llama3_8b_16l": 4_540_469_248}


def test_torchtitan_rows_configure_the_same_model_and_recipe_on_both_sides(tmp_path):
    import ast

    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family
    from chipset.train.config import load_config

    peers = _peers()
    data = peers.write_token_file(tmp_path / "tokens.bin", 5000)
    assert data.stat().st_size == 2 * 5000
    assert set(TITAN_PARAMS) == set(peers.TITAN_SHAPES)
    for name, shape in peers.TITAN_SHAPES.items():
        for compile_ in (False, True):
            sets = peers.chipset_sets(shape, steps=7, compile_=compile_, data_path=str(data))
            cfg = load_config(None, sets).validate(world_size=1, dtypes=("float32", "bfloat16"))
            m, tr = cfg.model, cfg.train
            assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
                    m.intermediate_size, m.vocab_size, m.tie_word_embeddings) == (
                shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"], shape["ffn"], shape["vocab"],
                shape["tie"]), name
            assert (m.rope_type, m.rope_theta, m.rope_factor) == ("llama3", 500000.0, 8.0)
            assert (tr.seq_len, tr.global_batch, tr.steps, tr.dtype, tr.recompute, tr.compile) == (
                shape["seq"], shape["batch"], 7, "bfloat16", "full", compile_)
            assert (tr.lr, tr.warmup_steps, tr.weight_decay, tr.grad_clip) == (peers.LR, peers.LR_WARMUP, 0.1, 1.0)
            assert (cfg.data.source, cfg.data.path) == ("tokens", str(data))
            run = peers.titan_run(shape, steps=7, compile_=compile_, data_path=str(data), dump_folder="d")
            assert (run["seq"], run["batch"], run["steps"], run["compile"], run["layers"], run["vocab"]) == (
                tr.seq_len, tr.global_batch, tr.steps, compile_, m.num_hidden_layers, m.vocab_size)
            assert run["activation_checkpoint"] == "full" and run["data_path"] == str(data)
            text = peers.titan_module(run)
            tree = ast.parse(text)  # the module torchtitan imports: valid Python, RUN exactly the run
            assign = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "RUN")
            assert ast.literal_eval(assign.value) == run
            assert "FullAC.Config()" in text and 'CompileConfig(enable=RUN["compile"]' in text
            # torchtitan decays over every step after warm-up unless decay_ratio is 0 (constant, as chipset's)
            assert 'decay_ratio=0.0' in text and 'max_norm=1.0' in text and "default_adamw(lr=RUN[\"lr\"])" in text
        # chipset's model has exactly as many parameters as torchtitan's of the same row, and as the
        # count the step sizes a row's memory by
        assert sum(p.numel() for p in meta_model(resolve_family(cfg.model.family), cfg).parameters()) == TITAN_PARAMS[name]
        assert peers.titan_params(shape) == TITAN_PARAMS[name]
    cmd, env = peers.titan_command("/x")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m"]
    assert cmd[6:] == ["torchtitan.train", "--module", "chipset_titan_peer", "--config", "chipset_peer"] and env == {"PYTHONPATH": "/x"}


# Lines in the form torchtitan 0.3.0 logs a training step (torchtitan/components/metrics.py,
# MetricsProcessor.log; logger format "[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s"
# from torchtitan/tools/logging.py, init_logger), colours on; the figures are made up.
TITAN_LOG = """\
[titan] 2026-12-05 21:40:01,100 - root - INFO - Training starts at step 1
[titan] 2026-12-05 21:40:09,200 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.01250  \x1b[38;2;180;60;0mgrad_norm:  9.8310  \x1b[38;2;54;234;195mmemory: 41.07GiB(29.38%)  \x1b[34mtps: 1,021  \x1b[36mtflops: 9.15  \x1b[35mmfu: 0.93%\x1b[39m
[titan] 2026-12-05 21:40:10,300 - root - INFO - step:  2  loss: 11.50000  grad_norm:  7.0000  memory: 52.50GiB(37.56%)  tps: 30,500  tflops: 273.11  mfu: 27.61%
[titan] 2026-12-05 21:40:11,300 - root - WARNING - a line that is not a step
[titan] 2026-12-05 21:40:12,300 - root - INFO - step:  3  loss: 10.25000  grad_norm:  5.0000  memory: 52.50GiB(37.56%)  tps: 31,000  tflops: 277.59  mfu: 28.06%
[titan] 2026-12-05 21:40:13,300 - root - INFO - step:  4  loss:  9.12500  grad_norm:  4.0000  memory: 52.61GiB(37.64%)  tps: 31,200  tflops: 279.38  mfu: N/A
"""


def test_torchtitan_log_lines_are_parsed_and_set_beside_chipsets():
    peers = _peers()
    recs = peers.parse_titan_log(TITAN_LOG)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[0] == {"step": 1, "loss": 12.0125, "grad_norm": 9.831, "peak_memory_gib": 41.07, "tokens_per_s": 1021.0,
                       "tflops": 9.15, "mfu": 0.0093}
    assert recs[3]["mfu"] is None and recs[3]["tokens_per_s"] == 31200.0
    s = peers.run_summary(recs, warmup=1)
    assert s == {"steps": 4, "median_tokens_per_s": 31000, "median_mfu": 0.2806, "peak_memory_gib": 52.61,
                 "loss_first_last": [12.0125, 9.125]}
    ours = {**s, "median_tokens_per_s": 34100, "peak_memory_gib": 47.349, "loss_first_last": [12.0, 9.0]}
    row = peers.side_by_side(ours, s)
    assert (row["tokens_per_s_ratio"], row["peak_memory_ratio"], row["final_loss_gap"]) == (1.1, 0.9, -0.125)
    with pytest.raises(ValueError, match="no step records"):
        peers.run_summary(peers.parse_titan_log("[titan] ... - root - ERROR - CUDA out of memory"))


@pytest.fixture(scope="module")
def tiny_fp8_run(tmp_path_factory):
    """`chipset train` of the FP8 step's config on a tiny model (cpu_sim emulates FP8 GEMMs)."""
    peers = _peers()
    shape = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 128, "seq": 16, "batch": 2}
    run_dir = tmp_path_factory.mktemp("fp8") / "run"
    args = [sys.executable, "-m", "chipset.cli.main", "train", "--run-dir", str(run_dir)]
    for s in peers.fp8_runs(shape, steps=3)["fp8"]:
        args += ["--set", s]
    r = forked_cli.run(args, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return shape, run_dir


def test_fp8_and_lora_steps_configure_chipset_train_and_read_its_metrics(tiny_fp8_run):
    from chipset.train.config import load_config

    peers = _peers()
    shape, run_dir = tiny_fp8_run
    fp8, lora = peers.fp8_runs(shape, steps=3), peers.lora_runs(shape, steps=3)
    cfgs = {k: load_config(None, v).validate(world_size=1, dtypes=("float32", "bfloat16"))
            for k, v in {**fp8, **lora}.items()}
    assert (cfgs["bf16"].train.fp8, cfgs["fp8"].train.fp8) == ("off", "tensorwise")
    assert (cfgs["full"].model.lora_rank, cfgs["lora"].model.lora_rank) == (0, peers.LORA_RANK)
    # apart from the compared key, the runs of a pair are configured alike
    assert set(fp8["fp8"]) ^ set(fp8["bf16"]) == {'train.fp8="off"', 'train.fp8="tensorwise"'}
    assert set(lora["lora"]) - set(lora["full"]) == {f"model.lora_rank={peers.LORA_RANK}"}
    recs = peers.parse_chipset_metrics((run_dir / "metrics.jsonl").read_text())
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["peak_memory_gib"] > 0 for r in recs)
    s = peers.run_summary(recs, warmup=1)
    assert s["steps"] == 3 and s["median_tokens_per_s"] > 0 and s["loss_first_last"][0] == round(recs[0]["loss"], 4)
    res = peers.fp8_result({**s, "median_tokens_per_s": 1000}, {**s, "median_tokens_per_s": 1200})
    assert (res["tokens_per_s_ratio"], res["meets_goal"], res["final_loss_gap"]) == (1.2, False, 0.0)


def test_lora_training_state_is_read_from_benchmarks_lora_memory():
    """The LoRA step's optimizer-state figures: benchmarks/lora_memory.py's exact counts, parsed."""
    peers = _peers()
    shape = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 128, "seq": 16, "batch": 2}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lora_memory.py"), "--rank", str(peers.LORA_RANK)]
    for s in peers.shape_sets(shape):
        cmd += ["--set", s]
    r = forked_cli.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    state = peers.parse_lora_memory(r.stdout)
    # rank x (in + out) per adapted projection, q k v o gate up down, per layer (kv width 2 heads x 8)
    adapters = peers.LORA_RANK * (64 + 48 + 48 + 64 + 96 + 96 + 96) * shape["layers"]
    assert state["trained parameters"]["lora"] == adapters
    for k in ("full", "lora"):  # AdamW: two fp32 moments per trained element
        assert state["AdamW moments (B)"][k] == 8 * state["trained parameters"][k]
    full = {"peak_memory_gib": 2.0, "median_tokens_per_s": 1}
    res = peers.lora_result(full, {**full, "peak_memory_gib": 1.5}, state)
    assert res["peak_memory_ratio"] == 0.75 and res["optimizer_state_gib"]["lora"] == round(8 * adapters / 2**30, 4)
    with pytest.raises(ValueError, match="AdamW moments"):
        peers.parse_lora_memory("Traceback ...")


def test_steps_and_groups_select_what_runs():
    gc = _gpu_check_module()
    names = ["environment", "engine_train", "conformance", "fp8_vs_bf16", "lora_memory", "torchtitan_peer"]
    assert gc.selected_steps("core", names) == {"environment", "engine_train", "conformance"}
    assert gc.selected_steps("environment,torchtitan", names) == {"environment", "torchtitan_peer"}
    assert gc.selected_steps("all", names) == set(names)
    with pytest.raises(SystemExit, match="unknown step or group 'fp16'"):
        gc.selected_steps("core,fp16", names)


def test_the_datasets_stand_in_lets_torchtitan_import_and_refuses_any_use(tmp_path):
    """Where HF datasets is missing (the device machine), torchtitan's module-level import of it
    gets a stand-in: importable under the names torchtitan imports, raising on any call."""
    import os

    peers = _peers()
    assert peers.missing_modules(("json", "no_such_module_for_gpu_check")) == ["no_such_module_for_gpu_check"]
    assert peers.write_standins(tmp_path, ["datasets", "no_such_module_for_gpu_check"]) == ["datasets"]
    code = ("from datasets import Dataset, load_dataset\nfrom datasets.distributed import split_dataset_by_node\n"
            "for f in (load_dataset, Dataset, split_dataset_by_node):\n    try:\n        f('c4')\n"
            "    except RuntimeError as exc:\n        print('refused:', exc)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = forked_cli.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("refused: Hugging Face datasets is not installed here") == 3


def test_the_summary_shows_the_comparison_steps():
    """The summary is rewritten after every step: it must render the results the steps return."""
    gc, peers = _gpu_check_module(), _peers()
    run = {"steps": 25, "median_tokens_per_s": 160000, "median_mfu": 0.48, "peak_memory_gib": 17.4,
           "loss_first_last": [10.4, 6.2]}
    fp8 = peers.fp8_result(run, {**run, "median_tokens_per_s": 208000})
    state = {"AdamW moments (B)": {"full": 2**32, "lora": 2**22}, "trained parameters": {"full": 2**29, "lora": 2**19}}
    lora = peers.lora_result(run, {**run, "peak_memory_gib": 8.7}, state)
    titan = {"rows": {"llama3_1b:eager": peers.side_by_side(run, {**run, "median_tokens_per_s": 128000}),
                      "llama3_8b_16l:compile": {"skipped": "the step's time cap is spent"}}}
    data = {"started": "now", "seconds": 1, "all_ok": True, "not_selected": ["conformance"],
            "steps": {"fp8_vs_bf16": {"ok": True, "detail": fp8}, "lora_memory": {"ok": True, "detail": lora},
                      "torchtitan_peer": {"ok": True, "detail": titan}}}
    text = gc.summary(data)
    assert "FP8/bf16 tokens/s 1.3 (goal >= 1.25: met); final loss FP8 - bf16 +0.0" in text
    assert f"| LoRA rank {peers.LORA_RANK} | 8.7 | 0.0039 | 160000 |" in text and "LoRA/full peak memory 0.5" in text
    assert "| llama3_1b:eager | torchtitan | 128000 | 0.48 | 17.4 | 10.4 -> 6.2 | 1.25 |" in text
    assert "Not selected (--steps): conformance." in text


def test_the_kernel_steps_inputs_run_through_each_reference_and_the_grouped_gemm_body():
    """kernels_vs_reference and kernel_speed feed these inputs to the cuda kernel and the reference:
    here, on the CPU in float32, the reference takes them forward and backward, and the cuda
    backend's grouped_mm body (its padding to 8 rows; the op itself runs on the CPU too) gives
    the reference's answer on them."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    from chipset.kernels import reference
    from chipset_cuda import kernels

    for name in gpu_check.KERNELS:
        args, kwargs, need = gpu_check._kernel_inputs(name, torch.float32, torch.device("cpu"), big=False)
        out, grads = gpu_check._fwd_bwd(getattr(reference, name), args, kwargs, need)
        assert out.isfinite().all() and len(grads) == len(need), name
    (x, w, offs), _, need = gpu_check._kernel_inputs("grouped_mm", torch.float32, torch.device("cpu"), big=False)
    if hasattr(torch, "_grouped_mm"):
        up = gpu_check._upstream(reference.grouped_mm(x, w, offs))
        got = gpu_check._fwd_bwd(kernels.grouped_mm, [x, w, offs], {}, need, up)
        want = gpu_check._fwd_bwd(reference.grouped_mm, [x, w, offs], {}, need, up)
        # Each is a float32 sum of n products, in some order: within n * eps * sum|products| of each other
        # (dot products of 64 forward, of 48 for the input gradient, of a group's <= 17 rows for the weights').
        eps = torch.finfo(torch.float32).eps
        ends = offs.tolist()
        bounds = [2 * 64 * eps * reference.grouped_mm(x.abs(), w.abs(), offs),
                  2 * 48 * eps * reference.grouped_mm(up.abs(), w.abs().transpose(1, 2), offs),
                  torch.stack([2 * 17 * eps * (x[a:b].abs().t() @ up[a:b].abs())
                               for a, b in zip([0, *ends[:-1]], ends, strict=True)])]
        for a, b, bound in zip([got[0], *got[1]], [want[0], *want[1]], bounds, strict=True):
            assert (a - b).abs().le(bound).all()
