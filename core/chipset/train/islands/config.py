"""The ``[islands]`` config table and its rules.

Islands split the job's ranks into ``islands.count`` groups that train on their own for
``islands.sync_every`` steps and then exchange pseudo-gradients (docs/islands.md).
The table lives in :class:`chipset.train.config.RunConfig`; this module holds its
dataclass and cross-field rules so the main config module stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IslandsConfig", "OUTER_OPTIMIZERS", "OVERLAP_MODES", "PSEUDO_GRAD_DTYPES", "CLIENT_DATA_SOURCES", "federated", "island_problems",
           "island_backends", "client_paths", "client_data_problems", "per_round"]

OUTER_OPTIMIZERS = ("nesterov", "sgd")
PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "int8")
OVERLAP_MODES = ("off", "delayed")
CLIENT_DATA_SOURCES = ("text", "tokens")
"""data.source values islands.client_data works with (a local file or folder per client)."""


@dataclass
class IslandsConfig:
    """Islands of ranks that train apart and meet every sync_every steps (DiLoCo / local SGD; docs/islands.md)."""

    count: int = 1
    """Islands the job's ranks split into (1 = off); each island gets world size / count ranks and runs the [parallel] layout inside."""
    sync_every: int = 20
    """Inner steps between outer steps (DiLoCo's H); the last step always ends with an outer step."""
    outer_optimizer: str = "nesterov"
    """Outer optimizer on the averaged pseudo-gradient: nesterov (SGD with Nesterov momentum islands.outer_momentum, DiLoCo's) or sgd (plain; outer_lr = 1 is FedAvg: the global parameters become the islands' average)."""
    outer_lr: float = 0.5
    """Outer learning rate (> 0; 1.0 with sgd averages the islands). The default 0.5 with momentum 0.5 is what worked best at H = 20 in docs/islands.md's measurement; DiLoCo's 0.7 with momentum 0.9 were chosen for H = 500."""
    outer_momentum: float = 0.5
    """Momentum of the nesterov outer optimizer, in [0, 1)."""
    pseudo_grad_dtype: str = "fp32"
    """How pseudo-gradients cross between islands: fp32, bf16 or int8 (both with error feedback: what rounding dropped is added to the next outer step's pseudo-gradient)."""
    overlap: str = "off"
    """Whether the outer exchange overlaps the next inner steps: off (the outer step blocks: DiLoCo) or delayed (the pseudo-gradients' exchange runs on the link while the next sync_every inner steps train, and its average is applied one outer step late, with the local parameters re-based by the change of the global ones; the last step still ends with a blocking outer step). Not with secure_aggregation or noise_multiplier (federated rounds stay synchronous)."""
    backends: str = ""
    """Comma-separated backend per island (e.g. "cpu,cpu_sim"); empty = every island on the launcher's backend (CHIPSET_BACKEND). The outer exchange runs over host gloo, which every backend has."""
    endpoint: str = ""
    """HOST:PORT of the store the islands meet at (multi-node jobs: the node running island 0 hosts it); empty = the launcher hosts one on loopback."""
    quorum_timeout: float = 60.0
    """Seconds an outer step waits for every island; islands still missing then are left out of that step (and rejoin later); 0 = wait for all, forever."""
    secure_aggregation: bool = False
    """Federated: the islands (clients, one rank each) send their updates masked by pairwise masks that cancel in the sum, so the outer all-reduce only ever holds masked vectors and the sum (docs/islands.md#federated-secure-aggregation-and-differential-privacy); updates are clipped to clip_norm."""
    noise_multiplier: float = 0.0
    """Federated differential privacy: Gaussian noise of noise_multiplier * clip_norm on the sum of the clients' clipped updates, every outer step (each client of the round adds its 1/sqrt(clients per round) share); the (epsilon, dp_delta) spent is reported by an RDP accountant. 0 = no noise (>= 0)."""
    clip_norm: float = 1.0
    """L2 norm each client's update (its pseudo-gradient) is clipped to, with secure_aggregation or noise_multiplier > 0 (> 0): the sensitivity of the sum to one client."""
    dp_delta: float = 1e-5
    """The delta at which the epsilon spent is reported (in (0, 1); well below 1 / clients)."""
    client_data: str = ""
    """Comma-separated data.path per island (client), one per islands.count, e.g. "clients/a.txt, clients/b.txt": island i reads only its entry (data.source text or tokens), so no client opens another's data; relative paths are resolved against the config file's folder. Empty = every island reads its share of each step's batch from data.path."""
    prox_mu: float = 0.0
    """FedProx (>= 0): each island's inner loss gets (prox_mu / 2) * ||w - w_global||^2, pulling its weights towards the round's global parameters (the term's gradient is added to the clipped loss gradient before the inner optimizer); 0 = FedAvg / DiLoCo as before."""
    clients_per_round: int = 0
    """Islands (clients) that take part in each outer step (round): a subset of this size drawn from train.seed and the round's index; the others send zeros and receive the round's global parameters. The DP accountant then uses the sampling rate clients_per_round / count. 0 = every island, every round."""
    wire_log: bool = False
    """Audit: every rank writes each tensor it hands to the link between islands (and, in federated runs, its own update before masking, which never leaves; with overlap = "delayed", the local parameters each outer step starts from and the global and local ones it ends on, kept here) to RUN_DIR/island-<i>/wire/."""


