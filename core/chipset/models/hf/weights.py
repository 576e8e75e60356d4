"""Hugging Face safetensors weights into a built, parallelised engine.

The engine already knows, for every parameter, which boxes of the logical (single-process)
tensor this rank holds, in which buffer (:func:`chipset.engine.checkpoint.layout.engine_pieces`,
the same map checkpoints are resumed through). So loading is: for each box, read exactly
that box from the file (``safe_open(...).get_slice(name)[rows, cols]``, which touches only
those bytes of the memory-mapped file) and copy it, converted to the buffer's dtype, into
place. dp, ZeRO 0-3, tp (with vocabulary padding), pp and ep layouts all come out of that
map; no rank ever holds a whole tensor it does not own, let alone the whole model: host
memory beyond the engine's own is one box at a time.

Both the fp32 masters and the compute-dtype parameters are filled (a bf16 or fp16 file
is widened into the masters exactly).
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from chipset.errors import ConfigError
from chipset.models.hf.names import expert_names, to_hf

__all__ = ["SafetensorsDir", "load_into_engine"]

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


def _sources(name: str, shape: tuple[int, ...], family: str) -> list[str] | str:
    """The HF tensor of ``name``, or the per-expert tensors stacked into it (MoE families)."""
    return expert_names(name, family, shape[0]) or to_hf(name, family)


def _check(src: SafetensorsDir, shapes: dict[str, tuple[int, ...]], tied: bool, family: str) -> list[str]:
    problems = []
    wanted = {}
    for n, s in shapes.items():
        hf = _sources(n, s, family)
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


def _read_box(src: SafetensorsDir, hf: list[str] | str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """One box of a logical tensor; for stacked experts, the box's rows of each expert's tensor."""
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    if isinstance(hf, str):
        return src.get_slice(hf)[index]
    return torch.stack([src.get_slice(hf[e])[index[1:]] for e in range(offsets[0], offsets[0] + sizes[0])])


def load_into_engine(engine, directory: str | Path, architecture: str = "") -> int:
    """Fill every parameter (and fp32 master) this rank holds from ``directory``; returns bytes read.

    Collective-free: each rank reads its own boxes. Raises ConfigError (exit 2) naming every
    missing, extra or mis-shaped tensor.
    """
    from chipset.engine.checkpoint.layout import engine_pieces, logical_shapes
    from chipset.models.hf.config import SUPPORTED_ARCHITECTURES

    family = SUPPORTED_ARCHITECTURES.get(architecture, "llama")
    directory = Path(directory)
    read = 0
    with SafetensorsDir(directory) as src:
        shapes = logical_shapes(engine)
        tied = "head.lm_head.weight" not in shapes
        problems = _check(src, shapes, tied, family)
        if problems:
            shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
            raise ConfigError(f"model.init_from = {str(directory)!r}: the weights do not match the model:\n"
                              + "\n".join(f"  - {p}" for p in shown))
        alias = all(b.master_aliases_params for b in engine.buckets)
        kinds = ("optim.master",) if alias else ("optim.master", "model")
        with torch.no_grad():
            for kind in kinds:
                for name, shape, pieces in engine_pieces(engine, kind, for_load=True):
                    hf = _sources(name, shape, family)
                    for piece in pieces:
                        for box in piece.boxes:
                            part = _read_box(src, hf, box.offsets, box.sizes)
                            box.view(piece.tensor).copy_(part.reshape(box.sizes))
                            read += part.numel() * part.element_size()
                            del part
    log.info("loaded %d bytes of Hugging Face weights from %s", read, directory)
    return read
