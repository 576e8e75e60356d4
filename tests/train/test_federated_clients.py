"""Federated clients (docs/islands.md, "Clients: private data, FedProx, sampling"): a real `chipset
train` job of 4 one-rank clients, each with its own text file from a different source (a non-IID
split), 2 clients sampled per round, FedProx, secure aggregation and DP, checked from what each
client recorded and handed to the link; FedProx's gradient term on one engine in one process.
This file is also the one-process job's script (``__main__`` below)."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
import multirank
from chipset.errors import ConfigError
from chipset.train.config import load_config, resolve_config
from testenv import clean_env

HERE = Path(__file__).resolve()
EXAMPLE = HERE.parents[2] / "examples" / "federated-tiny.toml"
CLIENTS, PER_ROUND, STEPS, H = 4, 2, 6, 2
ROUNDS = STEPS // H
EPS32 = torch.finfo(torch.float32).eps


def _env():
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


def _non_iid_files(out: Path) -> list[Path]:
    """Client i's text: the modules of one standard-library package each (json, email, http, logging)."""
    import email
    import http
    import json as json_pkg
    import logging

    from chipset.train.islands.clients import split_by_source

    packages = [json_pkg, email, http, logging]
    return split_by_source([sorted(Path(p.__file__).parent.glob("*.py"))[:6] for p in packages], out)


def _sets(files: list[Path]) -> list[str]:
    return ['data.source="text"', f'islands.client_data="{", ".join(str(f) for f in files)}"',
            f"islands.clients_per_round={PER_ROUND}", "islands.prox_mu=0.5", f"train.steps={STEPS}",
            f"islands.sync_every={H}", "islands.wire_log=true"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedclients")
    files = _non_iid_files(tmp / "clients")
    run = tmp / "run"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", str(EXAMPLE), "--nproc", str(CLIENTS),
                        "--run-dir", str(run), *[a for s in _sets(files) for a in ("--set", s)]],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = load_config(EXAMPLE, _sets(files))
    return run, files, cfg


def _island(run: Path, i: int) -> dict:
    return json.loads((run / f"island-{i}" / "summary.json").read_text())["islands"]


def _fingerprint(path: Path, cfg, island: int) -> str:
    """What island ``island`` trains on when it reads ``path``: its share of every step's batch."""
    from chipset.data import batching
    from chipset.data.datasets import TextBytes

    tr = cfg.train
    data = TextBytes(str(path), tr.seq_len, tr.global_batch, seed=cfg.data.seed, max_bytes=cfg.data.max_bytes)
    h = hashlib.sha256()
    for step in range(tr.steps):
        for t in batching.batch(data, step, island, CLIENTS, 0, 1):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.multirank
def test_each_client_trains_on_its_own_data_only(job):
    """Every batch a client trained on hashes to its own file's batches, never to another's."""
    run, files, cfg = job
    for i in range(CLIENTS):
        data = _island(run, i)["data"]
        assert Path(data["path"]) == files[i].resolve() and data["batches"] == STEPS
        own = [_fingerprint(f, cfg, i) for f in files]
        assert data["sha256"] == own[i]
        assert len(set(own)) == CLIENTS  # the files differ where this client reads them


@pytest.mark.multirank
def test_the_sampled_clients_alone_reach_the_sum_and_epsilon_uses_q(job):
    """Round r's clients are round_clients(train.seed, r); only they keep an update (their clipped,
    noised one) and the masked all-reduce of all four decodes to the sum of theirs: the others sent
    zeros. The epsilon reported is the accountant's at q = clients_per_round / count."""
    from chipset.train.islands.clients import round_clients
    from chipset.train.islands.privacy import epsilon_spent
    from chipset.train.islands.secure import decode_sum, scale_for

    run, _, cfg = job
    isl = cfg.islands
    want = [round_clients(cfg.train.seed, r, CLIENTS, PER_ROUND) for r in range(ROUNDS)]
    logs = []
    for i in range(CLIENTS):
        q = _island(run, i)["quorums"]
        assert [tuple(x["sampled"]) for x in q] == want
        assert _island(run, i)["prox_mu"] == 0.5
        log = [torch.load(f) for f in sorted((run / f"island-{i}" / "wire" / "rank-0").glob("*.pt"))]
        assert [x["op"] for x in log if x["sent"]] == ["all_reduce"] * ROUNDS
        kept = [x["tensors"][0] for x in log if not x["sent"]]
        assert len(kept) == sum(i in s for s in want)
        logs.append((iter(kept), [x["tensors"][0] for x in log if x["sent"]]))
    scale = scale_for(CLIENTS * isl.clip_norm + 64 * isl.noise_multiplier * isl.clip_norm)
    for r, sampled in enumerate(want):
        updates = [next(logs[c][0]).double() for c in sampled]
        total = decode_sum(sum(logs[c][1][r] for c in range(CLIENTS)), scale)
        expect = sum(updates)
        tol = CLIENTS / (2 * scale) + expect.abs() * EPS32  # half a fixed-point step per client, float32 decode
        assert torch.all((total.double() - expect).abs() <= tol), float((total.double() - expect).abs().max())
    p = json.loads((run / "summary.json").read_text())["privacy"]
    spent = epsilon_spent(isl.noise_multiplier, ROUNDS, isl.dp_delta, sample_rate=PER_ROUND / CLIENTS)
    assert p["sample_rate"] == PER_ROUND / CLIENTS and p["rounds"] == ROUNDS
    assert p["epsilon"] == spent.epsilon < epsilon_spent(isl.noise_multiplier, ROUNDS, isl.dp_delta).epsilon


