"""Hugging Face model families in and out of chipset's reference transformer.

Small modules, one concern each, so they can become one family of a model-family
registry later:

* :mod:`.config` - HF ``config.json`` <-> :class:`chipset.train.config.ModelConfig` (which
  architectures and keys are supported, and the refusal of everything else);
* :mod:`.names` - chipset parameter names <-> HF tensor names;
* :mod:`.weights` - safetensors weights into a built, parallelised engine (each rank
  reads only the slices it holds);
* export (a DCP checkpoint to an HF directory or one torch state-dict file, without
  launching ranks) lives in :mod:`chipset.train.checkpoint.export`, as models never import
  torch.distributed.

No import of ``transformers`` anywhere: only the ``safetensors`` package is needed.
"""

from chipset.models.hf.config import (
    SUPPORTED_ARCHITECTURES,
    apply_hf_config,
    from_hf_config,
    to_hf_config,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "apply_hf_config", "from_hf_config", "to_hf_config"]
