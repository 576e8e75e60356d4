"""A small ResNet image classifier: the non-transformer family shipped with chipset.

It is written only against the family contract (chipset.models.family) and is the worked
example of a model that is not a sequence model: its own data (synthetic images, or a folder
of class sub-folders with ``data.source = "images"``), its own
FLOPs count, and pipeline stages cut from its chain of units (stem, residual blocks, pooled
head); it has no tensor parallelism (nothing but the head is an ``nn.Linear``). Select it with ``model.family = "resnet"``
(examples/resnet-tiny.toml, docs/models.md).

The ``model.*`` keys it reads: its own ``num_classes`` (:class:`ResNetConfig`, the family's
``config_class``) and two shared ones, for the same roles as in the decoder:

* ``hidden_size``: channels of the first stage (each later stage doubles them);
* ``num_hidden_layers``: residual blocks; every second block starts a new stage (stride 2,
  twice the channels);
* ``num_classes``: number of classes.

Why GroupNorm and not BatchNorm: BatchNorm normalises with the statistics of the batch the
process sees, so under dp each rank would normalise its half-batch with its own mean and
variance and the run would no longer compute what one process computes (and its running
statistics would differ per rank). GroupNorm normalises each sample on its own, so a dp run
equals one process up to the order of floating-point sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from chipset.data.datasets import HELD_OUT_OFFSET
from chipset.errors import ConfigError
from chipset.models.family import ModelFamily, classifier_metrics

__all__ = ["ImageFolder", "ResNet", "ResNetFamily", "SyntheticImages", "family", "forward_flops", "tiny"]

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
                 channels: int = CHANNELS, noise: float = 0.5, offset: int = 0):
        self.classes, self.global_batch, self.seed, self.noise = classes, global_batch, seed, noise
        self.offset = offset  # first sample index: held-out samples start far beyond any training step
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
        first = self.offset + step * self.global_batch + dp_rank * per_rank + micro * mb
        pairs = [self.sample(first + j) for j in range(mb)]
        x = torch.stack([p[0] for p in pairs])
        y = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        return (x.to(device), y.to(device)) if device is not None else (x, y)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".webp")


def image_folder_classes(root: str | Path) -> tuple[list[str], list[tuple[Path, int]], list[str]]:
    """Class names (sorted sub-folders of ``root``), ``(file, label)`` for every image file in
    them (sorted), and the problems found (each a sentence saying what to do)."""
    root = Path(root)
    if not str(root) or not root.is_dir():
        return [], [], [f"data.path = {str(root)!r}: expected a folder with one sub-folder of images per class "
                        "(data.source = \"images\")"]
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = [(f, label) for label, c in enumerate(classes) for f in sorted((root / c).iterdir())
             if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    problems = []
    if not classes:
        problems.append(f"data.path = {str(root)!r} has no class sub-folders; put each class's images in "
                        "a folder named after it (e.g. cats/001.png, dogs/001.png)")
    empty = [c for label, c in enumerate(classes) if not any(lbl == label for _, lbl in files)]
    if empty:
        problems.append(f"data.path = {str(root)!r}: class folder(s) {', '.join(empty)} hold no image "
                        f"({', '.join(IMAGE_SUFFIXES)}); add images or remove the folder")
    return classes, files, problems


class ImageFolder:
    """Labelled images from a folder of class sub-folders, resized to ``size`` x ``size`` RGB.

    Every image is decoded once (Pillow) into memory when the data is built, scaled to [-1, 1].
    Sample ``i`` of the infinite stream is image ``perm_e[i mod n]`` of epoch ``e = i // n``,
    where ``perm_e`` is a permutation drawn from ``(seed, e)``: a step's global batch is the
    same whatever the dp degree, and each dp rank takes its contiguous share.
    """

    def __init__(self, root: str | Path, global_batch: int, seed: int = 0, size: int = IMAGE_SIZE):
        try:
            from PIL import Image
        except ImportError as exc:
            raise ConfigError("data.source = \"images\" decodes images with Pillow, which is not installed; "
                              "pip install pillow") from exc
        self.classes, files, problems = image_folder_classes(root)
        if problems:
            raise ConfigError("; ".join(problems))
        images = []
        for f, _ in files:
            try:
                with Image.open(f) as im:
                    im = im.convert("RGB").resize((size, size), Image.BILINEAR)
                    data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"data.path: {f} is not a readable image ({exc}); remove it or fix it") from exc
            images.append(data.view(size, size, CHANNELS).permute(2, 0, 1).float() / 127.5 - 1.0)
        self.images = torch.stack(images)
        self.labels = torch.tensor([label for _, label in files], dtype=torch.long)
        self.global_batch, self.seed = global_batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def _index(self, i: int) -> int:
        epoch, pos = divmod(i, len(self))
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(len(self), generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + epoch))}
        return int(self._perms[epoch][pos])

    def batch(self, step: int, dp_rank: int = 0, dp: int = 1, micro: int = 0, micro_batches: int = 1,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // dp
        mb = per_rank // micro_batches
        first = step * self.global_batch + dp_rank * per_rank + micro * mb
        idx = torch.tensor([self._index(first + j) for j in range(mb)])
        x, y = self.images[idx], self.labels[idx]
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


@dataclass
class ResNetConfig:
    """The resnet family's own ``[model]`` keys."""

    num_classes: int = 10
    """Number of classes: the classifier's outputs; with data.source = "images", the number of
    class sub-folders of data.path."""

    def __post_init__(self):
        if self.num_classes < 2:
            raise ValueError(f"model.num_classes = {self.num_classes}: a classifier needs at least 2 classes")


