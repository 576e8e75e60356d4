"""Federated islands (docs/islands.md, "Federated"): a real `chipset train` job of 4 one-rank clients
with secure aggregation and differential privacy, checked from what crossed the link between
them (islands.wire_log), and the RDP accountant against closed forms."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
from chipset.errors import ConfigError
from chipset.train.config import load_config, resolve_config
from chipset.train.islands.privacy import (
    ORDERS,
    epsilon_spent,
    gaussian_rdp,
    rdp_to_epsilon,
    rdp_to_epsilon_classical,
)
from chipset.train.islands.secure import MODULUS_BITS, decode_sum, scale_for, x25519, x25519_base
from testenv import chipset_train, clean_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "federated-tiny.toml"
CLIENTS = 4
EPS64 = torch.finfo(torch.float64).eps


def _env():
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """examples/federated-tiny.toml as it ships (4 clients, 2 rounds), with the wire log on."""
    run = tmp_path_factory.mktemp("federated") / "run"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", str(EXAMPLE), "--nproc", str(CLIENTS),
                        "--run-dir", str(run), "--set", "islands.wire_log=true"],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run


def _wire(run: Path, client: int) -> list[dict]:
    files = sorted((run / f"island-{client}" / "wire" / "rank-0").glob("*.pt"))
    return [torch.load(f) for f in files]


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.multirank
def test_the_link_only_carries_masked_updates_whose_sum_is_right(job):
    """Everything a client handed to the link is one int64 all-reduce per round. Each of those,
    read as the client's fixed-point update, is unrelated to the update it hides (correlation
    within 6 standard errors of 0, values spread uniformly over the modulus); their sum is the
    sum of the updates up to the fixed-point resolution."""
    cfg = load_config(EXAMPLE, [])
    isl = cfg.islands
    scale = scale_for(CLIENTS * isl.clip_norm + 64 * isl.noise_multiplier * isl.clip_norm)
    logs = [_wire(job, c) for c in range(CLIENTS)]
    rounds = cfg.train.steps // isl.sync_every
    for c, log in enumerate(logs):
        sent = [x for x in log if x["sent"]]
        assert [(x["op"], x["tensors"][0].dtype) for x in sent] == [("all_reduce", torch.int64)] * rounds, c
        kept = [x for x in log if not x["sent"]]
        assert [x["op"] for x in kept] == ["update"] * rounds
    summary = json.loads((job / "summary.json").read_text())
    n = logs[0][0]["tensors"][0].numel()
    assert summary["cross_island_bytes"] == CLIENTS * rounds * 8 * n  # nothing else crossed
    m = float(2 ** MODULUS_BITS)
    for r in range(rounds):
        updates = [[x for x in log if not x["sent"]][r]["tensors"][0] for log in logs]
        masked = [[x for x in log if x["sent"]][r]["tensors"][0] for log in logs]
        for u, y in zip(updates, masked, strict=True):
            assert u.norm() > 0
            alone = decode_sum(y, scale)  # the masked vector, read as if it were the update
            assert abs(_corr(alone, u)) <= 6 / math.sqrt(n), _corr(alone, u)
            # uniform on [0, M): mean M/2, standard error M / sqrt(12 n)
            assert abs(float(y.double().mean()) - m / 2) <= 6 * m / math.sqrt(12 * n)
        total = decode_sum(sum(masked), scale)
        want = sum(u.double() for u in updates)
        # per client half a fixed-point step, then float32 rounding of the decoded sum
        tol = CLIENTS / (2 * scale) + want.abs() * torch.finfo(torch.float32).eps
        assert torch.all((total.double() - want).abs() <= tol), float((total.double() - want).abs().max())
    assert summary["same_parameters"]


@pytest.mark.multirank
def test_reported_epsilon_is_the_accountants_for_the_configured_noise(job):
    cfg = load_config(EXAMPLE, [])
    isl = cfg.islands
    p = json.loads((job / "summary.json").read_text())["privacy"]
    rounds = cfg.train.steps // isl.sync_every
    want = epsilon_spent(isl.noise_multiplier, rounds, isl.dp_delta)
    assert p["rounds"] == rounds and p["noise_multiplier"] == isl.noise_multiplier and p["delta"] == isl.dp_delta
    assert p["epsilon"] == want.epsilon and p["secure_aggregation"] is True


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _exact_gaussian_delta(eps: float, sigma: float) -> float:
    """The exact delta(eps) of the Gaussian mechanism, sensitivity 1, noise sigma (Balle & Wang 2018)."""
    return _phi(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * _phi(-1 / (2 * sigma) - eps * sigma)


@pytest.mark.parametrize("z, rounds", [(0.8, 1), (1.0, 10), (2.0, 100)])
def test_accountant_on_the_gaussian_mechanism_is_sound_and_below_the_classical_bound(z, rounds):
    """T rounds at noise z are one Gaussian at z / sqrt(T): the RDP line a / (2 z^2) times T. The
    epsilon reported is sound (the exact delta there is at most the target), no larger than
    Mironov's conversion, which is itself at least its continuous optimum rho + 2 sqrt(rho log(1/delta))."""
    delta = 1e-5
    assert gaussian_rdp(3.5, z) == 3.5 / (2 * z * z)
    spent = epsilon_spent(z, rounds, delta)
    once = epsilon_spent(z / math.sqrt(rounds), 1, delta)
    assert math.isclose(spent.epsilon, once.epsilon, rel_tol=16 * EPS64)
    assert _exact_gaussian_delta(spent.epsilon, z / math.sqrt(rounds)) <= delta
    rho = rounds / (2 * z * z)
    classical = rdp_to_epsilon_classical([rounds * gaussian_rdp(a, z) for a in ORDERS], ORDERS, delta)
    assert spent.epsilon <= classical
    assert classical >= rho + 2 * math.sqrt(rho * math.log(1 / delta)) * (1 - 16 * EPS64)


