"""The image classifiers the scripts train: torchvision's ResNet-18 (with a CIFAR stem, or as-is), Myrtle.ai's
ResNet-9 and He et al.'s CIFAR ResNet-8 (train_cifar.py), and torchvision's VisionTransformer sized for 32 px images
(train_vit.py): the ready models a template's build_model(cfg, num_classes) picks from by name. Each declares the
blocks FSDP shards one at a time in `_no_split_modules` (the convention Accelerate reads; see
utils.launch.choose_fsdp_units).
Your own model: build it in your copy's build_model; it need not come from here."""

from __future__ import annotations

import torch
import torch.nn as nn
import torchvision
from torchvision.ops import stochastic_depth

from utils import UserError
from utils.pretrained import pretrained_model

MODELS = ("resnet18", "resnet18_imagenet", "resnet9", "resnet8")
# ViT presets for 32 x 32 images, patch 4 (64 patches + the class token): (layers, heads, hidden width, MLP width).
# The widths of DeiT-Ti/S/B and ViT-L; vit_micro is for tests and a first run on a laptop.
VITS = {"vit_micro": (2, 2, 64, 128), "vit_tiny": (12, 3, 192, 768), "vit_s": (12, 6, 384, 1536),
        "vit_b": (12, 12, 768, 3072), "vit_l": (24, 16, 1024, 4096)}


def named_model(name: str, num_classes: int = 10, image_size: int = 32, drop_path: float = 0.0,
                patch_size: int | None = None) -> nn.Module:
    """A ready model by name: torchvision's ResNet-18; 'resnet18' swaps the ImageNet stem (7x7 stride-2 conv +
    max-pool, which shrinks 32x32 inputs to 8x8 before the first block) for a 3x3 stride-1 conv; or 'resnet9' or
    'resnet8' (below). A name in VITS: vit() below, for image_size x image_size inputs in patches of patch_size px
    (None: vit_patch's; the ResNets take any size).
    Any other name: a pretrained timm or transformers model (timm:NAME, a model folder or a Hub id), built by its
    library with a fresh head for num_classes (utils/pretrained.py). `drop_path`: stochastic depth, the chance that a
    residual block's branch is dropped for an image, rising linearly over the blocks from 0 to this (timm's and
    transformers' drop_path_rate; the ready models' blocks, `drop_paths`). The model declares the name it was built
    under (`model_name`: what summary.json records as the network's name; a copy's own network has none)."""
    if name not in MODELS and name not in VITS:
        model = pretrained_model(name, num_classes, drop_path)
    else:
        model = vit(name, num_classes, image_size, patch_size) if name in VITS else _resnet(name, num_classes)
        drop_paths(model, drop_path)
    model.model_name = name
    return model


def drop_paths(model: nn.Module, rate: float) -> None:
    """Stochastic depth in a ready model: its residual blocks (StochasticDepth) in order drop their branch for an
    image with chance linear from 0 at the first to `rate` at the last (torch.linspace, as timm's drop_path_rate)."""
    blocks = [m for m in model.modules() if isinstance(m, StochasticDepth)]
    for block, chance in zip(blocks, torch.linspace(0, rate, len(blocks)).tolist()):
        block.drop_path = chance


class StochasticDepth:
    """What the ready models' residual blocks declare: the chance `drop_path` that their branch is dropped for an
    image in training (torchvision.ops.stochastic_depth, before the sum, as timm's blocks do); drop_paths sets it."""
    drop_path = 0.0


class BasicBlock(StochasticDepth, torchvision.models.resnet.BasicBlock):
    """torchvision's BasicBlock (the same name, parameters and arithmetic) with stochastic depth on its branch."""

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(stochastic_depth(out, self.drop_path, "row", self.training) + identity)


class EncoderBlock(StochasticDepth, torchvision.models.vision_transformer.EncoderBlock):
    """torchvision's ViT block (the same name, parameters and arithmetic) with stochastic depth on its attention and
    MLP branches each (timm's ViT blocks' drop_path1 and drop_path2)."""

    def forward(self, input):
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = input + stochastic_depth(self.dropout(x), self.drop_path, "row", self.training)
        return x + stochastic_depth(self.mlp(self.ln_2(x)), self.drop_path, "row", self.training)


def _resnet(name: str, num_classes: int) -> nn.Module:
    own = {"resnet9": resnet9, "resnet8": ResNet8}  # the rest: torchvision's resnet18, built of this BasicBlock
    model = own[name](num_classes) if name in own else torchvision.models.resnet.ResNet(BasicBlock, [2, 2, 2, 2],
                                                                                          num_classes=num_classes)
    if name == "resnet18":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision does
        model.maxpool = nn.Identity()
    if name.startswith("resnet18"):
        model._no_split_modules = ["BasicBlock"]  # torchvision's class declares none
    return model


def model_layers(name: str) -> list[tuple[str, ...]] | None:
    """A ready model's layers for --layer-decay (utils/optim.py), from the input to the head: each the name prefixes
    of its parameters. The ResNets by stage (the stem, each stage, the classifier), the ViTs by block (the class
    token, patch and position embeddings; each encoder block; the final norm and head). None for any other name."""
    if name in VITS:
        blocks = [(f"encoder.layers.encoder_layer_{i}",) for i in range(VITS[name][0])]
        return [("class_token", "conv_proj", "encoder.pos_embedding"), *blocks, ("encoder.ln", "heads")]
    if name == "resnet9":  # nn.Sequential: its children by index (see resnet9)
        return [("0", "1"), ("3", "5", "7"), ("8", "10"), ("12", "14", "16"), ("19",)]
    stages = {"resnet8": 3, "resnet18": 4, "resnet18_imagenet": 4}.get(name)
    return None if stages is None else [("conv1", "bn1"), *((f"layer{i}",) for i in range(1, stages + 1)), ("fc",)]