def island_backends(isl: IslandsConfig) -> list[str]:
    """``islands.backends`` as a list (empty: none named)."""
    return [b.strip() for b in isl.backends.split(",") if b.strip()]


def island_problems(isl: IslandsConfig, world_size: int | None, dp: int,
                    micro_batches: int, global_batch: int) -> list[str]:
    """Every problem of the table (and its fit with the world and the batch)."""
    problems = []
    if isl.count < 1:
        problems.append(f"islands.count = {isl.count!r}: expected a number of islands >= 1 (1 = no islands)")
    if isl.sync_every < 1:
        problems.append(f"islands.sync_every = {isl.sync_every!r}: expected a number of inner steps >= 1 between "
                        "outer steps (DiLoCo uses 500 on large models; 1 = an outer step after every step)")
    if isl.outer_optimizer not in OUTER_OPTIMIZERS:
        problems.append(f"islands.outer_optimizer = {isl.outer_optimizer!r}: expected one of {', '.join(OUTER_OPTIMIZERS)}")
    if not isl.outer_lr > 0:
        problems.append(f"islands.outer_lr = {isl.outer_lr!r}: expected a positive learning rate (0.5 default, 1.0 with sgd = FedAvg)")
    if not 0 <= isl.outer_momentum < 1:
        problems.append(f"islands.outer_momentum = {isl.outer_momentum!r}: expected a value in [0, 1)")
    if isl.pseudo_grad_dtype not in PSEUDO_GRAD_DTYPES:
        problems.append(f"islands.pseudo_grad_dtype = {isl.pseudo_grad_dtype!r}: expected one of {', '.join(PSEUDO_GRAD_DTYPES)}")
    if isl.overlap not in OVERLAP_MODES:
        problems.append(f"islands.overlap = {isl.overlap!r}: expected one of {', '.join(OVERLAP_MODES)} (off: the outer "
                        "step blocks; delayed: the exchange overlaps the next sync_every inner steps)")
    elif isl.overlap != "off" and federated(isl):
        problems.append(f"islands.overlap = {isl.overlap!r} with secure_aggregation / noise_multiplier: federated "
                        "rounds are synchronous (each round's clipped, masked update is applied in its round); "
                        "set islands.overlap = \"off\"")
    if isl.quorum_timeout < 0:
        problems.append(f"islands.quorum_timeout = {isl.quorum_timeout!r}: expected seconds >= 0 (0 = wait for every island)")
    problems += _federated_problems(isl, world_size)
    if not isl.prox_mu >= 0 or isl.prox_mu == float("inf"):
        problems.append(f"islands.prox_mu = {isl.prox_mu!r}: expected a finite FedProx coefficient >= 0 (0 = FedAvg; "
                        "0.001 to 1 are usual)")
    if isl.clients_per_round < 0 or (isl.count > 1 and isl.clients_per_round > isl.count):
        problems.append(f"islands.clients_per_round = {isl.clients_per_round!r}: expected 0 (every island, every "
                        f"round) or a number of islands from 1 to islands.count ({isl.count})")
    elif isl.clients_per_round and isl.count < 2:
        problems.append(f"islands.clients_per_round = {isl.clients_per_round} with islands.count = {isl.count}: "
                        "sampling picks islands per round; set islands.count >= 2")
    elif isl.secure_aggregation and isl.clients_per_round == 1:
        problems.append("islands.clients_per_round = 1 with secure_aggregation: the sum of one client's update is "
                        "that update; sample at least 2 clients per round")
    backends = island_backends(isl)
    if backends and len(backends) != isl.count:
        problems.append(f"islands.backends = {isl.backends!r} names {len(backends)} backend(s) for islands.count = "
                        f"{isl.count} islands; name one per island, or leave it empty for the launcher's backend")
    if isl.endpoint:
        host, sep, port = isl.endpoint.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            problems.append(f"islands.endpoint = {isl.endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29600")
    if isl.count > 1 and world_size is not None and world_size % isl.count:
        problems.append(f"islands.count ({isl.count}) must divide the world size ({world_size}): each island runs "
                        f"world/count ranks; run with --nproc {isl.count * max(1, round(world_size / isl.count))} "
                        "or choose another count")
    if isl.count > 1 and dp > 0 and micro_batches > 0 and global_batch > 0 and global_batch % (isl.count * dp * micro_batches):
        problems.append(f"train.global_batch ({global_batch}) must be divisible by islands.count*dp*micro_batches "
                        f"({isl.count}*{dp}*{micro_batches}): the global batch is split over the islands, then "
                        "over each island's dp ranks and micro-batches")
    return problems


