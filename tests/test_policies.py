"""--auto-augment (utils/data/transform.py) against torchvision.transforms.v2's TrivialAugmentWide, RandAugment and
AugMix: each op on each image at its own magnitude, the keyed draws' distributions, whole policies composed, and
where a batch gets its policy (on the device after the crop and flip; in the loader's workers for crops cut as
they are decoded)."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import encoded_rows
from PIL import Image
from torchvision.transforms import v2

from utils.data.draws import Draws
from utils.data.images import EncodedImages, LoaderDataset, TensorImages
from utils.data.pixels import CropRecipe
from utils.data.transform import OPS, BatchTransform, Policy, apply_policy, draw_ops, op_params, policy_draws, run_op

TORCHVISION = {"ta_wide": v2.TrivialAugmentWide, "ra": v2.RandAugment, "augmix": v2.AugMix}


def images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """n uint8 noise images of varied brightness and contrast, the first one flat (one value): the edge case of
    AutoContrast, Equalize and Contrast."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (n, 3, size, size), generator=g).float()
    out = noise * torch.rand(n, 1, 1, 1, generator=g) + torch.rand(n, 1, 1, 1, generator=g) * 100
    out[0] = 77
    return out.clamp(0, 255).to(torch.uint8)


def torchvision_op(name: str, policy: str, image: torch.Tensor, magnitude: float) -> torch.Tensor:
    """torchvision's own application of op `name` at `magnitude`, with the policy class's interpolation and fill."""
    t = TORCHVISION[policy]()
    return t._apply_image_or_video_transform(image, name, magnitude, interpolation=t.interpolation, fill=t._fill)


@pytest.mark.parametrize(("policy", "size"), [("ta_wide", 32), ("ra", 40), ("augmix", 32)])
def test_each_op_at_each_images_own_magnitude_matches_torchvisions_within_one_level(policy, size):
    """Every op of the policy's space, over a batch whose images each take another of its magnitudes (every bin,
    both signs of a signed op; the space read from torchvision's class), gives for each image
    torchvision.transforms.v2's result for that image at that magnitude within 1 level of 255 (the geometric ops with
    the policy's interpolation: nearest, bilinear for AugMix; at 40 px RandAugment's translations scale with the
    size)."""
    cls = TORCHVISION[policy]
    bins = 10 if policy == "augmix" else 31
    worst = {}
    for name, (magnitudes_fn, signed) in cls._AUGMENTATION_SPACE.items():
        values = magnitudes_fn(bins, size, size)
        magnitudes = [0.0] if values is None else [float(v) for v in values] + (
            [-float(v) for v in values] if signed else [])
        batch = images(len(magnitudes), size, seed=len(worst))
        op = np.full(len(magnitudes), OPS.index(name))
        params = torch.from_numpy(op_params(op, np.array(magnitudes), size)).float()
        ours = run_op(name, batch, params, "bilinear" if policy == "augmix" else "nearest")
        reference = torch.stack([torchvision_op(name, policy, im, m) for im, m in zip(batch, magnitudes)])
        worst[name] = (ours.int() - reference.int()).abs().max().item()
    assert set(worst) >= set(OPS) - ({"Identity"} if policy == "augmix" else set())
    assert max(worst.values()) <= 1, worst


def torchvision_draws(policy: str, n: int, **kwargs):
    """n images' draws of torchvision's class (its own RNG, seeded): per image the (op, magnitude) it applies, and
    AugMix's Dirichlet samples (m of Beta(1, 1), then the chains' weights before they are scaled by 1 - m)."""
    t = TORCHVISION[policy](**kwargs)
    calls, dirichlet = [], []
    t._apply_image_or_video_transform = lambda image, name, magnitude, **_: (calls.append((name, magnitude)), image)[1]
    if policy == "augmix":
        sample = t._sample_dirichlet
        t._sample_dirichlet = lambda params: (lambda d: (dirichlet.append(d[0]), d)[1])(sample(params))
    image, per_image = torch.zeros(3, 32, 32, dtype=torch.uint8), []
    torch.manual_seed(0)
    for _ in range(n):
        start = len(calls)
        t(image)
        per_image.append(calls[start:])
    return per_image, dirichlet


