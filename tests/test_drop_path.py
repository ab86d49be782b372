"""--drop-path (stochastic depth): the ready models' blocks (utils/models.py), timm's and transformers' own
drop_path_rate (utils/pretrained.py). That its masks are keyed by the micro-batch, so 2 ranks train as 1 process and
a resume is exact, is proven by the real jobs of tests/test_onthefly.py and tests/test_pretrained.py, which run with
it on."""

from __future__ import annotations

import pytest
import torch

from utils import UserError
from utils.models import named_model


@pytest.mark.parametrize(("name", "blocks"), [("resnet8", 3), ("resnet18", 8), ("resnet9", 2), ("vit_micro", 2)])
def test_drop_path_rises_linearly_over_a_ready_models_blocks_and_changes_no_evaluation(name, blocks):
    """--drop-path 0.2: the model's residual blocks, in order, drop with chances 0, ..., 0.2 evenly spaced (the first
    never); in evaluation the model gives the logits of the same weights built without it, bitwise."""
    torch.manual_seed(0)
    model = named_model(name, 10, drop_path=0.2).eval()
    rates = [m.drop_path for m in model.modules() if type(m).__name__ in ("BasicBlock", "Residual", "EncoderBlock")]
    assert rates == pytest.approx([0.2 * i / (blocks - 1) for i in range(blocks)], abs=1e-7)
    plain = named_model(name, 10).eval()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))


def test_a_dropped_block_passes_its_shortcut_and_a_kept_one_its_branch_scaled_by_the_chance_to_keep():
    """A BasicBlock with chance 0.5 in training, 400 images: each image's output is relu(shortcut) (dropped) or
    relu(branch / 0.5 + shortcut) (kept), to 1e-5; 200 +/- 40 of them dropped; the same seed drops the same ones."""
    model = named_model("resnet8", 10, drop_path=0.5)
    block = model.layer3[0]  # the last block: chance 0.5; a projected shortcut
    assert block.drop_path == 0.5
    x = torch.randn(400, 32, 16, 16)
    with torch.no_grad():
        shortcut = block.downsample(x)
        branch = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(x)))))
        torch.manual_seed(3)
        out = block.train()(x)
        dropped = (out - torch.relu(shortcut)).flatten(1).abs().amax(1) < 1e-5
        kept = (out - torch.relu(branch / 0.5 + shortcut)).flatten(1).abs().amax(1) < 1e-5
        assert (dropped ^ kept).all() and 160 <= int(dropped.sum()) <= 240
        torch.manual_seed(3)
        assert torch.equal(block(x), out)


def test_timm_and_transformers_models_take_their_own_drop_path_rate_or_refuse_in_one_line(tmp_path):
    """timm:test_vit with --drop-path 0.1: timm's own DropPath modules, the last block's at 0.1, the first none; a
    transformers ConvNeXt folder: its config's drop_path_rate is 0.1; a transformers ViT folder, whose config has
    none: one line."""
    from transformers import ConvNextConfig, ConvNextForImageClassification, ViTConfig, ViTForImageClassification

    vit = named_model("timm:test_vit", 3, drop_path=0.1)
    assert vit.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    assert isinstance(vit.blocks[0].drop_path1, torch.nn.Identity)  # timm's block at chance 0
    ConvNextForImageClassification(ConvNextConfig(depths=[1, 1], hidden_sizes=[8, 16], num_stages=2,
                                                  num_labels=4)).save_pretrained(tmp_path / "convnext")
    assert named_model(str(tmp_path / "convnext"), 3, drop_path=0.1).config.drop_path_rate == 0.1
    ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=8, num_labels=4)
                              ).save_pretrained(tmp_path / "vit")
    with pytest.raises(UserError, match=r"^--drop-path: transformers' vit model has no drop_path_rate \(stochastic "
                                        r"depth\) in its config.json.$"):
        named_model(str(tmp_path / "vit"), 3, drop_path=0.1)
