"""A small ResNet image classifier: the non-transformer family shipped with chipset.

It is written only against the family contract (chipset.models.family) and is the worked
example of a model that is not a sequence model: its own data (synthetic images), its own
FLOPs count, and pipeline stages cut from its chain of units (stem, residual blocks, pooled
head); it has no tensor parallelism (nothing but the head is an ``nn.Linear``). Select it with ``model.family = "resnet"``
(examples/resnet-tiny.toml, docs/models.md).

The ``model.*`` keys it reads, reusing the decoder's names for the same roles:

* ``hidden_size``: channels of the first stage (each later stage doubles them);
* ``num_hidden_layers``: residual blocks; every second block starts a new stage (stride 2,
  twice the channels);
* ``vocab_size``: number of classes.

Why GroupNorm and not BatchNorm: BatchNorm normalises with the statistics of the batch the
process sees, so under dp each rank would normalise its half-batch with its own mean and
variance and the run would no longer compute what one process computes (and its running
statistics would differ per rank). GroupNorm normalises each sample on its own, so a dp run
equals one process up to the order of floating-point sums.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from chipset.models.family import ModelFamily

__all__ = ["ResNet", "ResNetFamily", "SyntheticImages", "family", "forward_flops", "tiny"]

IMAGE_SIZE = 16
CHANNELS = 3


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(4, channels), channels)


class Block(nn.Module):
    """Two 3x3 convolutions with a residual; a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = _norm(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


def block_shapes(width: int, blocks: int) -> list[tuple[int, int, int]]:
    """(in channels, out channels, stride) of each residual block."""
    out, cin = [], width
    for i in range(blocks):
        cout = width * 2 ** (i // 2)
        stride = 2 if i and i % 2 == 0 else 1
        out.append((cin, cout, stride))
        cin = cout
    return out


class PooledLinear(nn.Linear):
    """Global average pool over the image, then the linear classifier: the head as one unit,
    so the chain stem -> blocks -> head is the whole forward (pipeline stages cut it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    """Stem (3x3 conv), residual blocks, global average pool, linear classifier."""

    def __init__(self, width: int = 8, blocks: int = 2, classes: int = 10, in_channels: int = CHANNELS):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), _norm(width), nn.ReLU())
        self.blocks = nn.ModuleList(Block(ci, co, s) for ci, co, s in block_shapes(width, blocks))
        self.head = PooledLinear(block_shapes(width, blocks)[-1][1] if blocks else width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def units(self) -> list[nn.Module]:
        """ZeRO-3 gathers the stem, then one residual block at a time, then the head; the same
        chain is what pipeline stages are cut from."""
        return [self.stem, *self.blocks, self.head]


class SyntheticImages:
    """Labelled images that a CNN can learn, the same sample ``i`` on every layout.

    Each class has a fixed random prototype image (from ``seed``); sample ``i`` draws its
    class and its noise from a generator seeded by ``(seed, i)``, so a step's global batch
    is the same whatever the dp degree, and each dp rank takes its contiguous share.
    """

    def __init__(self, classes: int, global_batch: int, seed: int = 0, size: int = IMAGE_SIZE,
                 channels: int = CHANNELS, noise: float = 0.5):
        self.classes, self.global_batch, self.seed, self.noise = classes, global_batch, seed, noise
        self.shape = (channels, size, size)
        gen = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(classes, *self.shape, generator=gen)

    def sample(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        label = int(torch.randint(self.classes, (1,), generator=gen))
        return self.prototypes[label] + self.noise * torch.randn(self.shape, generator=gen), label

    def batch(self, step: int, dp_rank: int = 0, dp: int = 1, micro: int = 0, micro_batches: int = 1,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // dp
        mb = per_rank // micro_batches
        first = step * self.global_batch + dp_rank * per_rank + micro * mb
        pairs = [self.sample(first + j) for j in range(mb)]
        x = torch.stack([p[0] for p in pairs])
        y = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        return (x.to(device), y.to(device)) if device is not None else (x, y)


def forward_flops(width: int, blocks: int, classes: int, size: int = IMAGE_SIZE, channels: int = CHANNELS) -> int:
    """Multiply-add FLOPs (2 per MAC) of one sample's forward through convolutions and the head.

    Normalisation, ReLU, the residual adds and the pooling are element-wise and left out, as
    the PaLM count leaves them out for the transformer (they are a few percent here).
    """
    def conv(cin: int, cout: int, k: int, out_side: int) -> int:
        return 2 * cin * cout * k * k * out_side * out_side

    total, side = conv(channels, width, 3, size), size
    for cin, cout, stride in block_shapes(width, blocks):
        side = (side - 1) // stride + 1  # 3x3, padding 1 (and the 1x1 shortcut) with this stride
        total += conv(cin, cout, 3, side) + conv(cout, cout, 3, side)
        if stride != 1 or cin != cout:
            total += conv(cin, cout, 1, side)
    last = block_shapes(width, blocks)[-1][1] if blocks else width
    return total + 2 * last * classes


class ResNetFamily(ModelFamily):
    """The contract's answers for :class:`ResNet` on :class:`SyntheticImages`."""

    name = "resnet"
    layouts = frozenset({"dp", "zero1", "zero2", "zero3", "pp"})  # no nn.Linear to split but the head

    def build(self, cfg) -> nn.Module:
        m = cfg.model
        return ResNet(m.hidden_size, m.num_hidden_layers, m.vocab_size)

    def problems(self, cfg) -> list[str]:
        if cfg.data.source != "synthetic":
            return [f"data.source = {cfg.data.source!r}: model family 'resnet' trains on synthetic images "
                    "only; use data.source = \"synthetic\""]
        return []

    def data(self, cfg) -> SyntheticImages:
        return SyntheticImages(cfg.model.vocab_size, cfg.train.global_batch, cfg.data.seed)

    def flops_per_sample(self, cfg) -> float:
        """Forward + backward: the backward computes the gradients of the activations and of
        the weights, each as costly as the forward, except that the images need no gradient
        (the stem convolution's input gradient is not computed). Equal to what
        torch.utils.flop_counter counts for a training step (tests/test_resnet_family.py)."""
        m = cfg.model
        stem_input_grad = 2 * CHANNELS * m.hidden_size * 9 * IMAGE_SIZE * IMAGE_SIZE
        return 3.0 * forward_flops(m.hidden_size, m.num_hidden_layers, m.vocab_size) - stem_input_grad


def family() -> ResNetFamily:
    return ResNetFamily()


def tiny() -> ResNet:
    """The module of examples/resnet-tiny.toml, for ``chipset plan --module chipset.models.resnet:tiny``."""
    return ResNet(width=8, blocks=4, classes=10)