@pytest.mark.parametrize(("policy", "flags", "kwargs"), [
    ("ta_wide", {}, {}),
    ("ra", {"ra_ops": 3, "ra_magnitude": 14}, {"num_ops": 3, "magnitude": 14}),
    ("augmix", {"augmix_severity": 5}, {"severity": 5}),
])
def test_policy_draws_follow_torchvisions_distributions(policy, flags, kwargs):
    """Over 4,000 images, the keyed draws against 4,000 of torchvision's (its own RNG): the ops' frequencies and the
    number of ops per image (AugMix's chain depths) agree (chi-square on the two samples' counts, p > 1e-3), the
    signed magnitudes too (Kolmogorov-Smirnov, p > 1e-3); each drawn magnitude is one of that op's values in
    torchvision's space; AugMix's image weight m and first chain weight follow its Dirichlet draws (KS, p > 1e-3)."""
    from scipy.stats import chi2_contingency, ks_2samp

    n = 4000
    theirs, dirichlet = torchvision_draws(policy, n, **kwargs)
    ops, magnitudes, weights, _ = draw_ops(3, 1, np.arange(n), Policy(policy, **flags), 32)
    ours = [[(OPS[o], float(m)) for o, m in zip(ops[:, i], magnitudes[:, i]) if policy != "augmix" or o != 0]
            for i in range(n)]

    def same(a: Counter, b: Counter) -> float:
        keys = sorted(set(a) | set(b))
        return chi2_contingency([[a[k] for k in keys], [b[k] for k in keys]]).pvalue if len(keys) > 1 else 1.0

    assert same(Counter(name for im in ours for name, _ in im), Counter(name for im in theirs for name, _ in im)) > 1e-3
    assert same(Counter(map(len, ours)), Counter(map(len, theirs))) > 1e-3
    assert ks_2samp([m for im in ours for _, m in im], [m for im in theirs for _, m in im]).pvalue > 1e-3
    bins = 10 if policy == "augmix" else 31
    allowed = {name: {0.0} if fn(bins, 32, 32) is None else {float(v) for v in fn(bins, 32, 32)}
               for name, (fn, _) in TORCHVISION[policy]._AUGMENTATION_SPACE.items()}
    assert all(abs(m) in allowed[name] for im in ours for name, m in im)
    if policy == "augmix":
        m = torch.stack(dirichlet[0::2])[:, 0].numpy()
        first_chain = torch.stack(dirichlet[1::2])[:, 0].numpy() * (1 - m)
        assert ks_2samp(weights[:, 0], m).pvalue > 1e-3 and ks_2samp(weights[:, 1], first_chain).pvalue > 1e-3
        assert np.allclose(weights.sum(1), 1.0)


