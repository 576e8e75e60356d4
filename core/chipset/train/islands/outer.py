"""DiLoCo / local SGD: the outer step every ``islands.sync_every`` inner steps.

Each island trains its own copy of the model with the inner optimizer (``[train]``) on its
share of the global batch. Every ``H`` steps each rank takes the pseudo-gradient of what it
owns, ``global - local`` (float32 masters, per bucket: the slice the engine's ZeRO sharding
gives this rank, so rank ``r`` of every island holds the same elements), and the islands of
the step's quorum average it over the host link (fp32 all-reduce, or bf16/int8 all-gathered
with error feedback). The outer optimizer (runtime/optim.py's SGD: Nesterov momentum or
plain) updates the global parameters, which become every island's masters; the parameters
the engine computes with are refreshed from them as after an inner step. The inner
optimizer's state stays each island's own (DiLoCo).

The outer state (global parameters, outer momentum, error-feedback residual) lives next to
each bucket's master, shaped like it (``Bucket.outer``), so checkpoints write it under
logical names (``outer.global.<param>``, ...) and reshard it like the optimizer state.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chipset.errors import CollectiveError
from chipset.runtime.optim import SGD
from chipset.train.islands.clients import DataFingerprint, round_clients
from chipset.train.islands.config import client_paths, federated, per_round
from chipset.train.islands.link import HEARTBEAT_S, IslandLink, Pending, Quorum
from chipset.train.islands.privacy import rounds_spent
from chipset.train.islands.secure import SecureSum, decode_sum, scale_for

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["Islands", "ProxTerm", "INT8_BLOCK", "quantize_int8", "dequantize_int8", "islands_for_run"]

log = logging.getLogger(__name__)

SIGMAS = 64
"""Secure aggregation's fixed-point range covers the noise on the sum up to this many standard deviations."""

INT8_BLOCK = 2048
"""Elements per int8 scale: one float32 scale per block of the flat pseudo-gradient (0.2% extra bytes)."""


def islands_for_run(cfg, backend: Backend, engine, run_dir=None) -> Islands | None:
    """This rank's :class:`Islands` in an islands job (``CHIPSET_ISLAND`` set by the launcher), else None.
    ``run_dir``: the island's run directory (``islands.wire_log`` writes under it)."""
    import os

    from chipset.errors import ConfigError
    from chipset.interfaces.collective import collective_timeout
    from chipset.train.islands.link import REJOIN_ENV, STORE_ENV, island_index

    island = island_index()
    if cfg.islands.count <= 1:
        return None
    if island is None or not os.environ.get(STORE_ENV):
        raise ConfigError(f"islands.count = {cfg.islands.count}: an islands job is started by `chipset train`, "
                          f"which gives every island its index and the islands' store ({STORE_ENV}); "
                          "run it through chipset train (docs/islands.md)")
    timeout = collective_timeout().total_seconds()
    local_rank = backend.collective.rank()
    link = IslandLink(os.environ[STORE_ENV], island=island, count=cfg.islands.count, local_rank=local_rank,
                      timeout_s=timeout, quorum_timeout_s=cfg.islands.quorum_timeout)
    if cfg.islands.wire_log and run_dir is not None:
        from pathlib import Path

        link.wire_dir = Path(run_dir) / "wire" / f"rank-{local_rank}"
    return Islands(cfg, backend, engine, link, island, rejoin=os.environ.get(REJOIN_ENV) == "1")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat float32) as int8 codes and one float32 scale per :data:`INT8_BLOCK` elements."""
    n = x.numel()
    pad = (-n) % INT8_BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[:n].contiguous(), scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    pad = (-n) % INT8_BLOCK
    blocks = torch.nn.functional.pad(codes.float(), (0, pad)).view(-1, INT8_BLOCK)
    return (blocks * scale[:, None]).view(-1)[:n]


class ProxTerm:
    """FedProx's proximal term ``(mu / 2) * ||w - w_global||^2`` as an engine gradient term
    (``DataParallel.grad_terms``): adds ``mu * (master - global)`` to each bucket's gradient, where
    ``global`` (``Bucket.outer["global"]``) holds the round's global parameters."""

    def __init__(self, mu: float):
        self.mu = mu

    def __call__(self, bucket, grad) -> None:
        grad.add_(bucket.master - bucket.outer["global"], alpha=self.mu)


