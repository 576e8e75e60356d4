"""The built-in transformer's own configuration rules: what its ``[model]`` keys must satisfy,
alone and with the parallel layout. Checked before launch through ``TransformerFamily.config_problems``
(called by the run configuration's validation, train/config.py); other families declare their own.
Each rule is a sentence saying what was found and what to do.
"""

from __future__ import annotations

import math

from chipset.errors import ConfigError
from chipset.models.config import ROUTERS
from chipset.parallel.split import parse_split

__all__ = ["attention_problems", "moe_problems", "pipeline_split_problems", "tp_cp_problems"]


def attention_problems(m, tr) -> list[str]:
    """Heads, kv heads, head dim (rotary needs it even) and the sequence length."""
    problems = []
    if m.head_dim < 0 or m.head_dim % 2:
        problems.append(f"model.head_dim = {m.head_dim!r}: expected an even number, or 0 for hidden_size / heads")
    elif m.head_dim:
        pass
    elif m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        problems.append(
            f"model.num_attention_heads ({m.num_attention_heads}) must divide model.hidden_size ({m.hidden_size})"
        )
    elif m.num_attention_heads > 0 and (m.hidden_size // m.num_attention_heads) % 2:
        problems.append(
            f"head dim hidden_size/num_attention_heads ({m.hidden_size}/{m.num_attention_heads}) must be even for rotary embeddings"
        )
    kv = m.num_key_value_heads or m.num_attention_heads
    if (m.num_key_value_heads < 0 or (kv > 0 and m.num_attention_heads % kv)):
        problems.append(
            f"model.num_key_value_heads ({m.num_key_value_heads}) must divide model.num_attention_heads ({m.num_attention_heads})"
        )
    if tr.seq_len > m.max_position_embeddings:
        problems.append(
            f"train.seq_len ({tr.seq_len}) must be <= model.max_position_embeddings ({m.max_position_embeddings})"
        )
    return problems


def pipeline_split_problems(m, par) -> list[str]:
    """``parallel.pipeline_split`` (blocks per virtual stage) and the number of pipeline units
    (embedding, each block, head) against pp x virtual_stages."""
    problems = []
    parts = par.pp * max(par.virtual_stages, 1)
    if par.pipeline_split:
        try:
            parse_split(par.pipeline_split, parts, m.num_hidden_layers)
        except ConfigError as exc:
            problems.append(str(exc))
    elif parts > m.num_hidden_layers + 2:
        problems.append(
            f"pp*virtual_stages ({parts}) exceeds the model's {m.num_hidden_layers + 2} pipeline units (embedding, "
            f"{m.num_hidden_layers} blocks, head); lower parallel.pp/virtual_stages or raise model.num_hidden_layers"
        )
    return problems


def tp_cp_problems(m, par, tr) -> list[str]:
    """Tensor, sequence and context parallelism against the model and the sequence length."""
    problems = []
    kv = m.num_key_value_heads or m.num_attention_heads
    if par.tp > 1:
        for what, n, key in (("heads", m.num_attention_heads, "num_attention_heads"),
                             ("kv heads", kv, "num_key_value_heads"),
                             ("the MLP width", m.intermediate_size, "intermediate_size")):
            if n > 0 and n % par.tp:
                problems.append(f"tp ({par.tp}) must divide {what} ({n}) (model.{key}); choose another parallel.tp")
    if par.cp > 1 and tr.seq_len > 0 and tr.seq_len % (2 * par.cp):
        problems.append(
            f"train.seq_len ({tr.seq_len}) must be divisible by 2*cp ({2 * par.cp}): context parallelism cuts each "
            "sequence into 2*cp chunks"
        )
    elif par.sequence_parallel and par.tp > 1 and par.cp > 0 and tr.seq_len > 0 and (tr.seq_len // par.cp) % par.tp:
        problems.append(
            f"train.seq_len/cp ({tr.seq_len}/{par.cp}) must be divisible by tp ({par.tp}) with parallel.sequence_parallel"
        )
    if par.cp > 1 and par.cp_attention == "ulysses" and (m.num_attention_heads // max(par.tp, 1)) % par.cp:
        problems.append(
            f"cp_attention = 'ulysses' splits heads over cp: heads per tp rank ({m.num_attention_heads}/{par.tp}) "
            f"must be divisible by cp ({par.cp}); choose another parallel.cp or cp_attention = 'ring'"
        )
    ulysses = getattr(par, "cp_ulysses", 0)
    if par.cp > 1 and par.cp_attention == "hybrid" and ulysses > 1 and (m.num_attention_heads // max(par.tp, 1)) % ulysses:
        problems.append(
            f"cp_attention = 'hybrid' splits heads over cp_ulysses: heads per tp rank ({m.num_attention_heads}/{par.tp}) "
            f"must be divisible by cp_ulysses ({ulysses}); choose another parallel.cp_ulysses or cp_attention = 'ring'"
        )
    return problems


def moe_problems(m, par) -> list[str]:
    """Mixture-of-experts keys and their combination with the parallel layout."""
    problems = []
    moe = m.num_experts > 1
    if m.num_experts < 0:
        problems.append(f"model.num_experts = {m.num_experts!r}: expected 0 (dense) or a number of experts")
    if m.num_experts_per_tok < 1 or m.moe_every < 1:
        problems.append(f"model.num_experts_per_tok ({m.num_experts_per_tok}) and model.moe_every "
                        f"({m.moe_every}) must be >= 1")
    elif moe and m.num_experts_per_tok > m.num_experts:
        problems.append(f"model.num_experts_per_tok ({m.num_experts_per_tok}) must be <= model.num_experts "
                        f"({m.num_experts})")
    if m.router not in ROUTERS:
        problems.append(f"model.router = {m.router!r}: expected one of {', '.join(ROUTERS)}")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(m, name) < 0:
            problems.append(f"model.{name} = {getattr(m, name)!r}: expected an integer >= 0 (0 = {'intermediate_size' if name.startswith('moe') else 'no shared expert'})")
    for name in ("capacity_factor", "router_aux_loss_coef"):
        v = getattr(m, name)
        if not (v >= 0 and math.isfinite(v)):
            problems.append(f"model.{name} = {v!r}: expected a finite number >= 0")
    if moe and m.num_hidden_layers > 0 and m.moe_every > m.num_hidden_layers:
        problems.append(
            f"model.moe_every ({m.moe_every}) > model.num_hidden_layers ({m.num_hidden_layers}) leaves no MoE block; "
            "lower moe_every or set model.num_experts=0"
        )
    if par.ep > 1:
        if not moe:
            problems.append(
                f"parallel.ep = {par.ep} needs a mixture-of-experts model: set model.num_experts to a multiple of {par.ep}"
            )
        elif m.num_experts % par.ep:
            problems.append(f"parallel.ep ({par.ep}) must divide model.num_experts ({m.num_experts})")
        if par.dp > 0 and par.cp > 0 and (par.dp * par.cp) % par.ep:
            where = "parallel.dp" if par.cp == 1 else f"dp*cp ({par.dp}*{par.cp})"
            problems.append(
                f"parallel.ep ({par.ep}) must divide {where} ({par.dp * par.cp}): expert-parallel groups are carved "
                "out of the data-parallel (and context-parallel) ranks"
            )
    return problems
