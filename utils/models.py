"""The image classifiers the scripts train: torchvision's ResNet-18 (with a CIFAR stem, or as-is), Myrtle.ai's
ResNet-9 (train_cifar.py) and torchvision's VisionTransformer sized for 32 px images (train_vit.py). Your own model:
add it to build_model(), or build it where the script calls build_model()."""

from __future__ import annotations

import torch.nn as nn
import torchvision

MODELS = ("resnet18", "resnet18_imagenet", "resnet9")
# ViT presets for 32 x 32 images, patch 4 (64 patches + the class token): (layers, heads, hidden width, MLP width).
# The widths of DeiT-Ti/S/B and ViT-L; vit_micro is for tests and a first run on a laptop.
VITS = {"vit_micro": (2, 2, 64, 128), "vit_tiny": (12, 3, 192, 768), "vit_s": (12, 6, 384, 1536),
        "vit_b": (12, 12, 768, 3072), "vit_l": (24, 16, 1024, 4096)}


def build_model(name: str, num_classes: int = 10, sync_bn: bool = False, image_size: int = 32) -> nn.Module:
    """torchvision's ResNet-18; 'resnet18' swaps the ImageNet stem (7x7 stride-2 conv + max-pool, which
    shrinks 32x32 inputs to 8x8 before the first block) for a 3x3 stride-1 conv; or 'resnet9' (below).
    sync_bn turns every BatchNorm into a SyncBatchNorm (statistics over all ranks' batches; CUDA only).
    A name in VITS: vit() below, for image_size x image_size inputs (the ResNets take any size)."""
    if name in VITS:
        return vit(name, num_classes, image_size)
    model = resnet9(num_classes) if name == "resnet9" else torchvision.models.resnet18(num_classes=num_classes)
    if name == "resnet18":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision does
        model.maxpool = nn.Identity()
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync_bn else model


def resnet9(num_classes: int) -> nn.Module:
    """The 'ResNet-9' of Myrtle.ai's DAWNBench CIFAR-10 record (6.5M parameters): 3 pooled stages of 3x3 convs,
    two with a residual pair, max-pooled to a scaled linear classifier; far fewer FLOPs than ResNet-18."""
    return nn.Sequential(*conv_bn(3, 64), *conv_bn(64, 128, pool=True),
                         Residual(*conv_bn(128, 128), *conv_bn(128, 128)),
                         *conv_bn(128, 256, pool=True), *conv_bn(256, 512, pool=True),
                         Residual(*conv_bn(512, 512), *conv_bn(512, 512)), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                         nn.Linear(512, num_classes, bias=False), Scale(0.125))


def conv_bn(c_in: int, c_out: int, pool: bool = False) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), *([nn.MaxPool2d(2)] if pool else []),
            nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class Residual(nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def vit(name: str, num_classes: int = 10, image_size: int = 32, patch_size: int = 4) -> nn.Module:
    """torchvision's VisionTransformer (pre-norm blocks, class token, learned position embeddings) at a VITS size;
    its transformer blocks are torchvision.models.vision_transformer.EncoderBlock, the unit FSDP shards."""
    layers, heads, hidden, mlp = VITS[name]
    return torchvision.models.VisionTransformer(image_size, patch_size, layers, heads, hidden, mlp,
                                                num_classes=num_classes)


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing for every ViT block: its forward keeps only the block's input and recomputes the
    rest during backward (about a third more compute, for activations ~1/(layers) of the full set). Applied before
    prepare(), so FSDP shards the wrapped blocks as usual (torchtitan's order). torch's checkpoint_wrapper
    (non-reentrant) keeps the state-dict keys of the plain model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = model.encoder.layers
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block)
