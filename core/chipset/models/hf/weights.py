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
from chipset.models.hf.names import to_hf

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


def _check(src: SafetensorsDir, shapes: dict[str, tuple[int, ...]], tied: bool) -> list[str]:
    problems = []
    wanted = {to_hf(n): (n, s) for n, s in shapes.items()}
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


def load_into_engine(engine, directory: str | Path) -> int:
    """Fill every parameter (and fp32 master) this rank holds from ``directory``; returns bytes read.

    Collective-free: each rank reads its own boxes. Raises ConfigError (exit 2) naming every
    missing, extra or mis-shaped tensor.
    """
    from chipset.engine.checkpoint.layout import engine_pieces, logical_shapes

    directory = Path(directory)
    read = 0
    with SafetensorsDir(directory) as src:
        shapes = logical_shapes(engine)
        tied = "head.lm_head.weight" not in shapes
        problems = _check(src, shapes, tied)
        if problems:
            shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
            raise ConfigError(f"model.init_from = {str(directory)!r}: the weights do not match the model:\n"
                              + "\n".join(f"  - {p}" for p in shown))
        alias = all(b.master_aliases_params for b in engine.buckets)
        kinds = ("optim.master",) if alias else ("optim.master", "model")
        with torch.no_grad():
            for kind in kinds:
                for name, _, pieces in engine_pieces(engine, kind, for_load=True):
                    sl = src.get_slice(to_hf(name))
                    for piece in pieces:
                        for box in piece.boxes:
                            part = sl[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]
                            box.view(piece.tensor).copy_(part.reshape(box.sizes))
                            read += part.numel() * part.element_size()
                            del part
    log.info("loaded %d bytes of Hugging Face weights from %s", read, directory)
    return read