# --- FedProx on one engine ---------------------------------------------------------------------
LR = 0.1
PROX = {"model": {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 64},
        "train": {"steps": 4, "global_batch": 4, "seq_len": 16, "lr": LR, "grad_clip": 0.0, "seed": 7,
                  "optimizer": "sgd", "momentum": 0.0, "dtype": "float32"}}


def _prox_run(b, mu: float | None) -> dict:
    """4 SGD steps from the global weights, with FedProx's term at ``mu`` (None: no term)."""
    from chipset.train import build
    from chipset.train.config import RunConfig
    from chipset.train.islands.outer import ProxTerm
    from chipset.train.loop import rank_batches, train_step

    cfg = RunConfig.from_dict(PROX).validate(world_size=1)
    engine, data, _ = build(cfg, b)
    for bk in engine.buckets:
        bk.outer = {"global": bk.master.detach().clone()}
    if mu is not None:
        engine.grad_terms.append(ProxTerm(mu))
    norms = [train_step(engine, rank_batches(data, s, engine, 1), LR)[1]["grad_norm"] for s in range(4)]
    w0 = torch.cat([bk.outer["global"].double() for bk in engine.buckets])
    w = torch.cat([bk.master.double() for bk in engine.buckets])
    return {"drift": float((w - w0).norm()), "w0": float(w0.norm()), "n": w.numel(), "grad_norms": norms,
            "digest": engine.params_digest()}


@pytest.fixture(scope="module")
def prox(tmp_path_factory):
    return multirank.run_jobs(HERE, [{"prox": 1}], tmp_path_factory.mktemp("prox"), timeout=300)["prox"]


def test_fedprox_keeps_a_client_nearer_the_global_weights(prox):
    """mu = 0 adds exactly nothing; a larger mu, a smaller drift after the same steps. At mu = 1/lr
    plain SGD gives w_{t+1} = w_0 - lr * g_t, so the drift is lr times the last loss-gradient norm,
    up to float32 rounding of the update's terms and of the norm's sum of squares."""
    assert prox[0.0]["digest"] == prox[None]["digest"]
    assert prox[1 / LR]["drift"] < prox[1.0]["drift"] < prox[None]["drift"]
    r = prox[1 / LR]
    g = r["grad_norms"]
    tol = 4 * EPS32 * (2 * r["w0"] + LR * g[-2] + LR * g[-1]) + (math.log2(r["n"]) + 2) * EPS32 * LR * g[-1]
    assert abs(r["drift"] - LR * g[-1]) <= tol, (r["drift"], LR * g[-1], tol)


# --- bad input ----------------------------------------------------------------------------------
FED = ["islands.count=4", "islands.secure_aggregation=true"]


@pytest.mark.parametrize("sets, says", [
    (['data.source="text"', 'islands.client_data="a.txt, b.txt"'], "names 2 path"),
    (['islands.client_data="a,b,c,d"'], "a path per client works with data.source = text or tokens"),
    (['data.source="text"', 'data.path="x.txt"', 'islands.client_data="{0},{0},{0},{0}"'], "both given"),
    (["islands.prox_mu=-0.1"], "islands.prox_mu = -0.1: expected a finite FedProx coefficient >= 0"),
    (["islands.clients_per_round=5"], "islands.clients_per_round = 5: expected 0"),
    (["islands.clients_per_round=1"], "the sum of one client's update is that update"),
])
def test_bad_client_config_is_refused(sets, says, tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 20)
    sets = [s.replace("{0}", str(tmp_path / "a.txt")) for s in sets]
    with pytest.raises(ConfigError, match=says):
        resolve_config(None, [*FED, *sets], world_size=4)


def test_client_paths_in_a_config_file_are_next_to_it_and_each_island_reads_its_own(tmp_path):
    from chipset.train.islands.clients import client_config

    tmp_path = tmp_path.resolve()  # paths are stored resolved
    (tmp_path / "cfg.toml").write_text('[data]\nsource = "text"\n[islands]\ncount = 2\nclient_data = "a.txt, sub/b.txt"\n')
    cfg = load_config(tmp_path / "cfg.toml")
    assert cfg.islands.client_data == f"{tmp_path / 'a.txt'}, {tmp_path / 'sub' / 'b.txt'}"
    assert client_config(cfg, 1).data.path == str(tmp_path / "sub" / "b.txt")


@pytest.mark.multirank  # a --nproc 4 command line, refused before any rank starts
def test_a_missing_client_file_exits_2_before_launch(tmp_path):
    """Each command checks the data of the clients it runs (a client's data is on its node only)."""
    from testenv import chipset_train

    (tmp_path / "a.txt").write_text("some text " * 20)
    paths = [str(tmp_path / "a.txt")] * 3 + ["/nowhere/d.txt"]
    r = chipset_train(tmp_path / "run", 4, [*FED, 'data.source="text"', "model.vocab_size=256", f'islands.client_data="{", ".join(paths)}"'],
                      env=_env(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "islands.client_data entry 3 (island 3): '/nowhere/d.txt': no such file" in r.stderr, r.stderr
    assert "entry 0" not in r.stderr and not (tmp_path / "run").exists()


if __name__ == "__main__":
    b = multirank.start()
    multirank.finish(b, {mu: _prox_run(b, mu) for mu in (None, 0.0, 1.0, 1 / LR)}, sys.argv[2])