def resnet9(num_classes: int) -> nn.Module:
    """The 'ResNet-9' of Myrtle.ai's DAWNBench CIFAR-10 record (6.5M parameters): 3 pooled stages of 3x3 convs,
    two with a residual pair, max-pooled to a scaled linear classifier; far fewer FLOPs than ResNet-18."""
    model = nn.Sequential(*conv_bn(3, 64), *conv_bn(64, 128, pool=True),
                          Residual(*conv_bn(128, 128), *conv_bn(128, 128)),
                          *conv_bn(128, 256, pool=True), *conv_bn(256, 512, pool=True),
                          Residual(*conv_bn(512, 512), *conv_bn(512, 512)), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                          nn.Linear(512, num_classes, bias=False), Scale(0.125))
    model._no_split_modules = ["Residual"]
    return model


class ResNet8(nn.Module):
    """The CIFAR ResNet of He et al. (2016, section 4.2) at its smallest depth, 6n+2 with n = 1: a 3x3 stem of 16
    channels, then one of torchvision's BasicBlocks per stage at 16, 32 and 64 channels (stride 2 from the second,
    with torchvision's 1x1 projection shortcut), average-pooled to a linear head; 78k parameters. For tests and a
    first run on a laptop: about 7x the images per second of resnet18_imagenet on a CPU (docs/performance.md). Its
    parts are named as torchvision's ResNet's (conv1, bn1, layer1-3, fc) and initialised as torchvision does."""
    _no_split_modules = ["BasicBlock"]

    def __init__(self, num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1, self.layer2, self.layer3 = basic_block(16, 16), basic_block(16, 32), basic_block(32, 64)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def basic_block(c_in: int, c_out: int) -> nn.Sequential:
    """A stage of one torchvision BasicBlock; a wider one halves the resolution and projects its shortcut (1x1 conv)."""
    if c_in == c_out:
        return nn.Sequential(BasicBlock(c_in, c_out))
    shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=2, bias=False), nn.BatchNorm2d(c_out))
    return nn.Sequential(BasicBlock(c_in, c_out, stride=2, downsample=shortcut))


def conv_bn(c_in: int, c_out: int, pool: bool = False) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), *([nn.MaxPool2d(2)] if pool else []),
            nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class Residual(StochasticDepth, nn.Sequential):
    def forward(self, x):
        return x + stochastic_depth(super().forward(x), self.drop_path, "row", self.training)


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def vit_patch(image_size: int) -> int:
    """The default patch side of a ViT for image_size px: the smallest power of two from 4 that cuts the image into at
    most 14 x 14 patches (4 at 32 px: 8 x 8, as CIFAR ViTs; 8 at 64 px; 16 at 224 px, ViT/16's 14 x 14), so the
    tokens per image, and the compute, stay those of a standard ViT as the images grow."""
    patch = 4
    while image_size > 14 * patch:
        patch *= 2
    return patch


def vit(name: str, num_classes: int = 10, image_size: int = 32, patch_size: int | None = None) -> nn.Module:
    """torchvision's VisionTransformer (pre-norm blocks, class token, learned position embeddings) at a VITS size, in
    patches of patch_size px (None: vit_patch's); its transformer blocks are torchvision's EncoderBlock, given this
    module's subclass of the same name (stochastic depth), the unit FSDP shards."""
    layers, heads, hidden, mlp = VITS[name]
    model = torchvision.models.VisionTransformer(image_size, patch_size or vit_patch(image_size), layers, heads,
                                                 hidden, mlp, num_classes=num_classes)
    for block in model.encoder.layers:  # torchvision's VisionTransformer takes no block class: the subclass set here
        block.__class__ = EncoderBlock
    model._no_split_modules = ["EncoderBlock"]
    return model


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing for every ViT block: its forward keeps only the block's input and recomputes the
    rest during backward (about a third more compute, for activations ~1/(layers) of the full set). Applied before
    prepare(), so FSDP shards the wrapped blocks as usual (torchtitan's order). torch's checkpoint_wrapper
    (non-reentrant) keeps the state-dict keys of the plain model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = model.encoder.layers
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block)


def check_logits(model: nn.Module, num_classes: int, image_size: int, where: str = "build_model") -> None:
    """The model contract, checked before training: a float batch (N, 3, S, S) in, logits (N, num_classes) out. One
    forward of two blank images in eval mode (no gradient, no random draw, no BatchNorm statistics changed); a model
    that fails it stops with one line instead of a traceback on every rank at the first step."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, 3, image_size, image_size))
    except Exception as e:  # noqa: BLE001 -- whatever the copier's model raises on the data's shape: one line
        text = str(e).strip().splitlines()
        raise UserError(f"the model from {where} does not take the data's {image_size} x {image_size} px images "
                        f"({type(e).__name__}: {text[0] if text else ''}).") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes) or not out.is_floating_point():
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"the model from {where} must return logits (N, {num_classes}) for {num_classes} classes "
                        f"(got {got} for N = 2).")