class ResNetFamily(ModelFamily):
    """The contract's answers for :class:`ResNet` on :class:`SyntheticImages`."""

    name = "resnet"
    config_class = ResNetConfig
    layouts = frozenset({"dp", "zero1", "zero2", "zero3", "pp"})  # no nn.Linear to split but the head

    def build(self, cfg) -> nn.Module:
        m = cfg.model
        return ResNet(m.hidden_size, m.num_hidden_layers, self.options(cfg).num_classes)

    def problems(self, cfg) -> list[str]:
        da = cfg.data
        if da.source == "images":
            classes, _, problems = image_folder_classes(da.path)
            want = self.options(cfg).num_classes
            if not problems and len(classes) != want:
                problems.append(f"model.num_classes ({want}) is the number of classes, and "
                                f"data.path has {len(classes)} class folders ({', '.join(classes[:8])}"
                                f"{', ...' if len(classes) > 8 else ''}); set model.num_classes = {len(classes)}")
            if not problems and da.eval_path:
                held, _, bad = image_folder_classes(da.eval_path)
                problems += [b.replace("data.path", "data.eval_path") for b in bad]
                if not bad and held != classes:
                    problems.append(f"data.eval_path has class folders {', '.join(held[:8])}, data.path "
                                    f"{', '.join(classes[:8])}: held-out images need the same classes (folder names)")
            return problems
        if da.source != "synthetic":
            return [f"data.source = {da.source!r}: model family 'resnet' trains on images, synthetic or from "
                    "a folder; use data.source = \"synthetic\" or \"images\""]
        return []

    def data(self, cfg) -> SyntheticImages | ImageFolder:
        if cfg.data.source == "images":
            return ImageFolder(cfg.data.path, cfg.train.global_batch, cfg.data.seed)
        return SyntheticImages(self.options(cfg).num_classes, cfg.train.global_batch, cfg.data.seed)

    def eval_data(self, cfg) -> SyntheticImages | ImageFolder:
        """Held-out images: ``data.eval_path`` (class sub-folders, as data.path), or synthetic
        samples of the same classes that no training step draws."""
        if cfg.data.source == "images":
            return ImageFolder(cfg.data.eval_path, cfg.train.global_batch, cfg.data.seed)
        return SyntheticImages(self.options(cfg).num_classes, cfg.train.global_batch, cfg.data.seed,
                               offset=HELD_OUT_OFFSET)

    def eval_metrics(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return classifier_metrics(self, model, inputs, targets)

    def flops_per_sample(self, cfg) -> float:
        """Forward + backward: the backward computes the gradients of the activations and of
        the weights, each as costly as the forward, except that the images need no gradient
        (the stem convolution's input gradient is not computed). Equal to what
        torch.utils.flop_counter counts for a training step (tests/models/test_resnet_family.py)."""
        m = cfg.model
        stem_input_grad = 2 * CHANNELS * m.hidden_size * 9 * IMAGE_SIZE * IMAGE_SIZE
        return 3.0 * forward_flops(m.hidden_size, m.num_hidden_layers, self.options(cfg).num_classes) - stem_input_grad


def family() -> ResNetFamily:
    return ResNetFamily()


def tiny() -> ResNet:
    """The module of examples/resnet-tiny.toml, for ``chipset plan --module chipset.models.resnet:tiny``."""
    return ResNet(width=8, blocks=4, classes=10)
