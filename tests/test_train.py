"""train_cifar.py end to end: 2 gloo ranks from cpu.yaml, and one process with bf16, accumulation and W&B."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from conftest import (
    CIFAR_CLASSES,
    CPU_YAML,
    REPO,
    assert_same_state,
    cross_entropy,
    digests,
    export_png_folder,
    job_args,
    read_summary,
    run_train,
    script_env,
    write_mixed_folder,
    write_parquet,
)
from PIL import Image
from safetensors.torch import load_file

import train_cifar
from utils import UserError
from utils.cli import build_parser
from utils.data.decode import load_source
from utils.data.loaders import make_loader
from utils.data.transform import BatchTransform
from utils.evaluation import Evaluator
from utils.models import named_model
from utils.progress import Progress

EVAL_SUBSET = 1001  # not divisible by 2 ranks x 64: Accelerate pads the last batches, gather_for_metrics must drop it


@pytest.fixture(scope="module")
def two_rank_run(cifar_dir, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    result = run_train(["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        "--model", "resnet8", "--train-subset", "2048", "--eval-subset", str(EVAL_SUBSET),
                        "--epochs", "4", "--warmup-epochs", "0.25", "--batch-size", "64", "--lr", "0.2",
                        "--tracker", "none"],
                       launch=["--config_file", str(CPU_YAML)])
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


def test_two_ranks_from_cpu_yaml_train_well_above_chance(two_rank_run):
    out, result = two_rank_run
    s = read_summary(out)
    assert (s["world_size"], s["distributed_type"], s["wrapper"]) == (2, "MULTI_CPU", "DistributedDataParallel")
    assert s["mixed_precision"] == "no" and s["config"]["channels_last"]  # cpu.yaml's and the script's defaults
    assert s["epochs_completed"] == 4 and s["global_step"] == 4 * (2048 // 128)
    assert s["train_images_seen"] == 4 * 2048
    # chance is 10%; on a 2-core Zen 3: 38.2% (seeds 1-5: 37.2, 34.7, 39.1, 35.7, 37.9%; 2 epochs at this lr: 32.0%)
    assert s["eval_top1"] > 30.0, s
    assert s["eval_top5"] > s["eval_top1"] and s["best_eval_top1"] >= s["eval_top1"]
    assert len([line for line in result.stdout.splitlines() if line.startswith("epoch ")]) == 4  # once, not per rank


def test_two_rank_eval_counts_each_test_image_exactly_once(two_rank_run):
    s = read_summary(two_rank_run[0])
    assert s["eval_examples"] == EVAL_SUBSET
    per_class = s["eval_class_top1"]
    assert len(per_class) == 10 and all(0 <= v <= 100 for v in per_class.values())


def test_exported_weights_load_into_a_plain_model_and_reproduce_the_reported_top1(two_rank_run, cifar_dir, cache_dir):
    out, _ = two_rank_run
    state = load_file(out / "model.safetensors")
    assert not [k for k in state if k.startswith("module.")]
    model = named_model("resnet8")
    model.load_state_dict(state, strict=True)
    accelerator = Accelerator(cpu=True)
    data = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    images, labels = data["test"]
    loader = make_loader(images[:EVAL_SUBSET], labels[:EVAL_SUBSET], batch_size=250, train=False)
    model = model.to(memory_format=torch.channels_last)  # as trained: channels_last, fp32 (cpu.yaml)
    transform = BatchTransform(torch.device("cpu"), channels_last=True, mean=data["mean"], std=data["std"])
    metrics = train_cifar.evaluate(model, loader, transform, accelerator, CIFAR_CLASSES, cross_entropy)
    reported = read_summary(out)
    assert metrics["examples"] == EVAL_SUBSET
    # Same weights, images and precision; the CPU thread count (1 vs 2) and the batch size differ from training,
    # which can move a logit by rounding: allow one image of difference.
    assert abs(metrics["top1"] - reported["eval_top1"]) <= 100 / EVAL_SUBSET + 1e-9
    assert metrics["loss"] == pytest.approx(reported["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_one_process_bf16_from_the_launcher_with_accumulation_and_offline_wandb(cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    env = script_env(ACCELERATE_MIXED_PRECISION="bf16", HOME=str(tmp_path))  # no W&B credentials in this HOME
    del env["WANDB_MODE"]
    result = run_train(["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        "--model", "resnet8", "--train-subset", "1024", "--eval-subset", "100",
                        "--batch-size", "16", "--grad-accum", "2", "--max-steps", "6", "--optimizer", "adamw",
                        "--lr", "1e-3", "--channels-last", "--tracker", "wandb"], env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert (s["world_size"], s["mixed_precision"], s["wrapper"]) == (1, "bf16", "ResNet8")
    assert s["global_step"] == 6 and s["train_images_seen"] == 6 * 2 * 16  # 2 micro-batches per step
    assert s["eval_examples"] == 100 and s["config"]["grad_accum"] == 2
    assert "logging offline" in result.stderr
    assert len(list(out.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    state = load_file(out / "model.safetensors")
    assert state["conv1.weight"].dtype == torch.float32  # bf16 autocast keeps fp32 master weights


def test_every_config_field_is_a_documented_flag():
    parsed = train_cifar.parse_config(["--lr", "0.5", "--channels-last", "--train-subset", "7", "--model",
                                       "resnet18_imagenet"])
    assert (parsed.lr, parsed.channels_last, parsed.train_subset, parsed.model) == (0.5, True, 7, "resnet18_imagenet")
    defaults = train_cifar.parse_config([])
    assert defaults == train_cifar.Config()
    for f in fields(train_cifar.Config):
        assert f.metadata["help"], f.name
    with pytest.raises(UserError, match=r"^argument --optimizer: invalid choice: 'lion' \(choose from"):
        train_cifar.parse_config(["--optimizer", "lion"])


def test_help_lists_the_flags_in_the_groups_of_the_config_each_with_its_purpose():
    text = build_parser(train_cifar.Config, "description").format_help()
    sections = re.split(r"^([a-z]+):$", text, flags=re.MULTILINE)  # [preamble, title, body, title, body, ...]
    titles, bodies = sections[1::2], sections[2::2]
    assert titles == ["options", "recipe", "data", "model", "optimisation", "evaluation", "checkpoints", "logging",
                      "hub"]
    flags = {title: re.findall(r"^  (--[a-z0-9-]+)", body, flags=re.MULTILINE) for title, body in zip(titles, bodies)}
    assert flags["options"] == ["--config"]  # -h and the parser's own --config FILE: every field sits in a group
    assert sorted(f for group in flags.values() for f in group if f != "--config") == sorted(
        "--" + f.name.replace("_", "-") for f in fields(train_cifar.Config))
    assert ("--lr" in flags["optimisation"] and "--resume" in flags["checkpoints"] and "--data-dir" in flags["data"]
            and "--tracker" in flags["logging"] and "--model" in flags["model"] and "--init-from" in flags["hub"])
    assert bodies[titles.index("optimisation")].lstrip().startswith("batch, learning rate and its schedule")


def test_a_list_flag_may_be_given_once_per_value_and_a_repeated_metric_stops_with_one_line():
    cfg = train_cifar.parse_config(["--metric", "f1:average=macro", "--metric", "accuracy"])
    assert cfg.metric == ["f1:average=macro", "accuracy"] and train_cifar.parse_config([]).metric is None
    with pytest.raises(UserError, match="--metric: each metric once"):
        train_cifar.parse_config(["--metric", "f1", "--metric", "f1"])
    with pytest.raises(UserError, match="--push-to-hub takes a Hub model repo id"):
        train_cifar.parse_config(["--push-to-hub", "no-owner"])


def test_schedule_warms_up_linearly_then_decays_to_zero_by_the_last_step():
    factor = train_cifar.warmup_cosine(warmup_steps=10, total_steps=110)
    assert [factor(k) for k in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(60) == pytest.approx(0.5)
    assert factor(110) == pytest.approx(0.0, abs=1e-12)
    assert all(factor(k) >= factor(k + 1) for k in range(10, 110))
    assert math.isclose(train_cifar.warmup_cosine(0, 5)(0), 1.0)


@pytest.mark.slow
def test_compiled_model_trains_and_exports_weights_without_the_orig_mod_prefix(cifar_dir, cache_dir, tmp_path):
    # resnet9: the fast recipe's model, and 25% less inductor compile time than resnet18_imagenet's (32 s against
    # 42 s with a cold compile cache on 2 CPU cores)
    out = tmp_path / "compiled"
    result = run_train(["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        "--model", "resnet9", "--train-subset", "256", "--eval-subset", "64",
                        "--batch-size", "64", "--max-steps", "2", "--compile", "--tracker", "none"])
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert s["wrapper"] == "OptimizedModule" and s["global_step"] == 2 and s["eval_examples"] == 64
    state = load_file(out / "model.safetensors")
    assert not [k for k in state if k.startswith(("_orig_mod.", "module."))]
    named_model("resnet9").load_state_dict(state, strict=True)


def test_recipe_sets_its_defaults_and_explicit_flags_still_win():
    fast = train_cifar.parse_config(["--recipe", "fast", "--epochs", "3"])
    expected = {**train_cifar.RECIPES["fast"], "epochs": 3}
    assert {k: getattr(fast, k) for k in expected} == expected and fast.recipe == "fast"
    assert train_cifar.parse_config(["--recipe", "resnet18"]).model == "resnet18"
    assert set(train_cifar.RECIPES["fast"]) <= {f.name for f in fields(train_cifar.Config)}  # every key is a real flag


def test_evaluate_checkpoint_evaluates_as_the_run_did_with_flip_tta_in_channels_last(cifar_dir, cache_dir, tmp_path):
    """A run folder of train_cifar.py with --tta-flip, channels-last and 64 test images, holding resnet9 weights with a
    1000x head (confident logits, so an image and its mirror differ): evaluate_checkpoint.py's loss (to 1e-5) and
    top-1 are those of the mean logits of each image and its mirror, computed here from the same weights; the plain
    logits' loss is more than 1e-3 away (measured 2e-3)."""
    import json
    from dataclasses import asdict

    from safetensors.torch import save_file

    import evaluate_checkpoint
    from utils.scripts import script_record

    torch.manual_seed(0)
    model = named_model("resnet9").eval()
    with torch.no_grad():
        model[-2].weight.mul_(1000.0)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    cfg = train_cifar.Config(model="resnet9", data_dir=str(cifar_dir), cache_dir=str(cache_dir), eval_subset=64,
                             tta_flip=True, output_dir=str(tmp_path))
    (tmp_path / "summary.json").write_text(json.dumps({
        "model": "resnet9", "script": script_record(cfg), "config": asdict(cfg), "mixed_precision": "no",
        "channels_last": True, "batch_size_per_process": 32}))
    got = evaluate_checkpoint.main([str(tmp_path / "model.safetensors")])
    data = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    images, labels = (t[:64] for t in data["test"])
    x = BatchTransform(torch.device("cpu"), channels_last=False, mean=data["mean"], std=data["std"])(images)
    with torch.no_grad():
        plain, mirrored = model(x), model(x.flip(3))
    logits = (plain + mirrored) / 2
    assert got["examples"] == 64 and got["script"] == "train_cifar.py"
    assert got["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert got["top1"] == pytest.approx(100.0 * (logits.argmax(1) == labels).float().mean().item())
    assert abs(torch.nn.functional.cross_entropy(plain, labels).item() - got["loss"]) > 1e-3 * got["loss"]  # 2e-3


def test_flip_test_time_augmentation_averages_the_logits_of_each_image_and_its_mirror(cifar_dir, cache_dir):
    accelerator = Accelerator(cpu=True)
    data = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    images, labels = data["test"][0][:64], data["test"][1][:64]
    torch.manual_seed(0)
    model = named_model("resnet9").eval()
    model[-1].factor = 50.0  # confident logits, so an image and its mirror give clearly different ones
    transform = BatchTransform(torch.device("cpu"), channels_last=False, mean=data["mean"], std=data["std"])
    loader = accelerator.prepare(make_loader(images, labels, 32, train=False))
    plain, flipped = (train_cifar.evaluate(model, loader, transform, accelerator, CIFAR_CLASSES, cross_entropy,
                                           tta_flip=t)
                       for t in (False, True))
    with torch.no_grad():
        x = transform(images)
        logits = (model(x) + model(x.flip(3))) / 2
    assert flipped["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)
    assert flipped["top1"] == pytest.approx(100.0 * (logits.argmax(1) == labels).float().mean().item())
    assert abs(plain["loss"] - flipped["loss"]) > 100 * 1e-5 * flipped["loss"]  # the mirror really was evaluated


@pytest.mark.slow
def test_fast_recipe_trains_resnet9_with_the_data_on_the_device(cifar_dir, cache_dir, tmp_path):
    """The GPU recipe's code path on CPU (where 'on the device' is the host and compile is switched off to save
    time)."""
    out = tmp_path / "fast"
    result = run_train(["--recipe", "fast", "--no-compile", "--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir),
                        "--output-dir", str(out), "--train-subset", "512", "--eval-subset", "250", "--epochs", "2",
                        "--batch-size", "32", "--lr", "0.1", "--warmup-epochs", "1", "--tracker", "none"])
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert (s["config"]["model"], s["config"]["tta_flip"], s["config"]["data_on_device"]) == ("resnet9", True, True)
    assert s["global_step"] == 2 * (512 // 32) and s["eval_examples"] == 250
    assert s["eval_top1"] > 20, s["eval_top1"]  # chance is 10% (+- 1.9 points on 250 images); 34.8% on a Zen 3


@pytest.mark.slow
def test_a_hundred_class_parquet_with_image_and_fine_label_columns_trains_a_resnet_for_its_classes(tmp_path, cache_dir):
    """The classes come from the data: the model's head, the metrics, the confusion matrix and summary.json. With
    more than 20 classes the tracker gets no per-class keys (summary.json keeps them all)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    names = tuple(f"class_{k:03d}" for k in range(100))
    data = tmp_path / "cifar100-like"
    data.mkdir()
    for split, n, seed in (("train", 400, 1), ("test", 200, 2)):
        write_parquet(data / f"{split}-00000-of-00001.parquet", n, seed=seed, labels=np.arange(n) % 100,
                      class_names=names, columns=("image", "fine_label"))
    out = tmp_path / "run"
    result = run_train(["--data-dir", str(data), "--cache-dir", str(cache_dir), "--output-dir", str(out), "--model",
                        "resnet8", "--batch-size", "64", "--max-steps", "3", "--tracker", "tensorboard"])
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(out)
    assert s["classes"] == list(names) and s["image_size"] == 32 and s["dataset"]["kind"] == "parquet"
    assert list(s["eval_class_top1"]) == list(names) and s["eval_examples"] == 200
    assert len(s["eval_confusion"]) == 100 and {len(row) for row in s["eval_confusion"]} == {100}
    assert [sum(row) for row in s["eval_confusion"]] == [2] * 100  # each class twice in the test split
    assert s["eval_top5"] >= s["eval_top1"]
    assert load_file(out / "model.safetensors")["fc.weight"].shape == (100, 64)
    tags = EventAccumulator(str(out / "cifar10-accelerate")).Reload().Tags()["scalars"]
    assert "eval/top5" in tags and not [t for t in tags if t.startswith("eval/top1_")]


@pytest.mark.slow
def test_a_folder_of_mixed_sizes_grayscale_and_rgba_trains_end_to_end_at_image_size_48(tmp_path, cache_dir):
    """And evaluate_checkpoint.py takes the image size from summary.json: the same top-1 from the exported weights."""
    import evaluate_checkpoint

    folder = write_mixed_folder(tmp_path / "folder")
    out = tmp_path / "run"
    result = run_train(["--data-dir", str(folder), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        "--image-size", "48", "--model", "resnet8", "--batch-size", "4", "--epochs", "2",
                        "--no-channels-last", "--tracker", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(out)
    assert (s["image_size"], s["classes"], s["dataset"]["kind"]) == (48, ["ant", "bee", "cow"], "imagefolder")
    assert s["global_step"] == 2 * (9 // 4) and s["eval_examples"] == 9 and len(s["eval_confusion"]) == 3
    evaluated = evaluate_checkpoint.main([str(out / "model.safetensors"), "--data-dir", str(folder), "--cache-dir",
                                          str(cache_dir)])
    assert evaluated["top1"] == pytest.approx(s["eval_top1"]) and evaluated["examples"] == 9


@pytest.mark.slow
def test_a_run_chooses_on_val_and_evaluate_checkpoint_scores_test_by_eval_split(tmp_path, cache_dir, capsys):
    """An image folder of train/ (48), val/ (12) and test/ (9): the run evaluates on val/, says so in its data line
    and records it; evaluate_checkpoint.py gives the run's top-1 on the 12 val images, and with --eval-split test
    scores the 9 test images, without the warning of a part that may hold training images; so it does for a run that
    held 0.25 of train out instead."""
    import evaluate_checkpoint

    folder = tmp_path / "photos"
    for split, n, green in (("train", 48, 50), ("val", 12, 60), ("test", 9, 70)):  # no image in two splits
        for i in range(n):
            (folder / split / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (100 * (i % 3), green, 5 * i)).save(folder / split / f"c{i % 3}" / f"{i}.png")
    out = tmp_path / "run"
    result = run_train(["--data-dir", str(folder), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        "--model", "resnet8", "--batch-size", "8", "--epochs", "1", "--tracker", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout.splitlines()
    assert "data: 48 training and 12 evaluation images (val) of 3 classes (16 training images each)" in said
    assert ("evaluating on the val split; test left for a final score: evaluate_checkpoint.py RUN/best.safetensors "
            "--eval-split test") in said
    s = read_summary(out)
    assert (s["dataset"]["eval_split"], s["eval_examples"]) == ("val", 12)
    again = evaluate_checkpoint.main([str(out / "model.safetensors")])
    assert (again["examples"], again["top1"]) == (12, pytest.approx(s["eval_top1"]))
    capsys.readouterr()
    test = evaluate_checkpoint.main([str(out / "model.safetensors"), "--eval-split", "test"])
    assert test["examples"] == 9 and torch.tensor(test["confusion"]).sum(dim=1).tolist() == [3, 3, 3]
    assert "warning" not in capsys.readouterr().out
    held = tmp_path / "held"  # a run that held a part of train out: --eval-split replaces it, not contradicts it
    result = run_train(["--data-dir", str(folder), "--cache-dir", str(cache_dir), "--output-dir", str(held),
                        "--model", "resnet8", "--batch-size", "8", "--epochs", "1", "--val-fraction", "0.25",
                        "--tracker", "none"])
    assert result.returncode == 0 and read_summary(held)["eval_examples"] == 12, result.stderr[-3000:]
    assert evaluate_checkpoint.main([str(held / "model.safetensors"), "--eval-split", "test"])["examples"] == 9


@pytest.mark.slow
def test_a_val_folder_without_one_class_trains_labelled_by_the_training_classes_and_leaves_its_accuracy_unmeasured(
        tmp_path, cache_dir):
    """train/ holds c0, c1 and c2 (16 images each), val/ only c0 (4) and c2 (5), as a small photo set often is: the run
    trains (not one line refusing the folder), warns that c1 has no evaluation image, labels val/'s images by the
    training classes (the confusion matrix's rows hold 4, 0 and 5 images: c2's are class 2, not 1), and records c1's
    accuracy as unmeasured (null), not 0%."""
    folder = tmp_path / "photos"
    for split, counts in (("train", (16, 16, 16)), ("val", (4, 0, 5))):
        for c, n in enumerate(counts):
            for i in range(n):
                (folder / split / f"c{c}").mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (8, 8), (100 * c, 50, 5 * i)).save(folder / split / f"c{c}" / f"{i}.png")
    out = tmp_path / "run"
    result = run_train(["--data-dir", str(folder), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        "--model", "resnet8", "--batch-size", "8", "--epochs", "1", "--tracker", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("warning: 1 of the 3 classes have no evaluation image (c1): their accuracy is not measured" in
            result.stdout.splitlines())
    s = read_summary(out)
    assert [sum(row) for row in s["eval_confusion"]] == [4, 0, 5] and s["eval_examples"] == 9
    assert s["eval_class_top1"]["c1"] is None and all(s["eval_class_top1"][c] is not None for c in ("c0", "c2"))


# Own data on 2 ranks: an image folder, and a Hub dataset by name without a test split ------------------------------
@pytest.mark.slow
def test_two_ranks_train_on_a_png_folder_of_cifar_exactly_as_on_the_same_parquet_rows(cifar_dir, cache_dir, tmp_path):
    """The first 256 / 64 CIFAR-10 images as a PNG folder, and the original parquet rows (JPEG bytes) of the same
    images in the order the folder is loaded in (shuffled class folders): the two 2-rank jobs decode, normalise,
    train and evaluate the same, to the bit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cifar = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    sizes = {"train": 256, "test": 64}
    export_png_folder(tmp_path / "folder", {s: (cifar[s][0][:n], cifar[s][1][:n]) for s, n in sizes.items()})
    folder = load_source(str(tmp_path / "folder"), cache_dir=str(tmp_path / "probe-cache"))
    (tmp_path / "parquet").mkdir()
    for split, n in sizes.items():
        row_of = {digests(im[None], y[None])[0]: i for i, (im, y) in enumerate(zip(*(t[:n] for t in cifar[split])))}
        order = [row_of[digests(im[None], y[None])[0]] for im, y in zip(*folder[split])]
        assert sorted(order) == list(range(n)) and order != list(range(n))
        rows = pa.concat_tables([pq.read_table(f) for f in sorted(cifar_dir.glob(f"{split}-*.parquet"))])
        pq.write_table(rows.slice(0, n).take(order), tmp_path / "parquet" / f"{split}-00000-of-00001.parquet")
    job = ["--model", "resnet8", "--epochs", "1", "--batch-size", "64", "--deterministic", "--tracker",
           "none"]
    summaries = {}
    for source in ("folder", "parquet"):
        result = run_train(["--data-dir", str(tmp_path / source), "--cache-dir", str(tmp_path / f"cache-{source}"),
                            "--output-dir", str(tmp_path / f"run-{source}"), *job],
                           launch=["--config_file", str(CPU_YAML)])
        assert result.returncode == 0, result.stderr[-3000:]
        summaries[source] = read_summary(tmp_path / f"run-{source}")
    a, b = summaries["folder"], summaries["parquet"]
    assert (a["dataset"]["kind"], b["dataset"]["kind"], a["world_size"]) == ("imagefolder", "parquet", 2)
    assert a["classes"] == b["classes"] == sorted(a["classes"]) and len(a["classes"]) == 10
    assert a["global_step"] == b["global_step"] == 256 // 128 and a["eval_examples"] == 64
    for key in ("train_loss", "eval_loss", "eval_top1", "eval_top5", "eval_confusion", "eval_class_top1"):
        assert a[key] == b[key], key
    assert_same_state(tmp_path / "run-folder" / "model.safetensors", tmp_path / "run-parquet" / "model.safetensors")


@pytest.mark.slow
def test_a_hub_dataset_without_a_test_split_holds_out_the_stated_part_on_two_ranks_and_evaluates_it_again(tmp_path,
                                                                                                         capsys):
    """--dataset NAME with named columns (a local path in the Hub's layout stands in for the id: no network here);
    evaluate_checkpoint.py finds the same data and held-out part from summary.json alone, and says in one line when
    the summary names another part than the one it evaluates on (a run whose part was drawn by another rule). Given
    --data-dir a folder of new photos in class folders (no evaluation split), it stops with one line pointing at
    predict.py instead of scoring the 0.1 of them it would hold out; given a folder of 2 of the run's classes, or of 3
    classes one of which the run lacks, one line naming the class, instead of scoring the model's outputs by index."""
    import evaluate_checkpoint

    repo = tmp_path / "hub" / "pets"
    (repo / "data").mkdir(parents=True)
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", 320, seed=7, class_names=("cat", "dog", "fish"),
                  columns=("picture", "species"), size=(16, 16))
    out, cache = tmp_path / "run", tmp_path / "cache"
    result = run_train(["--dataset", str(repo), "--image-column", "picture", "--label-column", "species",
                        "--cache-dir", str(cache), "--output-dir", str(out), "--model", "resnet8",
                        "--batch-size", "16", "--epochs", "1", "--tracker", "none"],
                       launch=["--config_file", str(CPU_YAML)])
    assert result.returncode == 0, result.stderr[-3000:]
    stated = [line for line in result.stdout.splitlines() if line.startswith("no evaluation split")]
    assert stated == ["no evaluation split: evaluating on 32 of the 320 training images, held out by --val-fraction "
                      "0.1 (each class its share, by a fixed shuffle: the same on every process and run); training "
                      "on the other 288"]
    assert [line for line in result.stdout.splitlines() if line.startswith("data: ")][0].startswith(
        "data: 288 training and 32 evaluation images (0.1 of train, held out by class) of 3 classes (")
    s = read_summary(out)
    assert s["dataset"] == {"source": str(repo), "kind": "hub", "fingerprint": s["dataset"]["fingerprint"],
                            "eval_split": "0.1 of train, held out by class", "val_fraction": 0.1}
    assert s["classes"] == ["cat", "dog", "fish"] and s["image_size"] == 16 and s["world_size"] == 2
    assert s["train_images_seen"] == 288 and s["global_step"] == 288 // 32 and s["eval_examples"] == 32
    capsys.readouterr()
    evaluated = evaluate_checkpoint.main([str(out / "model.safetensors"), "--cache-dir", str(cache)])
    assert evaluated["examples"] == 32 and evaluated["top1"] == pytest.approx(s["eval_top1"])  # the held-out part
    assert "warning" not in capsys.readouterr().out
    older = s["dataset"] | {"eval_split": "0.1 of train, held out"}
    (out / "summary.json").write_text(json.dumps(s | {"dataset": older}))
    evaluate_checkpoint.main([str(out / "model.safetensors"), "--cache-dir", str(cache)])
    assert ("warning: the run evaluated on 0.1 of train, held out; this evaluates on 0.1 of train, held out by class, "
            "which may hold images the run trained on.") in capsys.readouterr().out.splitlines()
    photos = tmp_path / "new-photos"  # new labelled photos, a folder of class folders: not its 0.1 held out
    for k, name in enumerate(("cat", "dog", "fish")):
        (photos / name).mkdir(parents=True)
        for i in range(10):
            Image.new("RGB", (16, 16), (80 * k, 40, 10 * i)).save(photos / name / f"{i}.png")
    with pytest.raises(UserError, match=rf"^--data-dir {photos} has no evaluation split \(test/ or val/ beside "
                                        rf"train/\), so only the 0\.1 of it held out by class would be scored; every "
                                        rf"image of a folder of class folders: predict\.py RUN {photos} --output "):
        evaluate_checkpoint.main([str(out / "model.safetensors"), "--data-dir", str(photos), "--cache-dir", str(cache)])
    for names, why in ((("cat", "dog"), "fish is in the run alone"),
                       (("bird", "cat", "dog"), "bird is in the data alone")):
        other = tmp_path / "-".join(names)  # train/ and test/ of other classes: scored by index, one would be another
        for split, k, name in ((split, k, name) for split in ("train", "test") for k, name in enumerate(names)):
            (other / split / name).mkdir(parents=True)
            Image.new("RGB", (16, 16), (80 * k, 40, 10)).save(other / split / name / "0.png")
        with pytest.raises(UserError, match=rf"^the data's {len(names)} classes are not the run's 3 \({why}\); a "
                                            rf"folder of some of the run's classes: predict\.py RUN FOLDER gives"):
            evaluate_checkpoint.main([str(out / "model.safetensors"), "--data-dir", str(other), "--cache-dir",
                                      str(cache)])


# Early stopping ----------------------------------------------------------------------------------------------------
def test_the_early_stopping_count_resets_on_a_gain_of_more_than_min_delta_only():
    """An evaluation gains when its value beats the last gain's by more than min_delta, in the metric's direction; the
    first evaluation is a gain. top1 (max), min_delta 1: 13.5 gains over the last gain 12 though it beats the best,
    12.5, by exactly 1. loss (min), min_delta 0.1: 1.75 gains over 2.0, 1.7 does not; the best is the lowest. A NaN
    is neither a gain nor the best; another metric starts the record afresh."""
    p, counts, best = Progress(), [], []
    for top1 in (10.0, 12.0, 12.5, 11.0, 13.5, 13.0):  # gains (more than 1 over the last gain): 10, 12, 13.5
        best.append(p.is_best("top1", "max", top1, min_delta=1.0))
        counts.append(p.evals_without_gain)
    assert counts == [0, 0, 1, 2, 0, 1] and best == [True, True, True, False, True, False] and p.best_value == 13.5
    p, counts, best = Progress(), [], []
    for loss in (2.0, 1.95, 1.75, 1.7, float("nan"), 1.8):  # gains: 2.0, 1.75
        best.append(p.is_best("loss", "min", loss, min_delta=0.1))
        counts.append(p.evals_without_gain)
    assert counts == [0, 1, 0, 1, 2, 3] and best == [True, True, True, True, False, False] and p.best_value == 1.7
    assert p.is_best("top1", "max", 5.0) and (p.best_metric, p.best_value, p.evals_without_gain) == ("top1", 5.0, 0)


def test_best_metric_takes_a_direction_from_its_name_or_the_flag_and_names_only_evaluated_metrics():
    """--best-metric: loss (and ema_loss) lower is better, the rest higher, NAME:min / NAME:max override; unset: top1,
    or ema_top1 with --ema-decay. A bad form, an ema_ metric without --ema-decay, or a name the evaluation does not
    produce is one line."""
    def best(*flags):
        return train_cifar.parse_config(list(flags)).best()

    assert best() == ("top1", "max") and best("--ema-decay", "0.9") == ("ema_top1", "max")
    assert best("--best-metric", "loss") == ("loss", "min") and best("--best-metric", "f1_macro") == ("f1_macro", "max")
    assert best("--best-metric", "ema_loss", "--ema-decay", "0.9") == ("ema_loss", "min")
    assert best("--best-metric", "mse:min") == ("mse", "min") and best("--best-metric", "loss:max") == ("loss", "max")
    for flags, message in ((["--best-metric", "top1:up"], "--best-metric top1:up: NAME, NAME:max or NAME:min"),
                           (["--best-metric", "ema_top1"], "--best-metric ema_top1: an EMA's metric needs "
                                                           "--ema-decay")):
        with pytest.raises(UserError, match=re.escape(message)):
            best(*flags)
    cfg = train_cifar.parse_config(["--best-metric", "f1"])
    with pytest.raises(UserError, match=re.escape("--best-metric f1: not a metric this run evaluates (loss, top1, "
                                                  "top5)")):
        Evaluator(cfg, None, None, None, None, None)


# vit_micro at lr 1e-12 on 64 images stays near chance (about 10-20% top-1 on 100 test images), so with
# --early-stop-min-delta 50 no evaluation after the first (which is a gain) counts as a gain.
FROZEN_VIT = ["--model", "vit_micro", "--train-subset", "64", "--eval-subset", "100", "--batch-size", "16",
              "--lr", "1e-12", "--tracker", "none", "--early-stop-patience", "2", "--early-stop-min-delta", "50"]


@pytest.mark.slow
def test_early_stopping_ends_both_ranks_within_an_epoch_after_patience_evaluations_with_the_usual_outputs(
        cifar_dir, cache_dir, tmp_path):
    # 2 ranks x 16 images: 2 optimizer steps per epoch; an evaluation at every step, patience 2: the third (step 3,
    # the middle of epoch 2; the first is a gain) ends the run there; each evaluation is followed by a checkpoint
    # (all kept here). The ViT mixes its images too (nothing learns at this lr, so the stop is the same): the ViT
    # script's mixing path runs.
    flags = [*FROZEN_VIT, "--early-stop-patience", "2", "--eval-every-steps", "1", "--epochs", "6", "--keep-last", "9",
             "--mixup", "0.2", "--cutmix", "1.0"]
    result = run_train(job_args(cifar_dir, cache_dir, tmp_path, *flags), launch=["--config_file", str(CPU_YAML)],
                       script=REPO / "train_vit.py")
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(tmp_path)
    assert 0 < s["best_eval_top1"] < 50
    assert (s["global_step"], s["epochs_completed"], s["stopped_early"], s["evals_without_gain"], s["world_size"]) == \
        (3, 1, True, 2, 2)
    line = (f"early stop at step 3 (in epoch 2): 2 evaluations in a row without a gain in top1 (best "
            f"{s['best_eval_top1']:.6g})")
    assert result.stdout.count(line) == 1
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "best.safetensors").is_file()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-00000001", "step-00000002", "step-00000003"]  # step 3 once: not again at the epoch's end
    assert s["best_checkpoint"] in saved


@pytest.mark.slow
def test_the_early_stopping_count_survives_a_resume(cifar_dir, cache_dir, tmp_path):
    # 2 epochs: the first evaluation (a gain), then one without a gain; resumed for 6 epochs, the third evaluation is
    # the second without a gain, so the run stops there (with the count lost it would run to epoch 4)
    args = job_args(cifar_dir, cache_dir, tmp_path, *FROZEN_VIT)
    first = run_train([*args, "--epochs", "2"], script=REPO / "train_vit.py")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (read_summary(tmp_path)["evals_without_gain"], read_summary(tmp_path)["stopped_early"]) == (1, False)
    again = run_train([*args, "--epochs", "6", "--resume", "auto"], script=REPO / "train_vit.py")
    assert again.returncode == 0, again.stderr[-3000:]
    s = read_summary(tmp_path)
    assert (s["epochs_completed"], s["stopped_early"], s["evals_without_gain"]) == (3, True, 2)
    assert "early stop at step 12 (after epoch 3)" in again.stdout