def per_round(isl: IslandsConfig) -> int:
    """The islands that take part in each outer step (``clients_per_round``, 0 = all)."""
    return isl.clients_per_round or isl.count


def client_paths(isl: IslandsConfig) -> list[str]:
    """``islands.client_data`` as a list (empty: none named)."""
    return [p.strip() for p in isl.client_data.split(",") if p.strip()]


def client_data_problems(isl: IslandsConfig, da) -> list[str]:
    """Problems of ``islands.client_data`` with the ``[data]`` table ``da`` (the list and the source;
    whether each path can be read: :func:`chipset.train.config.client_data_path_problems`, on the
    node of that island)."""
    paths = client_paths(isl)
    if not paths:
        return []
    if isl.count < 2:
        return [f"islands.client_data names {len(paths)} path(s) with islands.count = {isl.count}: a path per "
                "island needs islands.count >= 2 (one entry per island)"]
    problems = []
    if len(paths) != isl.count:
        problems.append(f"islands.client_data names {len(paths)} path(s) for islands.count = {isl.count} islands; "
                        "give one data path per island, separated by commas")
    if da.source not in CLIENT_DATA_SOURCES or da.blend:
        problems.append(f"islands.client_data with data.source = {da.source!r}{' and data.blend' if da.blend else ''}: "
                        f"a path per client works with data.source = {' or '.join(CLIENT_DATA_SOURCES)} "
                        "(no blend); prepare each client's data with `chipset data prepare`")
    elif da.path and da.path not in paths:  # the worker's view holds its own entry there (client_config)
        problems.append(f"data.path = {da.path!r} and islands.client_data both given: each island reads its "
                        "entry of islands.client_data; leave data.path empty")
    return problems


def federated(isl: IslandsConfig) -> bool:
    """Whether the islands run as federated clients (secure aggregation and/or DP noise)."""
    return isl.secure_aggregation or isl.noise_multiplier > 0


def _federated_problems(isl: IslandsConfig, world_size: int | None) -> list[str]:
    problems = []
    if not isl.noise_multiplier >= 0:
        problems.append(f"islands.noise_multiplier = {isl.noise_multiplier!r}: expected a noise multiplier >= 0 "
                        "(the noise on the sum is noise_multiplier * clip_norm; 0 = no differential privacy)")
    if not isl.clip_norm > 0:
        problems.append(f"islands.clip_norm = {isl.clip_norm!r}: expected an L2 norm > 0 that each client's update "
                        "is clipped to (e.g. 1.0)")
    if not 0 < isl.dp_delta < 1:
        problems.append(f"islands.dp_delta = {isl.dp_delta!r}: expected a value in (0, 1), e.g. 1e-5")
    if not federated(isl):
        return problems
    if isl.count < 2:
        problems.append(f"islands.count = {isl.count}: secure aggregation and noise_multiplier need at least 2 "
                        "islands (clients); set islands.count")
    if isl.secure_aggregation and isl.pseudo_grad_dtype != "fp32":
        problems.append(f"islands.pseudo_grad_dtype = {isl.pseudo_grad_dtype!r} with secure_aggregation: bf16 and "
                        "int8 are all-gathered, which hands every client's update to every other; use \"fp32\" "
                        "(secure aggregation sends 48-bit fixed point in int64)")
    if world_size is not None and isl.count > 1 and world_size % isl.count == 0 and world_size > isl.count:
        problems.append(f"world size {world_size} with islands.count = {isl.count} and federated keys "
                        "(secure_aggregation / noise_multiplier): a federated client is an island of one rank; "
                        f"run with --nproc {isl.count}")
    return problems