class _Exchange:
    """An outer step's exchange on the link: ``result()`` waits for it and returns (the average,
    what this island's share decoded to)."""

    def __init__(self, quorum: Quorum, pending: list[Pending], finish, sent: torch.Tensor,
                 error: CollectiveError | None = None):
        self.quorum, self._pending, self._finish, self.sent, self._error = quorum, pending, finish, sent, error
        self.done = not pending and error is None

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
        for p in self._pending:
            p.wait()
        self.done = True

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.wait()
        return self._finish(), self.sent


@dataclass
class _InFlight:
    """A delayed outer step's exchange between its start and :meth:`Islands.settle`."""

    x: torch.Tensor
    step: int
    ex: _Exchange
    attempt: int
    sent0: int
    drift: float
    took_part: bool


class Islands:
    """One rank's part in the islands' training. Every rank of an island calls every method."""

    def __init__(self, cfg, backend: Backend, engine, link: IslandLink, island: int, *, rejoin: bool = False):
        isl = cfg.islands
        self.cfg, self.backend, self.link, self.island = cfg, backend, link, island
        self.col = backend.collective
        self.inner = getattr(engine, "engine", engine)  # a pipeline engine's DataParallel holds its buckets
        self.engine = engine
        self.count, self.every, self.steps = isl.count, isl.sync_every, cfg.train.steps
        self.dtype = isl.pseudo_grad_dtype
        self.lr = isl.outer_lr
        self.opt = SGD(momentum=isl.outer_momentum if isl.outer_optimizer == "nesterov" else 0.0,
                       nesterov=isl.outer_optimizer == "nesterov")
        self.outer_steps = 0
        self.delayed = isl.overlap == "delayed"
        self._pending: _InFlight | None = None
        """The delayed outer step whose exchange is on the link (``islands.overlap = "delayed"``)."""
        self._held = False
        """Its average is in the buckets' ``outer["pending"]``, not yet applied (checkpointed)."""
        self.rejoin = rejoin
        self.history: list[dict] = []
        """One record per outer step: step, members, joiners, bytes sent between islands."""
        self.buckets = [b for b in self.inner.buckets if not b.frozen]
        with torch.no_grad():
            for b in self.buckets:
                b.outer = {"global": b.master.detach().clone()}
                if self.opt.momentum:
                    b.outer["momentum"] = torch.zeros_like(b.master)
                if self.dtype != "fp32":
                    b.outer["residual"] = torch.zeros_like(b.master)
                if self.delayed:
                    b.outer["pending"] = torch.zeros_like(b.master)
        self.federated = federated(isl)
        self.per_round = per_round(isl)
        self.seed = cfg.train.seed
        self.prox_mu = isl.prox_mu
        if self.prox_mu > 0:  # FedProx; 0 adds no term: the engine computes exactly what it did before
            self.inner.grad_terms.append(ProxTerm(self.prox_mu))
        self.data: DataFingerprint | None = None
        self.secure = SecureSum(link.store, island, self.count, self.col.rank()) if isl.secure_aggregation else None
        self.clip, self.noise = isl.clip_norm, isl.noise_multiplier
        self.round_noise: list[float] = []
        """The noise multiplier each outer step's sum carried (lower when fewer clients took part)."""
        self._noise_gen = torch.Generator().manual_seed(secrets.randbits(63))  # unpredictable, never logged
        self._group_seen = None
        self._beat = None
        if self.col.rank() == 0:
            self._beat = _Heartbeat(link, island)

    # --- where an island stands -------------------------------------------------------
    def watch(self, data):
        """``data``, fingerprinted when the island reads its own ``islands.client_data`` entry."""
        if client_paths(self.cfg.islands):
            self.data = DataFingerprint(data, self.cfg.data.path)
            return self.data
        return data

    def round_clients(self, step: int) -> tuple[int, ...]:
        """The islands that take part in the outer step after ``step`` inner steps (its round:
        ``(step - 1) // sync_every``), drawn from train.seed (islands.clients_per_round)."""
        return round_clients(self.seed, (step - 1) // self.every, self.count, self.per_round)

    def replica(self) -> tuple[int, int]:
        """(index, count) of this rank's share of the global batch: islands first, then inner dp."""
        dims = self.engine.dims
        return self.island * dims.dp + dims.coords(self.col.rank())["dp"], self.count * dims.dp

    def due(self, step: int) -> bool:
        """Whether an outer step follows ``step`` completed inner steps."""
        return step % self.every == 0 or step == self.steps

    def reset_global(self) -> None:
        """The global parameters := the masters (a checkpoint without outer state was loaded)."""
        with torch.no_grad():
            for b in self.buckets:
                b.outer["global"].copy_(b.master)

    def state(self) -> dict:
        """What checkpoints keep besides the tensors."""
        return {"outer_steps": self.outer_steps, "island": self.island, "count": self.count,
                **({"held": self._held} if self.delayed else {})}

    def load_state(self, state: dict | None) -> None:
        if state:
            self.outer_steps = int(state.get("outer_steps", 0))
            self._held = self.delayed and bool(state.get("held", False))
            if state.get("held") and not self.delayed:
                log.warning("island %d: the checkpoint holds an outer step's average not yet applied "
                            "(islands.overlap = \"delayed\"); resumed with islands.overlap = \"off\", it is "
                            "dropped (that round's training is lost): resume with overlap \"delayed\" to apply it",
                            self.island)

    def close(self) -> None:
        if self._beat is not None:
            self._beat.stop()

    # --- the outer step -----------------------------------------------------------------
    def start(self, step: int) -> int:
        """The step to train from: ``step``, or for an island the launcher restarted, the next outer
        step's boundary, where it receives the global state from a live island."""
        if not self.rejoin:
            return step
        at = self.link.progress() if self.col.rank() == 0 else None
        target = self._share_int(min(self.steps, (at["step"] if at else 0) + self.every) if at else step)
        if at is None and step == 0:
            return step  # restarted before the first outer step: the seeded start is everyone's
        while True:
            q = self._agree(target, joiner=True)
            if self.island in q.members:
                self._join(q)
                log.info("island %d rejoined at step %d (islands %s)", self.island, target, list(q.members))
                return target
            if target >= self.steps:
                return self.steps  # the run ended without this island
            target = min(self.steps, target + self.every)

    def sync(self, step: int) -> None:
        """The outer step after ``step`` completed inner steps (call when :meth:`due`).

        ``islands.overlap = "delayed"`` (before the last step): the exchange of the previous outer
        step is waited for and its average applied first (:meth:`settle`, :meth:`_apply_held`),
        then this step's exchange is only started and the local parameters restart from the
        global ones; the next outer step applies it. At the last step, or with joiners in the
        quorum (they receive the state right after the exchange), the outer step blocks."""
        if self.delayed and self.link.wire_dir is not None:
            self._record_params("outer-in", ("master",))
        with torch.no_grad():
            if self.delayed:
                if not self.settle():
                    return  # left out of the exchange in flight: it rejoined meanwhile
                self._apply_held()
            x = self._pseudo_gradient()
            drift = float(torch.linalg.vector_norm(x.double()))
            if self.federated and self.island in self.round_clients(step):
                x = self._privatize(x)  # clipped (and noised) once per round: a retry resends the same update
        sent0 = self.link.totals()[1]
        overlap = self.delayed and step < self.steps
        done = self._round(x, step, overlap=overlap)
        if done is None:
            return  # left out of this quorum: it rejoined at a later one
        q, ex, attempt = done
        took_part = self.island in self.round_clients(step)
        if not ex.done:  # started: the next inner steps run while it crosses
            self._pending = _InFlight(x, step, ex, attempt, sent0, drift, took_part)
            with torch.no_grad():
                for b in self.buckets:
                    self._owned(b, b.master).copy_(self._owned(b, b.outer["global"]))
                self._refresh()
        else:
            avg, sent = ex.result()
            with torch.no_grad():
                self._apply(avg, x, sent, took_part=took_part)
                if q.joiners:
                    self._donate(q)
            self._log_round(step, q, attempt, sent0, drift)
        if self.delayed and self.link.wire_dir is not None:
            self._record_params("outer-out", ("global", "master"))

    def _round(self, x: torch.Tensor, step: int, *, attempt: int = 0, ex: _Exchange | None = None,
               overlap: bool = False) -> tuple[Quorum, _Exchange, int] | None:
        """Outer step ``step``'s exchange of ``x`` to its end, retried without islands that die:
        (quorum, exchange, try). ``overlap``: only started (unless the quorum has joiners); ``ex``:
        an exchange started earlier, waited for here. None: this island was left out of a quorum
        and rejoined at a later outer step meanwhile."""
        while True:
            if ex is None:
                q = self._agree(step, attempt=attempt)
                if self.island not in q.members:  # too late for this quorum: fetch the state at the next one
                    log.warning("island %d was left out of the outer step at %d; it rejoins at the next one",
                                self.island, step)
                    self.rejoin = True
                    self._restart_from(step)
                    return None
                ex = self._start_exchange(x, q, f"{step}/{attempt}")
                if overlap and not q.joiners:
                    return q, ex, attempt
            try:
                ex.wait()
                ok = 1
            except CollectiveError as exc:  # an island died mid-exchange: a new quorum without it
                log.warning("island %d: outer step at %d failed (%s); forming a new quorum", self.island, step, exc)
                ok = 0
            if self._all_ok(ok):
                return ex.quorum, ex, attempt
            attempt += 1
            ex = None

    def settle(self) -> bool:
        """Wait for the delayed exchange in flight, if any, and hold its average in the buckets'
        ``outer["pending"]`` (checkpointed) until the next outer step applies it. A peer that died
        fails the wait within the link's timeout; the exchange is then retried, blocking, by a new
        quorum of the live islands (as a blocking outer step is). False: this island was left out
        of it and has rejoined at a later outer step meanwhile."""
        p, self._pending = self._pending, None
        if p is None:
            return True
        done = self._round(p.x, p.step, attempt=p.attempt, ex=p.ex)
        if done is None:
            return False
        q, ex, attempt = done
        avg, sent = ex.result()
        with torch.no_grad():
            off = 0
            for b in self.buckets:
                n = self._owned(b, b.master).numel()
                self._owned(b, b.outer["pending"]).copy_(avg[off:off + n].to(b.master.device))
                if "residual" in b.outer and p.took_part:
                    self._owned(b, b.outer["residual"]).copy_((p.x[off:off + n] - sent[off:off + n]).to(b.master.device))
                off += n
        self._held = True
        self._log_round(p.step, q, attempt, p.sent0, p.drift)
        return True

    def _apply_held(self) -> None:
        """The held average (the previous outer step's) applied: the global parameters take the
        outer optimizer's step, and the local ones, which trained on from the old global
        parameters, are re-based onto the new: ``local += new_global - old_global``."""
        if not self._held:
            return
        self._held = False
        self.outer_steps += 1
        for b in self.buckets:
            g = self._owned(b, b.outer["global"])
            old = g.clone()
            state = {"momentum": self._owned(b, b.outer["momentum"])} if "momentum" in b.outer else {}
            self.opt.update(g, self._owned(b, b.outer["pending"]), state, self.outer_steps, self.lr,
                            self.backend.kernels)
            self._owned(b, b.master).add_(g - old)

    def _log_round(self, step: int, q: Quorum, attempt: int, sent0: int, drift: float) -> None:
        self.history.append({"step": step, "members": list(q.members), "joiners": list(q.joiners),
                             "sampled": list(self.round_clients(step)), "attempts": attempt + 1,
                             "bytes": self.link.totals()[1] - sent0, "drift": drift})

    def _record_params(self, what: str, names: tuple[str, ...]) -> None:
        """Wire log (delayed mode): this rank's owned slices of ``names`` (master: the local
        parameters; global), kept here, never sent: what an audit replays the delayed update from."""
        with torch.no_grad():
            self.link.record(what, [torch.cat([self._owned(b, b.master if n == "master" else b.outer[n]).float().cpu()
                                               for b in self.buckets]) for n in names], sent=False)

    def _restart_from(self, step: int) -> None:
        target = min(self.steps, step + self.every)
        while True:
            q = self._agree(target, joiner=True)
            if self.island in q.members:
                self._join(q)
                return
            target = min(self.steps, target + self.every)

    def _pseudo_gradient(self) -> torch.Tensor:
        """Flat float32 host tensor: ``global - local`` (+ the residual) of every owned slice."""
        parts = []
        for b in self.buckets:
            d = self._owned(b, b.outer["global"]) - self._owned(b, b.master)
            if "residual" in b.outer:
                d += self._owned(b, b.outer["residual"])
            parts.append(d.float().cpu())
        return torch.cat(parts) if parts else torch.zeros(0)

    def _privatize(self, x: torch.Tensor) -> torch.Tensor:
        """The update this client contributes: clipped to L2 norm ``clip_norm``, plus its share of
        the round's Gaussian noise (std ``noise_multiplier * clip_norm / sqrt(k)`` per element, ``k`` the
        clients per round)."""
        norm = float(torch.linalg.vector_norm(x.double()))
        u = x * (self.clip / max(norm, self.clip))
        if self.noise > 0:
            u = u + torch.randn(u.shape, generator=self._noise_gen) * (self.noise * self.clip / self.per_round ** 0.5)
        if self.link.wire_dir is not None:
            self.link.record("update", [u], sent=False)
        return u

    def _exchange(self, x: torch.Tensor, q: Quorum, round_key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the contributors' average pseudo-gradient, what this island's share decoded to)."""
        return self._start_exchange(x, q, round_key).result()

    def _start_exchange(self, x: torch.Tensor, q: Quorum, round_key: str) -> _Exchange:
        """The exchange of ``x`` with the quorum's islands, started on the link (secure aggregation:
        done). A failure to start is raised when it is waited for."""
        try:
            self.link.use(q)
            sampled = self.round_clients(q.step)
            takers = [m for m in q.contributors if m in sampled]
            n = max(1, len(takers))  # nobody sampled is alive: the sum is zeros
            mine = x if self.island in takers else torch.zeros_like(x)
            if self.noise > 0 and takers:  # the sum's noise: len(takers) shares of variance (noise * clip)^2 / k
                self.round_noise.append(self.noise * (len(takers) / self.per_round) ** 0.5)
            if self.secure is not None:
                total = self._secure_sum(mine, q, round_key)
                return _Exchange(q, [], lambda: total / n, mine)
            if self.dtype == "fp32":
                t = mine.clone()
                return _Exchange(q, [self.link.all_reduce(t, wait=False)], lambda: t / n, mine)
            if self.dtype == "bf16":
                codes = mine.to(torch.bfloat16)
                parts, p = self.link.all_gather(codes, wait=False)
                return _Exchange(q, [p], lambda: _ordered_sum(c.float() for c in parts) / n, codes.float())
            codes, scale = quantize_int8(mine)
            (all_codes, p1), (all_scales, p2) = self.link.all_gather(codes, wait=False), self.link.all_gather(scale, wait=False)
            return _Exchange(q, [p1, p2], lambda: _ordered_sum(dequantize_int8(c, s) for c, s in
                                                               zip(all_codes, all_scales, strict=True)) / n,
                             dequantize_int8(codes, scale))
        except CollectiveError as exc:
            return _Exchange(q, [], None, x, error=exc)

    def _secure_sum(self, mine: torch.Tensor, q: Quorum, round_key: str) -> torch.Tensor:
        """The sum of the members' updates, with only masked vectors on the link (secure.py)."""
        if q.group_id != self._group_seen:  # members changed: a restarted client has a new key
            self.secure.forget()
            self._group_seen = q.group_id
        bound = len(q.members) * self.clip + SIGMAS * self.noise * self.clip
        scale = scale_for(bound)
        t = self.secure.masked(mine, scale, q.members, round_key)
        self.link.all_reduce(t)
        return decode_sum(t, scale)

    def _apply(self, avg: torch.Tensor, x: torch.Tensor, sent: torch.Tensor, took_part: bool = True) -> None:
        self.outer_steps += 1
        off = 0
        for b in self.buckets:
            g = self._owned(b, b.outer["global"])
            n = g.numel()
            piece = avg[off:off + n].to(g.device)
            state = {"momentum": self._owned(b, b.outer["momentum"])} if "momentum" in b.outer else {}
            self.opt.update(g, piece, state, self.outer_steps, self.lr, self.backend.kernels)
            if "residual" in b.outer and took_part:  # error feedback: what the wire format dropped goes out next time
                self._owned(b, b.outer["residual"]).copy_((x[off:off + n] - sent[off:off + n]).to(g.device))
            self._owned(b, b.master).copy_(g)
            off += n
        self._refresh()

    def _refresh(self) -> None:
        """The engine's parameters (and, at ZeRO 0, every dp rank's whole master) from the masters."""
        e = self.inner
        for b in self.buckets:
            if e.zero == 0:
                if b.n > 1:
                    full = torch.empty(b.padded, dtype=torch.float32, device=e.device)
                    self.col.all_gather(full, b.master[b.lo:b.hi].to(e.device).contiguous(), group=b.group)
                    b.master.copy_(full)
                    for name in ("global", "momentum"):
                        if name in b.outer:
                            self.col.all_gather(full, b.outer[name][b.lo:b.hi].to(e.device).contiguous(), group=b.group)
                            b.outer[name].copy_(full)
                if not b.master_aliases_params:
                    b.full.copy_(b.master)
            elif e.zero == 3:
                if not b.master_aliases_params:
                    b.param_shard.copy_(b.master)
            else:
                b.full[b.lo:b.hi].copy_(b.master)
                if b.n > 1:
                    self.col.all_gather(b.full, b.full[b.lo:b.hi].clone(), group=b.group)

    # --- joining ------------------------------------------------------------------------
    def _state_tensors(self) -> list[torch.Tensor]:
        """What a joiner receives, per bucket: global parameters, outer momentum, inner optimizer state."""
        out = []
        for b in self.buckets:
            out.append(self._owned(b, b.outer["global"]))
            if "momentum" in b.outer:
                out.append(self._owned(b, b.outer["momentum"]))
            if not self.federated:  # a client's inner state comes from its private data: it stays
                out += [self._owned(b, b.state[n]) for n in sorted(b.state)]
        return out

    def _donate(self, q: Quorum) -> None:
        self._send_state(q, donor=q.contributors[0])

    def _join(self, q: Quorum) -> None:
        """Receive the global state from the quorum's first contributor. The contributors first
        exchange their pseudo-gradients over the quorum's group, joiners included: a joiner
        takes part with zeros (otherwise its peers would wait in that all-reduce while it waits
        in the state's broadcast), then receives the state they reach."""
        with torch.no_grad():
            self._exchange(torch.zeros_like(self._pseudo_gradient()), q, f"{q.step}/0")
            self._send_state(q, donor=q.contributors[0])
            for b in self.buckets:
                self._owned(b, b.master).copy_(self._owned(b, b.outer["global"]))
                if "residual" in b.outer:
                    b.outer["residual"].zero_()
            self._refresh()
        self.rejoin = False
        self._pending, self._held = None, False  # delayed mode: the state received is the quorum's, applied
        self.history.append({"step": q.step, "members": list(q.members), "joiners": list(q.joiners),
                             "attempts": 1, "bytes": 0, "joined": True})

    def _send_state(self, q: Quorum, donor: int) -> None:
        e = self.inner
        head = torch.tensor([self.outer_steps, e.step_count, len(self.round_noise)], dtype=torch.int64)
        self.link.broadcast([head], donor)
        self.outer_steps, e.step_count = int(head[0]), int(head[1])
        if int(head[2]):  # the job's privacy history: a restarted client reports what the job spent
            noise = torch.tensor(self.round_noise if self.island == donor else [0.0] * int(head[2]),
                                 dtype=torch.float64)
            self.link.broadcast([noise], donor)
            self.round_noise = noise.tolist()
        for t in self._state_tensors():
            host = t if t.device.type == "cpu" and t.is_contiguous() else t.detach().cpu().contiguous()
            self.link.broadcast([host], donor)
            if host is not t:
                t.copy_(host)

    # --- agreement within the island ------------------------------------------------------
    def _agree(self, step: int, *, attempt: int = 0, joiner: bool = False) -> Quorum:
        """The quorum of outer step ``step`` (try ``attempt``), the same on every rank of the island:
        decided by its first rank, broadcast inside the island."""
        k = self.count
        vec = torch.zeros(3 + 2 * k, dtype=torch.int64)
        if self.col.rank() == 0:
            serial = step * 1000 + attempt
            self.link.announce(str(serial), joiner)
            q = self.link.decide(str(serial), step, serial)
            vec[0], vec[1], vec[2] = q.step, q.group_id, 1
            for m in q.members:
                vec[3 + m] = 1
            for j in q.joiners:
                vec[3 + k + j] = 1
        if self.col.world_size() > 1:
            dev = vec.to(self.inner.device)
            self.col.broadcast(dev, 0)
            vec = dev.cpu()
        members = tuple(i for i in range(k) if vec[3 + i])
        joiners = tuple(i for i in range(k) if vec[3 + k + i])
        return Quorum(int(vec[0]), members, joiners, int(vec[1]))

    def _all_ok(self, ok: int) -> bool:
        if self.col.world_size() == 1:
            return bool(ok)
        t = torch.tensor([ok], dtype=torch.int64, device=self.inner.device)
        self.col.all_reduce(t, "min")
        return bool(int(t))

    def _share_int(self, value: int | None) -> int:
        t = torch.tensor([value or 0], dtype=torch.int64, device=self.inner.device)
        if self.col.world_size() > 1:
            self.col.broadcast(t, 0)
        return int(t)

    def _owned(self, b, t: torch.Tensor) -> torch.Tensor:
        """The slice of ``t`` (shaped like ``b.master``) this rank exchanges: ZeRO 0 holds the whole
        bucket on every dp rank, so each exchanges its own 1/dp of it."""
        return t[b.lo:b.hi] if self.inner.zero == 0 else t

    # --- reporting -----------------------------------------------------------------------
    def summary(self) -> dict:
        calls, nbytes, seconds = self.link.totals()
        return {"island": self.island, "count": self.count, "sync_every": self.every,
                "outer_steps": self.outer_steps, "pseudo_grad_dtype": self.dtype,
                "outer_optimizer": self.cfg.islands.outer_optimizer, "outer_lr": self.lr,
                "cross_island": {"calls": calls, "bytes": nbytes, "seconds": seconds},
                "prox_mu": self.prox_mu, "clients_per_round": self.per_round, "quorums": self.history,
                **({"data": self.data.summary()} if self.data is not None else {}),
                **({"privacy": self.privacy()} if self.federated else {})}

    def privacy(self) -> dict:
        """What the federated run protects and, with noise, the (epsilon, delta) it spent (privacy.py)."""
        isl = self.cfg.islands
        out = {"secure_aggregation": isl.secure_aggregation, "clip_norm": isl.clip_norm,
               "noise_multiplier": isl.noise_multiplier}
        if self.noise > 0:
            out.update(rounds_spent(self.round_noise, isl.dp_delta, sample_rate=self.per_round / self.count).to_dict())
        return out


def _ordered_sum(parts) -> torch.Tensor:
    """A sum in the islands' order: the same bits on every island."""
    total = None
    for p in parts:
        total = p.clone() if total is None else total.add_(p)
    return total


class _Heartbeat:
    """A counter on the store this island bumps every :data:`HEARTBEAT_S` (its own store client):
    quorums wait for islands whose counter moves, not for dead ones."""

    def __init__(self, link: IslandLink, island: int):
        self._stop = threading.Event()
        self._store = link.clone_store()
        self._key = f"hb/{island}"
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._run, name=f"chipset-island-{island}-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - the store went away with the job: nothing to report to
                return

    def stop(self) -> None:
        self._stop.set()

