"""The rules of a pipeline split: reading ``parallel.pipeline_split`` and balancing a chain.

A model's pipeline chain (``ModelFamily.pipeline_units``) is cut into ``p*v`` contiguous
runs (virtual stages), balanced by parameter count (:func:`balanced_runs`: the largest run as
small as possible) or as ``parallel.pipeline_split`` gives them. Most families count units
there; the built-in transformer counts blocks (:func:`parse_split`), its embedding joining
the first virtual stage and its head the last. Config validation checks the transformer's
counts here before any model exists (:func:`chipset.runtime.pipeline.pipeline_problems`).
"""

from __future__ import annotations

from chipset.errors import ConfigError

__all__ = ["balanced_runs", "parse_split", "read_counts"]


def read_counts(text: str, parts: int, what: str) -> tuple[list[int], list[str]]:
    """``parallel.pipeline_split`` as integers (ConfigError if it is not a comma-separated list
    of ``what`` counts), and the problem of an entry count other than ``parts``."""
    try:
        counts = [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise ConfigError(
            f"parallel.pipeline_split = {text!r}: expected comma-separated {what} counts per virtual stage, "
            f"e.g. \"{','.join(['1'] * parts)}\""
        ) from None
    return counts, ([] if len(counts) == parts else
                    [f"has {len(counts)} entries, expected pp*virtual_stages = {parts}"])


def parse_split(text: str, parts: int, num_layers: int) -> list[int]:
    """``"2,2"`` -> [2, 2]; the list must have ``parts`` entries summing to ``num_layers``."""
    counts, problems = read_counts(text, parts, "block")
    if sum(counts) != num_layers:
        problems.append(f"sums to {sum(counts)} blocks, expected model.num_hidden_layers = {num_layers}")
    if any(c < 0 for c in counts):
        problems.append("has a negative count")
    elif len(counts) == parts and any(c == 0 for c in counts[1:-1]):
        problems.append("leaves a middle virtual stage without blocks (only the first and last hold the "
                        "embedding or head and may have 0 blocks)")
    if problems:
        raise ConfigError(f"parallel.pipeline_split = {text!r} " + "; ".join(problems))
    return counts


def balanced_runs(weights: list[int], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` non-empty contiguous runs minimising the largest sum; run lengths."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible max over the first i units cut into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    lengths, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        lengths.append(i - j)
        i = j
    return lengths[::-1]
