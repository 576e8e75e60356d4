"""Reference models. Model code never imports torch.distributed: the engine applies parallelism."""

from chipset.models.transformer import Transformer

__all__ = ["Transformer"]
