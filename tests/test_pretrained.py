"""Pretrained timm and transformers models as train_cifar.py's --model (utils/pretrained.py): fine-tuned with what
the template guarantees, and handed back to their library. The models are written inside the tests by timm
(`save_for_hf`) and transformers (`save_pretrained`); no network. The fine-tuning task (bench/finetune_recipe.py
builds it): CIFAR-10's ship and truck images, for a timm model trained here on the other 8 classes; the job
(FINETUNE) with AugMix, layer-wise lr decay, drop path, random erasing and the weight-decay exemptions on."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import (
    CPU_YAML,
    FSDP_CPU_YAML,
    PROBE,
    REPO,
    assert_same_parameters,
    assert_same_state,
    evaluate_weights,
    read_summary,
    run_python,
    run_train,
    script_env,
    start,
    write_upscaled_cifar,
)
from PIL import Image
from safetensors.torch import load_file
from test_checkpoint import _kill_after_checkpoint, held_after

from bench.finetune_recipe import pretrain_timm, write_ship_truck

TWO_RANKS, ONE_PROCESS, FSDP = ["--config_file", str(CPU_YAML)], ["--num_processes", "1"], ["--config_file",
                                                                                           str(FSDP_CPU_YAML)]
# The fine-tuning job: --recipe finetune (AdamW, label smoothing) on 512 ship and truck images, global batch 32 -> 16
# steps per epoch, 2 epochs, a checkpoint every 8 steps; plain crops (the cache path) with AugMix on the device,
# random erasing, layer-wise lr decay and drop path
FINETUNE = ["--recipe", "finetune", "--augment", "standard", "--train-subset", "512", "--batch-size", "16",
            "--global-batch-size", "32", "--epochs", "2", "--checkpoint-every-steps", "8", "--deterministic",
            "--tracker", "none", "--log-every", "1", "--no-channels-last", "--layer-decay", "0.75", "--random-erase",
            "0.25", "--drop-path", "0.1", "--auto-augment", "augmix"]


def write_vit(folder: Path, image_size: int = 32) -> Path:
    """A small transformers ViT (4 layers, width 64, patch 4, 8 classes) and its ViTImageProcessor (32 px, mean
    0.5, std 0.25), written by save_pretrained."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(image_size=image_size, patch_size=4, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                       intermediate_size=128, num_labels=8)
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessor(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                      image_std=[0.25] * 3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sources(cifar_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    pretrain_timm(cifar_dir, root / "timm8")
    return {"timm": root / "timm8", "vit": write_vit(root / "vit8"), "data": write_ship_truck(cifar_dir, root / "two"),
            "root": root}


def images_of(folder: Path, n: int | None = None) -> tuple[list[Image.Image], torch.Tensor]:
    """The first n (all) test images of a parquet folder as RGB PIL images, and their labels."""
    table = pq.read_table(folder / "test-00000-of-00001.parquet").slice(0, n)
    return ([Image.open(io.BytesIO(cell["bytes"])).convert("RGB") for cell in table["img"].to_pylist()],
            torch.tensor(table["label"].to_pylist()))


def top1_in_batches(classify, images: list[Image.Image], labels: torch.Tensor, batch: int = 250) -> float:
    """Top-1 (%) of classify(list of PIL images) -> logits, batch by batch, without gradients."""
    with torch.no_grad():
        logits = torch.cat([classify(images[i:i + batch]) for i in range(0, len(images), batch)])
    return 100 * (logits.argmax(1) == labels).float().mean().item()


def job(sources, out: Path, model, *extra) -> list[str]:
    return ["--data-dir", str(sources["data"]), "--cache-dir", str(sources["root"] / "cache"), "--output-dir",
            str(out), "--model", str(model), *extra]


@pytest.fixture(scope="module")
def timm_runs(sources) -> dict[str, Path]:
    """The fine-tuning job from the timm folder on 2 ranks and on 1 process, and the same architecture from scratch
    (timm:test_resnet) on 2 ranks; each run's stdout in <run>/stdout.txt."""
    runs = {}
    for name, model, launch in (("fine", sources["timm"], TWO_RANKS), ("one", sources["timm"], ONE_PROCESS),
                                ("scratch", "timm:test_resnet", TWO_RANKS)):
        runs[name] = sources["root"] / name
        result = run_train(job(sources, runs[name], model, *FINETUNE), launch=launch, script=PROBE)
        assert result.returncode == 0, result.stderr[-4000:]
        (runs[name] / "stdout.txt").write_text(result.stdout)
    return runs


def test_a_timm_folder_fine_tuned_on_two_ranks_learns_better_than_its_architecture_from_scratch(timm_runs):
    """A timm model trained on 8 CIFAR-10 classes, fine-tuned on ship vs truck (512 images, 32 steps, 2 ranks,
    --recipe finetune), reaches at least 8 points more top-1 on the 2,000 test images than the same architecture
    from scratch with the same flags; its head is new (2 classes for the source's 8), the rest loaded."""
    fine, scratch = read_summary(timm_runs["fine"]), read_summary(timm_runs["scratch"])
    assert fine["eval_examples"] == scratch["eval_examples"] == 2000 and fine["global_step"] == 32
    assert fine["eval_top1"] >= scratch["eval_top1"] + 8, (fine["eval_top1"], scratch["eval_top1"])
    said = (timm_runs["fine"] / "stdout.txt").read_text()
    assert f"--model {timm_runs['fine'].parent / 'timm8'}: timm ResNet from" in said
    assert "new, freshly initialised: fc.weight, fc.bias" in said
    assert "preprocessing from timm's pretrained_cfg" in said and "--image-size 32, mean (0.5000" in said
    assert fine["image_mean"] == [0.5] * 3 and fine["image_std"] == [0.5] * 3  # the model's, not the data's
    assert "normalising with the pretrained model's mean (0.5000, 0.5000, 0.5000) and std (0.5000" in said
    assert (fine["image_stats_from"], scratch["image_stats_from"]) == ("pretrained model", "training images")
    assert fine["config"]["optimizer"] == "adamw" and fine["config"]["label_smoothing"] == 0.1  # the recipe's
    # the optimizer's groups: the new head at lr 1e-3 (the recipe's), each pretrained layer d below it at 1e-3 x
    # 0.75^d (--layer-decay), the recipe's weight decay 0.05 on all but biases and norms
    groups = fine["optimizer"]["groups"]
    assert [(g["name"], g["tensors"]) for g in groups[:2]] == [("head/depth_0", 1), ("head/depth_0/no_decay", 1)]
    depths = [int(g["name"].split("/")[1].removeprefix("depth_")) for g in groups]
    assert depths[2:] == sorted(depths[2:]) and set(depths[2:]) == {1, 2, 3, 4, 5}  # timm's 6 layers of the ResNet
    assert [g["lr"] for g in groups] == pytest.approx([1e-3 * 0.75 ** d for d in depths], rel=1e-9)
    assert [g["weight_decay"] for g in groups] == [0.0 if g["name"].endswith("/no_decay") else 0.05 for g in groups]


def test_fine_tuning_a_timm_folder_on_two_ranks_matches_one_process_bitwise(timm_runs):
    """With --deterministic, the fine-tuning job on 2 gloo ranks ends with the trainable parameters of the same job on
    1 process (2 accumulation steps), bitwise."""
    assert read_summary(timm_runs["one"])["world_size"] == 1
    assert_same_parameters(timm_runs["fine"], timm_runs["one"])


def test_a_fine_tuning_job_killed_at_a_checkpoint_resumes_to_the_uninterrupted_weights(sources, timm_runs):
    """kill -9 of the 2-rank fine-tuning job after its step-8 checkpoint, then --resume auto on 2 ranks: the exported
    weights (BatchNorm statistics included) equal the uninterrupted run's bitwise."""
    out = sources["root"] / "killed"
    proc = start(job(sources, out, sources["timm"], *FINETUNE), TWO_RANKS, script=PROBE, env=held_after(8))
    _kill_after_checkpoint(out, proc, 8)
    result = run_train(job(sources, out, sources["timm"], *FINETUNE, "--resume", "auto"), launch=TWO_RANKS,
                       script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_summary(out)["resumed_from"] is not None
    assert_same_state(out / "model.safetensors", timm_runs["fine"] / "model.safetensors")


def test_a_frozen_backbone_trains_the_new_head_alone_and_keeps_every_pretrained_tensor_and_statistic(sources,
                                                                                                       timm_runs):
    """--backbone-lr-factor 0 (a linear probe) with the fine-tuning job's flags on 2 gloo ranks: every tensor of the
    run's model.safetensors but the new head (fc.weight, fc.bias), batch-norm running means and variances included,
    equals the pretrained folder's bitwise; the optimizer holds the head's 2 tensors alone; the head learns: top-1 on
    the 2,000 test images at least 10 points above chance (50%); the folder loads in timm (plain BatchNorm2d layers)
    and timm's own transforms give the run's reported top-1 to 0.1 points."""
    import timm
    from timm.data import create_transform, resolve_data_config

    out = sources["root"] / "probe"
    result = run_train(job(sources, out, sources["timm"], *FINETUNE, "--backbone-lr-factor", "0"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    pretrained, probe = load_file(sources["timm"] / "model.safetensors"), load_file(out / "model.safetensors")
    counters = {name for name in [*pretrained, *probe] if name.endswith("num_batches_tracked")}  # steps, not state
    kept = [name for name in pretrained if not name.startswith("fc.") and name not in counters]
    assert any(name.endswith("running_var") for name in kept)
    assert {*kept, "fc.weight", "fc.bias"} == set(probe) - counters
    assert all(torch.equal(probe[name], pretrained[name]) for name in kept)
    summary = read_summary(out)
    assert [(g["name"], g["tensors"]) for g in summary["optimizer"]["groups"]] == [("head/depth_0", 1),
                                                                                 ("head/depth_0/no_decay", 1)]
    assert summary["eval_top1"] >= 60, summary["eval_top1"]
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert type(model.bn1) is torch.nn.BatchNorm2d
    transform = create_transform(**resolve_data_config({}, model=model))
    top1 = top1_in_batches(lambda ims: model(torch.stack([transform(im) for im in ims])), *images_of(sources["data"]))
    assert abs(top1 - summary["eval_top1"]) <= 0.1, (top1, summary["eval_top1"])


def test_the_exported_timm_run_loads_in_timm_and_its_own_transforms_reproduce_the_reported_top1(sources, timm_runs):
    """A fine-tuned timm run's folder loads with timm.create_model("local-dir:RUN", pretrained=True) (2 classes,
    named), and timm's resolve_data_config + create_transform on the 2,000 test images give the run's reported top-1
    to 0.1 points (2 images)."""
    import timm
    from timm.data import create_transform, resolve_data_config

    run = timm_runs["fine"]
    model = timm.create_model(f"local-dir:{run}", pretrained=True).eval()
    assert model.num_classes == 2 and model.pretrained_cfg["label_names"] == ["ship", "truck"]
    transform = create_transform(**resolve_data_config({}, model=model))
    top1 = top1_in_batches(lambda ims: model(torch.stack([transform(im) for im in ims])), *images_of(sources["data"]))
    assert abs(top1 - read_summary(run)["eval_top1"]) <= 0.1, (top1, read_summary(run)["eval_top1"])


def test_the_hub_folder_of_a_timm_run_loads_in_timm_and_evaluate_checkpoint_reproduces_its_top1(timm_runs):
    """What --push-to-hub uploads from the timm run (<run>/hub) holds timm's config.json, not the run's flags, and
    timm loads it with the run's weights; evaluate_checkpoint.py, given the run's model.safetensors, rebuilds the
    model from the run folder's timm config, normalises as the run trained (mean and std 0.5) and reports the run's
    top-1."""
    import timm

    from utils.hub import hub_folder

    run = timm_runs["fine"]
    s = read_summary(run)
    folder = hub_folder(run, s, "me/fine-tuned")
    assert json.loads((folder / "config.json").read_text())["architecture"] == "test_resnet"
    model = timm.create_model(f"local-dir:{folder}", pretrained=True)
    weights = load_file(run / "model.safetensors")
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    result = evaluate_weights(run / "model.safetensors", "--batch-size", "250")
    assert result["examples"] == 2000 and result["top1"] == s["eval_top1"], (result, s["eval_top1"])


@pytest.fixture(scope="module")
def vit_fsdp_run(sources) -> tuple[Path, str]:
    """The transformers ViT folder fine-tuned on ship vs truck under fsdp_cpu.yaml (2 ranks, 512 images, 1 epoch)."""
    out = sources["root"] / "vit-fsdp"
    result = run_train(job(sources, out, sources["vit"], "--train-subset", "512", "--batch-size", "16", "--epochs",
                           "1", "--optimizer", "adamw", "--lr", "1e-3", "--tracker", "none"), launch=FSDP,
                       script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result.stdout


def test_a_transformers_vit_under_fsdp_is_sharded_by_its_no_split_modules_half_on_each_rank(vit_fsdp_run):
    """Under fsdp_cpu.yaml each of the 2 ranks stores between 45% and 55% of the ViT's parameters, and its 4
    ViTLayer blocks (from its _no_split_modules) are FSDP units of their own."""
    out, stdout = vit_fsdp_run
    s = read_summary(out)
    assert (s["world_size"], s["distributed_type"]) == (2, "FSDP")
    ranks = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    total = s["model"]["parameters"]
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == total
    assert all(0.45 * total <= rank["local_numel"] <= 0.55 * total for rank in ranks)
    assert all(rank["fsdp_units"].count("FSDPViTLayer") == 4 for rank in ranks)
    assert "FSDP units: 4 ViTLayer (the model's _no_split_modules; not ViTEmbeddings" in stdout


def test_the_exported_vit_run_loads_in_transformers_and_its_image_processor_reproduces_the_reported_top1(
        sources, vit_fsdp_run):
    """AutoModelForImageClassification and AutoImageProcessor load the FSDP run's folder (id2label: the data's
    classes), and the processor's pixel values through the model give the run's reported top-1 on the 2,000 test
    images to 0.1 points (2 images)."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    out, _ = vit_fsdp_run
    model = AutoModelForImageClassification.from_pretrained(out).eval()
    processor = AutoImageProcessor.from_pretrained(out)
    assert model.config.id2label == {0: "ship", 1: "truck"}
    top1 = top1_in_batches(lambda ims: model(**processor(ims, return_tensors="pt")).logits,
                           *images_of(sources["data"]))
    assert abs(top1 - read_summary(out)["eval_top1"]) <= 0.1, (top1, read_summary(out)["eval_top1"])


@pytest.fixture(scope="module")
def resized_crop_run(cifar_dir, sources) -> tuple[Path, Path]:
    """resnet8 for 1 epoch under --augment resized-crop at 32 px with --interpolation bicubic and --eval-crop 0.8, on
    upscaled CIFAR-10 images (96-128 px JPEGs; every third one not square)."""
    data = write_upscaled_cifar(sources["root"] / "upscaled", cifar_dir, n_train=64, n_test=24, parquet_shards=1)
    out = sources["root"] / "resized-crop"
    result = run_train(["--data-dir", str(data), "--output-dir", str(out), "--model", "resnet8", "--augment",
                        "resized-crop", "--image-size", "32", "--interpolation", "bicubic", "--eval-crop", "0.8",
                        "--batch-size", "16", "--epochs", "1", "--tracker", "none"])
    assert result.returncode == 0, result.stderr[-4000:]
    return data, out


def expected_view(im: Image.Image, resize: int | None, size: int, mean, std) -> np.ndarray:
    """torchvision's Resize (shorter side, antialiased) + CenterCrop, or none, then normalised: (S, S, 3) float."""
    import torchvision.transforms as T

    if resize is not None:
        im = T.CenterCrop(size)(T.Resize(resize, interpolation=T.InterpolationMode.BICUBIC)(im))
    return (np.asarray(im) / 255 - np.asarray(mean)) / np.asarray(std)


@pytest.mark.parametrize("backend", ["pil", None])
def test_auto_image_processor_loads_a_runs_preprocessor_config_and_gives_its_evaluation_view(
        timm_runs, resized_crop_run, sources, backend):
    """AutoImageProcessor loads preprocessor_config.json of a plain CIFAR run (32 px as decoded) and of a
    resized-crop run (shorter side to int(32 / 0.8) = 40, bicubic, centre 32 x 32), and its pixel values equal the
    run's evaluation view (torchvision's Resize + CenterCrop, normalised with the run's mean and std): within 1e-4 of
    a 0-255 level with backend="pil", within 1 level (+1e-4) with the default torchvision backend; square images (on an
    odd margin, the centre crop's offsets of torchvision and transformers differ by a pixel)."""
    from transformers import AutoImageProcessor

    options = {"backend": backend} if backend else {}
    upscaled, cropped = resized_crop_run
    for run, data, resize in ((timm_runs["fine"], sources["data"], None), (cropped, upscaled, 40)):
        s = read_summary(run)
        processor = AutoImageProcessor.from_pretrained(run, **options)
        images = [im for im in images_of(data, 24)[0] if im.size[0] == im.size[1]]
        assert len(images) >= 16
        for im in images:
            got = processor(im, return_tensors="pt")["pixel_values"][0].numpy().transpose(1, 2, 0)
            want = expected_view(im, resize, 32, s["image_mean"], s["image_std"])
            levels = np.abs(got - want) * np.asarray(s["image_std"]) * 255
            assert levels.max() <= (0 if backend == "pil" else 1) + 1e-4, (run.name, levels.max())


# Bad input: one line, exit 2, nothing written --------------------------------------------------------------
def write_folder(folder: Path, config: str | None) -> Path:
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


def write_bert(folder: Path) -> Path:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         vocab_size=100)).save_pretrained(folder)
    return folder


def write_fixed_size_timm(folder: Path) -> Path:
    import timm
    from timm.models import save_for_hf

    save_for_hf(timm.create_model("test_coatnet", img_size=64, num_classes=8), str(folder), safe_serialization=True,
                data_config={"input_size": (3, 64, 64)})  # timm says fixed_input_size for it
    return folder


@pytest.mark.parametrize(("make", "extra", "env", "message"), [
    (lambda root: write_folder(root / "empty", None), [], {},
     "is not a timm or transformers model folder (its config.json: FileNotFoundError"),
    (lambda root: write_folder(root / "other", '{"a": 1}'), [], {},
     "config.json is neither a timm model's (architecture, pretrained_cfg) nor a transformers model's"),
    (lambda root: "acme/not-cached", [], {"HF_HUB_OFFLINE": "1"},
     "--model acme/not-cached: neither a folder nor a Hub model repo that can be had here"),
    (lambda root: write_fixed_size_timm(root / "fixed"), ["--image-size", "48"], {},
     "takes 64 x 64 px images only (timm's fixed_input_size); drop --image-size 48 or give that size."),
    (lambda root: write_vit(root / "vit32"), ["--image-size", "48"], {},
     "does not take the data's 48 x 48 px images (ValueError: Input image size (48*48) doesn't match model (32*32)"),
    (lambda root: write_bert(root / "bert"), [], {},
     "is a transformers Bert model, not an image classifier (AutoModelForImageClassification takes none of its kind)"),
    (lambda root: "timm:no_such_net", [], {}, "--model timm:no_such_net: timm has no architecture 'no_such_net'"),
])
def test_a_bad_pretrained_model_stops_with_one_line_and_writes_nothing(sources, tmp_path, make, extra, env, message):
    """Each stops before any image is decoded (its cache folder is not made) with one line, and leaves no output
    folder."""
    model = make(tmp_path)
    out = tmp_path / "out"
    result = run_train(job(sources, out, model, "--train-subset", "64", "--batch-size", "16", "--epochs", "1",
                           "--tracker", "none", "--cache-dir", str(tmp_path / "cache"), *extra),
                       env=script_env(HF_HUB_CACHE=str(tmp_path / "hub"), **env))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and message in lines[-1], lines[-5:]
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_a_hub_model_id_in_a_filled_cache_fine_tunes_offline(sources, tmp_path):
    """A Hub model repo id whose files huggingface_hub's cache holds (its layout: models--OWNER--NAME/snapshots/REV,
    refs/main) trains with HF_HUB_OFFLINE=1: the model is read from the cached snapshot."""
    cache = tmp_path / "hub"
    revision = "0" * 40
    snapshot = cache / "models--acme--tiny-vit" / "snapshots" / revision
    shutil.copytree(sources["vit"], snapshot)
    (cache / "models--acme--tiny-vit" / "refs").mkdir()
    (cache / "models--acme--tiny-vit" / "refs" / "main").write_text(revision)
    out = tmp_path / "out"
    result = run_train(job(sources, out, "acme/tiny-vit", "--train-subset", "64", "--batch-size", "16", "--epochs",
                           "1", "--tracker", "none"), script=PROBE,
                       env=script_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PROBE_SAVE_INIT="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--model acme/tiny-vit: transformers ViTForImageClassification from {snapshot}" in result.stdout
    assert read_summary(out)["eval_examples"] == 2000
    # the weights as built equal the cached file's, all but the head; transformers renames some keys as it loads
    # (ViT's attention query -> q_proj), so the tensors are compared as a multiset of (shape, sum, sum of squares)
    built, cached = load_file(out / "probe-init-rank0.safetensors"), load_file(snapshot / "model.safetensors")
    assert built["classifier.weight"].shape == (2, 64) and cached["classifier.weight"].shape == (8, 64)

    def fingerprints(state):
        return sorted((tuple(t.shape), float(t.double().sum()), float(t.double().square().sum()))
                      for k, t in state.items() if not k.startswith("classifier."))
    assert len(built) == len(cached) and fingerprints(built) == fingerprints(cached)


# Units: no training job ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_timm(tmp_path_factory) -> Path:
    """timm's test_resnet with 8 classes, saved by save_for_hf with a 40 px, bicubic, crop 0.9 preprocessing."""
    import timm
    from timm.models import save_for_hf

    folder = tmp_path_factory.mktemp("small-timm") / "src"
    save_for_hf(timm.create_model("test_resnet", num_classes=8), str(folder), safe_serialization=True, data_config={
        "input_size": (3, 40, 40), "crop_pct": 0.9, "interpolation": "bicubic", "mean": (0.4,) * 3, "std": (0.2,) * 3})
    return folder


def test_flags_given_win_over_the_pretrained_models_preprocessing_and_the_rest_is_taken(small_timm):
    """Under --augment resized-crop with --eval-crop 0.8 given, a timm folder's 40 px and bicubic become --image-size
    and --interpolation, --eval-crop stays 0.8, and its mean and std (0.4, 0.2) are returned to replace the data's;
    --image-size given wins too. One line says what was taken."""
    import train_cifar
    from utils.pretrained import apply_preprocessing

    said = []
    cfg = train_cifar.parse_config(["--model", str(small_timm), "--augment", "resized-crop", "--eval-crop", "0.8"])
    assert apply_preprocessing(cfg, said.append) == {"mean": (0.4,) * 3, "std": (0.2,) * 3}
    assert (cfg.image_size, cfg.eval_crop, cfg.interpolation) == (40, 0.8, "bicubic")
    assert said == [f"--model {small_timm}: preprocessing from timm's pretrained_cfg in {small_timm}: --image-size "
                    f"40, --interpolation bicubic, mean (0.4000, 0.4000, 0.4000), std (0.2000, 0.2000, 0.2000); flags "
                    f"given win"]
    cfg = train_cifar.parse_config(["--model", str(small_timm), "--image-size", "64"])
    apply_preprocessing(cfg, said.append)
    assert (cfg.image_size, cfg.eval_crop, cfg.interpolation) == (64, None, None)  # standard crops: size only


def test_backbone_lr_factor_trains_the_new_head_at_lr_and_the_pretrained_tensors_at_lr_times_the_factor(small_timm):
    """build_optimizer with --backbone-lr-factor 0.1 on a timm folder given 2 classes: the head (fc.weight, fc.bias,
    new) trains at lr, every other parameter at lr x 0.1, and the schedule keeps the ratio; the weight decay spares
    the biases and norms of both (groups head, head/no_decay, backbone, backbone/no_decay); given the source's 8
    classes, nothing is new and every parameter trains at lr x 0.1."""
    import train_cifar
    from utils.pretrained import built_from

    cfg = train_cifar.parse_config(["--model", str(small_timm), "--backbone-lr-factor", "0.1", "--optimizer", "adamw"])
    model = train_cifar.build_model(cfg, 2)
    assert built_from(model).new_tensors == ("fc.weight", "fc.bias")
    optimizer = train_cifar.build_optimizer(cfg, model, lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: [names[id(p)] for p in g["params"]] for g in optimizer.param_groups}
    assert list(groups) == ["head", "head/no_decay", "backbone", "backbone/no_decay"]
    assert (groups["head"], groups["head/no_decay"]) == (["fc.weight"], ["fc.bias"])
    shapes = dict(model.named_parameters())
    assert set(groups["backbone"]) == {n for n in names.values() if shapes[n].ndim == 4}  # the convolutions' kernels
    assert sum(map(len, groups.values())) == len(names)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.weight_decay, 0.0] * 2
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert schedule.get_last_lr() == pytest.approx([5e-4, 5e-4, 5e-5, 5e-5])
    same_classes = train_cifar.build_model(cfg, 8)  # the source's 8: its head is kept, nothing is new
    assert built_from(same_classes).new_tensors == ()
    assert [g["lr"] for g in train_cifar.build_optimizer(cfg, same_classes, lr=1e-3).param_groups] == [1e-4, 1e-4]


def test_a_timm_vit_under_fsdp_is_sharded_per_block_by_the_size_fallback():
    """timm's models declare no _no_split_modules: for timm's 6-block test ViT the size fallback makes each of the 6
    transformer blocks a unit of its own, and the start line names the classes and their counts."""
    import types

    import timm
    from accelerate.utils import FullyShardedDataParallelPlugin

    from utils.launch import choose_fsdp_units

    model, said = timm.create_model("test_vit", num_classes=2), []
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    choose_fsdp_units(types.SimpleNamespace(print=said.append), plugin, model)
    assert len(model.blocks) == 6 and getattr(model, "_no_split_modules", None) is None
    assert said[0].startswith("FSDP units: ") and ", 6 Block, " in said[0], said
    assert "which declares no _no_split_modules), then the whole model" in said[0]


@pytest.mark.parametrize("library", ["timm", "transformers"])
def test_the_tools_rebuild_a_fine_tuned_model_from_the_run_folder_when_its_pretrained_folder_is_gone(
        sources, tmp_path, library):
    """A timm folder and a transformers ViT, each copied, fine-tuned from the copy (1 process, 64 images, 1 epoch),
    the copy then deleted: evaluate_checkpoint.py on the run's weights rebuilds the model from the run folder's own
    config.json and reports the run's top-1 on its 2,000 test images; predict.py classifies test images saved as
    files; neither says a tensor is freshly initialised."""
    model = tmp_path / "model"
    shutil.copytree(sources["timm" if library == "timm" else "vit"], model)
    out = tmp_path / "run"
    result = run_train(job(sources, out, model, "--train-subset", "64", "--batch-size", "16", "--epochs", "1",
                           "--tracker", "none"))
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.rmtree(model)
    evaluated = run_python([str(REPO / "evaluate_checkpoint.py"), str(out / "model.safetensors")], script_env(),
                           timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    said = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert (said["examples"], said["top1"]) == (2000, read_summary(out)["eval_top1"])
    photos = tmp_path / "photos"
    photos.mkdir()
    for i, im in enumerate(images_of(sources["data"], 8)[0]):
        im.save(photos / f"{i}.png")
    predicted = run_python([str(REPO / "predict.py"), str(out), str(photos), "--output", str(tmp_path / "p.csv")],
                           script_env(), timeout=600)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert "wrote 8 predictions" in predicted.stdout
    for text in (evaluated.stdout + evaluated.stderr, predicted.stdout + predicted.stderr):
        assert "freshly initialised" not in text and f"from {out}" in text


def test_a_model_input_size_other_than_the_datas_is_said_with_its_cost_and_the_other_choice(small_timm, cifar_dir):
    """A timm folder pretrained at 40 px, on CIFAR-10's 32 px images with no --image-size: one line says it trains at
    40 x 40 px, the data's 32 x 32, 1.6x the pixels per image, and that --image-size 32 trains at the data's size;
    --image-size given: no such line; photos larger than the model's input (1600 x 1200, or 1200 x 1600): no such
    line either (they are cut down to it, as fine-tuning does)."""
    import train_cifar
    from utils.pretrained import apply_preprocessing, say_size

    said = []
    apply_preprocessing(train_cifar.parse_config(["--model", str(small_timm), "--data-dir", str(cifar_dir)]),
                        said.append)
    assert said[-1] == (f"--model {small_timm}: trains at its input size, 40 x 40 px, where the data's first image is "
                        f"32 x 32 px: 1.6x its pixels per image, and about that much more compute per image than at "
                        f"32 px; --image-size 32 trains at the data's size (the model then sees another size than it "
                        f"was pretrained at)")
    said.clear()
    apply_preprocessing(train_cifar.parse_config(["--model", str(small_timm), "--data-dir", str(cifar_dir),
                                                  "--image-size", "32"]), said.append)
    assert len(said) == 1 and "trains at its input size" not in said[0]
    cfg = train_cifar.parse_config(["--model", str(small_timm), "--image-size", "40"])
    said.clear()
    for photo in ((1600, 1200), (1200, 1600), (40, 900), (39, 900)):
        say_size(cfg, photo, said.append)
    assert len(said) == 1 and said[0].startswith(f"--model {small_timm}: trains at its input size, 40 x 40 px, where "
                                                 f"the data's first image is 39 x 900 px")


def test_a_transformers_backbone_without_a_head_gets_a_new_one_and_says_so(sources, tmp_path):
    """A folder holding a transformers ViTModel (a backbone: no classification head) fine-tunes (1 process, 64
    images, 1 epoch) as a ViTForImageClassification whose head is new, and the start line says so."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    backbone = tmp_path / "backbone"
    ViTModel(ViTConfig(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=128)).save_pretrained(backbone)
    out = tmp_path / "run"
    result = run_train(job(sources, out, backbone, "--train-subset", "64", "--batch-size", "16", "--epochs", "1",
                           "--tracker", "none"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"--model {backbone}: transformers ViTForImageClassification from {backbone}; new, freshly initialised: "
            f"classifier.bias, classifier.weight (the folder holds a ViTModel, a backbone without a classification "
            f"head: the head is new)") in result.stdout
    s = read_summary(out)
    assert s["model"]["class"] == "ViTForImageClassification" and s["eval_examples"] == 2000


def test_a_transformers_vit_under_fsdp_warns_of_a_view_yet_trains_the_weights_ddp_trains(sources, tmp_path):
    """FSDP2 warns that the ViT's patch embedding returns a view tensor (an in-place op on it would skip FSDP's
    all-gather); the ViT's embeddings use it out of place only, so the warning is harmless here: fp32, --deterministic,
    4 steps of 2 ranks x 16 images, FSDP2 and DDP end with every trainable parameter within 2e-4."""
    runs = {}
    for name, launch in (("ddp", TWO_RANKS), ("fsdp", [*FSDP, "--mixed_precision", "no"])):
        runs[name] = tmp_path / name
        result = run_train(job(sources, runs[name], sources["vit"], "--train-subset", "128", "--batch-size", "16",
                               "--epochs", "1", "--optimizer", "adamw", "--lr", "1e-3", "--no-channels-last",
                               "--deterministic", "--tracker", "none"), launch=launch)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name + "-stderr"] = result.stderr
    assert "returned a view tensor" in runs["fsdp-stderr"] and "returned a view tensor" not in runs["ddp-stderr"]
    ddp, fsdp = load_file(runs["ddp"] / "model.safetensors"), load_file(runs["fsdp"] / "model.safetensors")
    assert read_summary(runs["fsdp"])["global_step"] == 4
    assert ddp.keys() == fsdp.keys()
    worst = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    assert worst <= 2e-4, worst
