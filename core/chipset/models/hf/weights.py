"""Reading Hugging Face safetensors weights: the files, the names, one box of a tensor at a time.

``chipset.train.hf_weights.load_into_engine`` fills a built, parallelised engine from these:
for each box of the logical (single-process) tensor a rank holds, it reads exactly that box
(``safe_open(...).get_slice(name)[rows, cols]``, which touches only those bytes of the
memory-mapped file), so no rank ever holds a whole tensor it does not own.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from chipset.models.hf.names import expert_names, to_hf

__all__ = ["SafetensorsDir", "name_problems", "read_box", "tensor_sources"]

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


class SafetensorsDir:
    """The tensors of an HF model directory: one ``model.safetensors`` or shards listed by
    ``model.safetensors.index.json``; files are opened lazily (memory-mapped)."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open  # the 'safetensors' package: pip install chipset[hf]

        self._safe_open = safe_open
        self.directory = Path(directory)
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            self.where = dict(json.loads(index.read_text())["weight_map"])
        else:
            f = self._open("model.safetensors")
            self.where = dict.fromkeys(f.keys(), "model.safetensors")

    def _open(self, file: str):
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                self._safe_open(str(self.directory / file), framework="pt", device="cpu"))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.where[name]).get_slice(name).get_shape())

    def get_slice(self, name: str):
        return self._open(self.where[name]).get_slice(name)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensor_sources(name: str, shape: tuple[int, ...], family: str) -> list[str] | str:
    """The HF tensor of ``name``, or the per-expert tensors stacked into it (MoE families)."""
    return expert_names(name, family, shape[0]) or to_hf(name, family)


def name_problems(src: SafetensorsDir, shapes: dict[str, tuple[int, ...]], tied: bool, family: str) -> list[str]:
    problems = []
    wanted = {}
    for n, s in shapes.items():
        hf = tensor_sources(n, s, family)
        if isinstance(hf, list):
            wanted.update({e: (n, s[1:]) for e in hf})
        else:
            wanted[hf] = (n, s)
    for hf, (n, s) in sorted(wanted.items()):
        if hf not in src.where:
            problems.append(f"{hf}: missing from the safetensors files (chipset parameter {n}, shape {tuple(s)})")
        elif src.shape(hf) != tuple(s):
            problems.append(f"{hf}: shape {src.shape(hf)} in the file, the config.json gives {tuple(s)}")
    for hf in sorted(set(src.where) - set(wanted)):
        if hf.endswith(_IGNORED_SUFFIXES) or (tied and hf == "lm_head.weight"):
            continue
        problems.append(f"{hf}: in the safetensors files but not in the model config.json describes")
    return problems


def read_box(src: SafetensorsDir, hf: list[str] | str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """One box of a logical tensor; for stacked experts, the box's rows of each expert's tensor."""
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    if isinstance(hf, str):
        return src.get_slice(hf)[index]
    return torch.stack([src.get_slice(hf[e])[index[1:]] for e in range(offsets[0], offsets[0] + sizes[0])])