@pytest.mark.parametrize("policy", ["ta_wide", "ra", "augmix"])
def test_a_batchs_policy_is_each_images_drawn_ops_in_turn_as_torchvision_applies_them(policy):
    """apply_policy on 256 images equals, image by image, torchvision's ops applied in the drawn order at the drawn
    magnitudes (AugMix: its chains mixed with the drawn weights, m x image + sum of weight x chain, truncated to
    uint8 as torchvision's AugMix does): every value within 1 level of 255 for TrivialAugmentWide and RandAugment;
    for AugMix, whose chains carry a 1-level difference into later ops, at most 1 value in 10^4 further off and a
    mean difference under 0.001 (measured: 1 value of 786,432, off by 6)."""
    n, size = 256, 32
    batch, indices = images(n, size, seed=1), np.arange(1000, 1000 + n)
    ops, magnitudes, weights, depth = draw_ops(7, 2, indices, Policy(policy), size)
    ours = apply_policy(batch, policy_draws(7, 2, indices, Policy(policy), size))
    reference = []
    for i in range(n):
        chains = []
        for chain in range(len(ops) // depth):
            x = batch[i]
            for layer in range(chain * depth, (chain + 1) * depth):
                x = torchvision_op(OPS[ops[layer, i]], policy, x, float(magnitudes[layer, i]))
            chains.append(x)
        if weights is None:
            reference.append(chains[-1])
        else:
            w = torch.from_numpy(weights[i]).float()
            mixed = w[0] * batch[i]
            for k, x in enumerate(chains):
                mixed.add_(w[1 + k] * x)
            reference.append(mixed.to(torch.uint8))
    difference = (ours.int() - torch.stack(reference).int()).abs()
    assert not torch.equal(ours, batch)
    if policy == "augmix":
        assert (difference > 1).float().mean() <= 1e-4 and difference.float().mean() < 1e-3
    else:
        assert difference.max() <= 1


def test_an_images_policy_draws_are_keyed_by_seed_epoch_and_sample():
    """An image draws the same ops and magnitudes in whatever batch and position it comes; another epoch or seed
    draws others."""
    policy, indices = Policy("ra"), np.arange(500, 628)
    ops, magnitudes, _, _ = draw_ops(5, 0, indices, policy, 32)
    shuffled = np.random.default_rng(0).permutation(128)
    again, again_magnitudes, _, _ = draw_ops(5, 0, indices[shuffled], policy, 32)
    assert np.array_equal(again, ops[:, shuffled]) and np.array_equal(again_magnitudes, magnitudes[:, shuffled])
    assert not np.array_equal(draw_ops(5, 1, indices, policy, 32)[0], ops)
    assert not np.array_equal(draw_ops(6, 0, indices, policy, 32)[0], ops)


def test_crops_cut_in_the_loaders_workers_get_their_policy_there_and_cached_images_on_the_device():
    """Under --augment resized-crop (the crops cut as the images are decoded, in the loader's workers) the batch a
    LoaderDataset gives is the crops with apply_policy's result already on them, and its draws carry no policy;
    images cropped on the device (TensorImages) come unchanged with their policy draws, and BatchTransform.train
    applies them after the crop and flip, before normalising."""
    rng, size, policy = np.random.default_rng(0), 32, Policy("ta_wide")
    files = []
    for k in range(8):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (60 + k, 90, 3), dtype=np.uint8)).save(buffer, format="PNG")
        files.append(buffer.getvalue())
    labels, indices = torch.arange(8), list(range(8))
    encoded = EncodedImages(encoded_rows(files), size, CropRecipe(), 0)
    plain = LoaderDataset(encoded, labels, 3, True, 4, None).__getitems__(indices)
    augmented = LoaderDataset(encoded, labels, 3, True, 4, None, policy=policy).__getitems__(indices)
    assert augmented[2].policy is None and augmented[2].flip_crop is None
    assert torch.equal(augmented[0], apply_policy(plain[0], policy_draws(3, 0, np.arange(8), policy, size)))
    assert not torch.equal(augmented[0], plain[0])

    pixels = images(8, size)
    cached = LoaderDataset(TensorImages(pixels), labels, 3, True, 4, None, policy=policy).__getitems__(indices)
    assert torch.equal(cached[0], pixels) and isinstance(cached[2], Draws) and cached[2].policy is not None
    transform = BatchTransform(torch.device("cpu"), True, mean=(0.5,) * 3, std=(0.25,) * 3, num_classes=8)
    x, _ = transform.train(cached[0], cached[1], cached[2])
    cropped = transform.crop_and_flip(cached[0], cached[2].flip_crop).clone()
    assert torch.equal(x, transform(apply_policy(cropped, cached[2].policy)))
    assert not torch.equal(x, transform(cropped))


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["ta_wide", "ra", "augmix"])
def test_a_policy_on_the_gpu_gives_the_cpus_pixels_without_a_host_sync(policy):
    """256 images' policy on CUDA against the same draws on the CPU: at most 1 value in 10^3 more than 1 level of 255
    apart (a sample on a pixel's border may round the other way), none syncing the host
    (torch.cuda.set_sync_debug_mode('error') raises on a sync)."""
    batch, indices = images(256, 32, seed=2), np.arange(256)
    draws = policy_draws(1, 0, indices, Policy(policy), 32)
    on_cpu = apply_policy(batch, draws)
    gpu = torch.device("cuda")
    moved, gpu_batch = draws.moved(lambda t: t.to(gpu)), batch.to(gpu)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = apply_policy(gpu_batch, moved)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    difference = (on_gpu.cpu().int() - on_cpu.int()).abs()
    assert (difference > 1).float().mean() <= 1e-3, difference.max()