def test_subsampled_gaussian_at_order_2_is_its_closed_form_and_epsilon_is_monotone():
    """At order 2 the binomial sum of the sampled Gaussian is 1 + q^2 (e^(1/z^2) - 1)."""
    for q in (0.01, 0.3, 0.9):
        for z in (0.7, 1.5):
            want = math.log1p(q * q * math.expm1(1 / z**2))
            # logsumexp of three terms of size <= |log(1-q)| * 2 + 1/z^2: a few ulps of that each
            assert abs(gaussian_rdp(2, z, q) - want) <= 16 * EPS64 * (2 * abs(math.log1p(-q)) + 1 / z**2 + 1)
    assert gaussian_rdp(2, 1.0, 0.0) == 0.0
    def eps(**k) -> float:
        return epsilon_spent(**{"noise_multiplier": 1.0, "rounds": 50, "delta": 1e-5, "sample_rate": 0.1, **k}).epsilon

    def rising(xs) -> bool:
        return all(a < b for a, b in zip(xs, xs[1:], strict=False))

    assert rising([eps(noise_multiplier=z) for z in (4.0, 2.0, 1.0, 0.6)])  # less noise, more spent
    assert rising([eps(rounds=t) for t in (1, 10, 100)])
    assert rising([eps(sample_rate=q) for q in (0.01, 0.1, 0.5, 1.0)])
    assert rising([eps(delta=d) for d in (1e-3, 1e-5, 1e-8)])


def test_accountant_agrees_with_opacus_where_installed():
    """Optional cross-check: Opacus's RDP analysis at the same (integer) orders."""
    rdp_mod = pytest.importorskip("opacus.accountants.analysis.rdp")
    orders = [a for a in ORDERS if a == int(a)]
    for q, z, t in ((1.0, 1.1, 20), (0.1, 1.1, 200)):
        theirs = rdp_mod.compute_rdp(q=q, noise_multiplier=z, steps=t, orders=orders)
        ours = [t * gaussian_rdp(a, z, q) for a in orders]
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours, theirs, strict=True))
        eps, _ = rdp_mod.get_privacy_spent(orders=orders, rdp=theirs, delta=1e-5)
        assert math.isclose(rdp_to_epsilon(ours, orders, 1e-5)[0], float(eps), rel_tol=1e-9)


def test_x25519_agrees_with_a_reference_implementation():
    """The pair seeds' key agreement (secure.py's RFC 7748 ladder) against `cryptography`'s X25519."""
    x = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.x25519")
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    g = torch.Generator().manual_seed(0)
    a, b = (bytes(torch.randint(0, 256, (32,), generator=g, dtype=torch.uint8).tolist()) for _ in range(2))
    ka, kb = x.X25519PrivateKey.from_private_bytes(a), x.X25519PrivateKey.from_private_bytes(b)
    assert x25519_base(a) == ka.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert x25519(a, x25519_base(b)) == ka.exchange(kb.public_key()) == x25519(b, x25519_base(a))


FED = ["islands.count=4", "islands.secure_aggregation=true"]


@pytest.mark.parametrize("sets, says", [
    ([*FED, "islands.noise_multiplier=-0.5"], "islands.noise_multiplier = -0.5: expected a noise multiplier >= 0"),
    ([*FED, "islands.clip_norm=0"], "islands.clip_norm = 0"),
    ([*FED, "islands.dp_delta=1.5"], "islands.dp_delta = 1.5"),
    ([*FED, 'islands.pseudo_grad_dtype="bf16"'], "hands every client's update to every other"),
    (["islands.count=1", "islands.noise_multiplier=1.0"], "need at least 2"),
])
def test_bad_federated_config_is_refused(sets, says):
    with pytest.raises(ConfigError, match=says):
        resolve_config(None, sets, world_size=4)


def test_a_client_of_several_ranks_is_refused():
    with pytest.raises(ConfigError, match="a federated client is an island of one rank"):
        resolve_config(None, [*FED, "train.global_batch=8"], world_size=8)


def test_negative_noise_exits_2_before_launch(tmp_path):
    r = chipset_train(tmp_path / "run", 4, [*FED, "islands.noise_multiplier=-1"], env=_env(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "islands.noise_multiplier = -1" in r.stderr and not (tmp_path / "run").exists()
