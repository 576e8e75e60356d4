"""Hugging Face safetensors weights into a built, parallelised engine (``model.init_from``).

The engine already knows, for every parameter, which boxes of the logical (single-process)
tensor this rank holds, in which buffer (:func:`chipset.train.checkpoint.layout.engine_pieces`,
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

import logging
from pathlib import Path

import torch

from chipset.errors import ConfigError
from chipset.models.hf.config import SUPPORTED_ARCHITECTURES
from chipset.models.hf.weights import SafetensorsDir, name_problems, read_box, tensor_sources
from chipset.parallel.lora import is_adapter
from chipset.train.checkpoint.layout import engine_pieces, logical_shapes

__all__ = ["load_into_engine"]

log = logging.getLogger(__name__)


def load_into_engine(engine, directory: str | Path, architecture: str = "") -> int:
    """Fill every parameter (and fp32 master) this rank holds from ``directory``; returns bytes read.

    Collective-free: each rank reads its own boxes. Raises ConfigError (exit 2) naming every
    missing, extra or mis-shaped tensor.
    """
    family = SUPPORTED_ARCHITECTURES.get(architecture, "llama")
    directory = Path(directory)
    read = 0
    with SafetensorsDir(directory) as src:
        # LoRA adapters are not in the file: they keep their initial values (parallel/lora.py).
        shapes = {n: s for n, s in logical_shapes(engine).items() if not is_adapter(n)}
        tied = "head.lm_head.weight" not in shapes
        problems = name_problems(src, shapes, tied, family)
        if problems:
            shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
            raise ConfigError(f"model.init_from = {str(directory)!r}: the weights do not match the model:\n"
                              + "\n".join(f"  - {p}" for p in shown))
        alias = all(b.master_aliases_params for b in engine.buckets)
        kinds = ("optim.master",) if alias else ("optim.master", "model")
        with torch.no_grad():
            for kind in kinds:
                for name, shape, pieces in engine_pieces(engine, kind, for_load=True):
                    if is_adapter(name):
                        continue
                    hf = tensor_sources(name, shape, family)
                    for piece in pieces:
                        for box in piece.boxes:
                            part = read_box(src, hf, box.offsets, box.sizes)
                            box.view(piece.tensor).copy_(part.reshape(box.sizes))
                            read += part.numel() * part.element_size()
                            del part
    log.info("loaded %d bytes of Hugging Face weights from %s", read, directory)
    return read
