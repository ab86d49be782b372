"""predict.py: new images through a finished run. The run: resnet8 trained on jpeg_folder (CIFAR-10 images upscaled
to 96-128 px JPEGs of several sizes and aspect ratios, 192 training and 48 test images) with the natural-image recipe
at 48 px (--augment resized-crop: its evaluation view resizes and centre-crops), so every image is resized as a
camera photo would be; with --full-decode, so that torchvision's transforms on the full-size image are the reference
(a view decoded at a reduced scale is bounded against the full one in tests/test_camera.py). Jobs run in real
processes, 2 gloo ranks under cpu.yaml where it says so."""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import CPU_YAML, REPO, kill_job, read_summary, run_python, run_train, script_env, start
from PIL import Image
from safetensors.torch import load_file
from test_templates import SMALL_NET, edited_copy

from utils.models import named_model

PREDICT = REPO / "predict.py"
TWO_RANKS = ["--config_file", str(CPU_YAML), "--main_process_port", "0"]
JOB = ["--model", "resnet8", "--image-size", "48", "--augment", "resized-crop", "--decode", "workers", "--full-decode",
       "--epochs", "3", "--batch-size", "16", "--lr", "0.05", "--deterministic", "--tracker", "none"]


@pytest.fixture(scope="module")
def trained(jpeg_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("predict") / "run"
    result = run_train(["--data-dir", str(jpeg_folder), "--output-dir", str(out), *JOB])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def predict(*args, launch: list[str] | None = None):
    argv = [str(PREDICT), *map(str, args)]
    if launch is not None:
        argv = ["-m", "accelerate.commands.launch", *launch, *argv]
    return run_python(argv, script_env(), timeout=600)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f)) if path.suffix == ".csv" else [json.loads(line) for line in f]


def torchvision_probabilities(run: Path, files: list[Path]) -> torch.Tensor:
    """The softmax of the run's exported weights on each file, prepared by torchvision's own transforms from the
    run's preprocessor_config.json (shorter side resized with its filter, centre crop, mean and std): a reference
    computed without predict.py or utils/data."""
    from torchvision.transforms import v2

    pre = json.loads((run / "preprocessor_config.json").read_text())
    resample = {2: v2.InterpolationMode.BILINEAR, 3: v2.InterpolationMode.BICUBIC}[pre["resample"]]
    transform = v2.Compose([v2.Resize(pre["size"]["shortest_edge"], interpolation=resample, antialias=True),
                            v2.CenterCrop(pre["crop_size"]["height"]), v2.PILToTensor(),  # on the PIL image
                            v2.ToDtype(torch.float32, scale=True), v2.Normalize(pre["image_mean"], pre["image_std"])])
    model = named_model("resnet8", len(pre["classes"]))
    model.load_state_dict(load_file(run / "model.safetensors"))
    model.eval()
    batch = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    with torch.no_grad():
        return model(batch).softmax(dim=1)


@pytest.mark.slow
def test_two_ranks_predict_each_image_once_in_order_as_torchvision_would_and_the_folder_top1_is_the_runs(
        trained, jpeg_folder, tmp_path):
    """On 2 ranks, the 48 test JPEGs (a class folder tree) give one row each, in sorted path order, written once;
    each row's label is its folder, its 3 classes and probabilities those of torchvision's transforms and the
    exported weights (to 1e-5); the top-1 against the folder names, printed and recomputed here from the rows, is the
    run's reported top-1; 1 process writes the same predictions."""
    out = tmp_path / "two.csv"
    result = predict(trained, jpeg_folder / "test", "--output", out, "--top-k", "3", launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted((jpeg_folder / "test").rglob("*.jpg"))
    rows = read_rows(out)
    assert [r["path"] for r in rows] == [f.relative_to(jpeg_folder / "test").as_posix() for f in files]
    assert not list(tmp_path.glob("*.partial*"))
    classes = read_summary(trained)["classes"]
    reference = torchvision_probabilities(trained, files)
    top = reference.topk(3, dim=1)
    for r, values, picks in zip(rows, top.values.tolist(), top.indices.tolist()):
        assert [r["prediction"], r["prediction_2"], r["prediction_3"]] == [classes[c] for c in picks]
        got = [float(r["probability"]), float(r["probability_2"]), float(r["probability_3"])]
        assert got == pytest.approx(values, abs=1e-5) and r["error"] == ""
    assert [r["label"] for r in rows] == [f.parent.name for f in files]
    top1 = 100.0 * sum(r["prediction"] == Path(r["path"]).parent.name for r in rows) / len(rows)
    assert top1 == read_summary(trained)["eval_top1"]
    assert f"wrote 48 predictions to {out}; top-1 against the folder names: {top1:.2f}% of 48 images" in result.stdout
    one = tmp_path / "one.csv"
    result = predict(trained, jpeg_folder / "test", "--output", one, "--top-k", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["path"], r["prediction"], r["prediction_2"]) for r in read_rows(one)] == \
        [(r["path"], r["prediction"], r["prediction_2"]) for r in rows]


@pytest.mark.slow
def test_one_image_without_output_prints_its_top_classes_as_csv_and_writes_no_file(trained, jpeg_folder, tmp_path):
    """IMAGES one JPEG (not a folder, not a list) and no --output: the header and the image's one row are printed
    as CSV, its 2 classes and probabilities those of torchvision's transforms and the exported weights (to 1e-5); the
    last line, on stderr, counts 1 image; no file is written beside it."""
    image = shutil.copy(sorted((jpeg_folder / "test").rglob("*.jpg"))[5], tmp_path / "photo.jpg")
    result = predict(trained, image, "--top-k", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert len(rows) == 1 and rows[0]["path"] == str(image) and rows[0]["error"] == ""
    classes = read_summary(trained)["classes"]
    top = torchvision_probabilities(trained, [Path(image)]).topk(2, dim=1)
    assert [rows[0]["prediction"], rows[0]["prediction_2"]] == [classes[c] for c in top.indices[0].tolist()]
    got = [float(rows[0]["probability"]), float(rows[0]["probability_2"])]
    assert got == pytest.approx(top.values[0].tolist(), abs=1e-5)
    assert result.stderr.strip().splitlines()[-1] == "predicted 1 image"
    assert [p.name for p in tmp_path.iterdir()] == ["photo.jpg"]


@pytest.mark.slow
def test_a_folder_labelled_by_a_metadata_file_gets_its_top1_against_the_listed_classes(trained, jpeg_folder, tmp_path):
    """The 48 test JPEGs renamed IMG_0000.jpg ... in one flat folder, in shuffled order, with a metadata.csv naming
    each one's class (as training reads such a folder), and beside them 2 more: one the file does not name, one it
    labels with a class the run lacks. The printed top-1 is the run's reported top-1 (the same images, classes and
    view) and equals the rows' against the listed classes; the 2 are predicted but left out of it and counted; the
    warning of the unnamed image goes to stderr, so stdout holds only CSV. Each row's label is the one listed ("" for
    the unnamed image)."""
    photos = tmp_path / "photos"
    photos.mkdir()
    files = sorted((jpeg_folder / "test").rglob("*.jpg"))
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()
    listed = {f"IMG_{k:04d}.jpg": files[i].parent.name for k, i in enumerate(order)}
    for k, i in enumerate(order):
        shutil.copy(files[i], photos / f"IMG_{k:04d}.jpg")
    shutil.copy(files[0], photos / "unnamed.jpg")
    shutil.copy(files[1], photos / "zebra.jpg")
    lines = ["file_name,label", *(f"{name},{label}" for name, label in listed.items()), "zebra.jpg,zebra"]
    (photos / "metadata.csv").write_text("\n".join(lines) + "\n")
    result = predict(trained, photos)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert len(rows) == 50 and {r["path"] for r in rows} == {*listed, "unnamed.jpg", "zebra.jpg"}
    top1 = 100.0 * sum(r["prediction"] == listed[r["path"]] for r in rows if r["path"] in listed) / len(listed)
    assert top1 == read_summary(trained)["eval_top1"]
    assert result.stderr.strip().splitlines()[-1] == (
        f"predicted 50 images; top-1 against metadata.csv: {top1:.2f}% of 48 images (2 left out: not named in "
        f"metadata.csv, or labelled with no class of the run)")
    assert "1 image in" in result.stderr and "is not named in metadata.csv" in result.stderr
    assert [r["label"] for r in rows] == [listed.get(r["path"], "zebra" * (r["path"] == "zebra.jpg")) for r in rows]


@pytest.mark.slow
def test_a_top1_on_the_runs_own_training_images_says_it_is_no_held_out_score(trained, jpeg_folder, tmp_path):
    """The run trained on jpeg_folder's train/ and evaluated on its test/: predicting train/ (192 JPEGs), or the whole
    data folder, ends the last line saying the top-1 is not a held-out score, naming the run's --data-dir; test/ and
    a copy of test/ elsewhere do not."""
    said = "; not a held-out score: the run trained on its --data-dir"
    for images, n in ((jpeg_folder / "train", 192), (jpeg_folder, 240)):
        result = predict(trained, images)
        assert result.returncode == 0, result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"predicted {n} images; top-1 against the folder names: ")
        assert last.endswith(f"{said} {jpeg_folder}, and these images are in it"), last
    for images in (jpeg_folder / "test", shutil.copytree(jpeg_folder / "test", tmp_path / "test")):
        result = predict(trained, images)
        assert result.returncode == 0 and said not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_a_prediction_job_killed_midway_and_started_again_ends_with_the_uninterrupted_file(trained, jpeg_folder,
                                                                                           tmp_path):
    """2 ranks, micro-batch 2, the 240 JPEGs of both splits listed in a text file (paths relative to its folder),
    JSON Lines, top 2: a job killed
    with kill -9 after some global batches were written, then started again with the same command, continues (it
    says from where) and ends with the uninterrupted job's file, byte for byte."""
    files = sorted(jpeg_folder.rglob("*.jpg"))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{os.path.relpath(f, tmp_path)}\n" for f in files))  # relative to the list's folder
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    flags = ["--top-k", "2", "--batch-size", "2", "--workers", "1"]
    result = predict(trained, listing, "--output", whole, *flags, launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-3000:]
    proc = start([str(trained), str(listing), "--output", str(cut), *flags], TWO_RANKS, script=PREDICT)
    record = tmp_path / "cut.jsonl.partial.json"
    deadline = time.time() + 300
    while not (record.exists() and len(json.loads(record.read_text() or "{}").get("ends", [])) > 10):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.01)
    kill_job(proc)
    done = json.loads(record.read_text())["ends"][-1][0]
    assert 0 < done < len(files) and not cut.exists()
    result = predict(trained, listing, "--output", cut, *flags, launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "continuing" in result.stdout and f"of {len(files)} images done" in result.stdout
    assert cut.read_bytes() == whole.read_bytes() and len(read_rows(cut)) == len(files)


@pytest.mark.slow
def test_an_unreadable_image_gets_a_row_saying_why_and_the_job_goes_on(trained, jpeg_folder, tmp_path):
    """Among the test JPEGs: a file of text named .jpg, an empty .png and a JPEG cut in half. Each gets a row with
    its error and no prediction; the others are predicted as without them; the last line counts the 3."""
    photos = tmp_path / "photos"
    shutil.copytree(jpeg_folder / "test", photos)
    (photos / "cat" / "text.jpg").write_text("not an image")
    (photos / "dog" / "empty.png").write_bytes(b"")
    whole = sorted(photos.rglob("*.jpg"))[0].read_bytes()
    (photos / "frog" / "half.jpg").write_bytes(whole[:len(whole) // 2])
    out = tmp_path / "p.csv"
    result = predict(trained, photos, "--output", out)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["path"]: r for r in read_rows(out)}
    assert len(rows) == 51
    for name, why in (("cat/text.jpg", "UnidentifiedImageError"), ("dog/empty.png", "UnidentifiedImageError"),
                      ("frog/half.jpg", "OSError")):
        assert rows[name]["error"].startswith(why) and rows[name]["prediction"] == "", rows[name]
    assert sum(1 for r in rows.values() if r["error"]) == 3
    assert "; 3 images could not be read (their error column)" in result.stdout


def _damaged(run: Path, copy: Path) -> Path:
    """A copy of a run folder (weights, summary.json) whose summary.json is cut short."""
    copy.mkdir(parents=True)
    for name in ("model.safetensors", "preprocessor_config.json"):
        shutil.copy(run / name, copy / name)
    (copy / "summary.json").write_text('{"eval_top1": ')
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(("args", "line"), [
    (lambda run, photos, tmp: [tmp / "empty", photos], "holds no model.safetensors (is it a finished run's folder?)"),
    (lambda run, photos, tmp: [run, tmp / "empty"], "holds no image files"),
    (lambda run, photos, tmp: [run, tmp / "nowhere"], "no such folder or file of image paths."),
    (lambda run, photos, tmp: [run, photos, "--weights", "ema"], "holds no model_ema.safetensors (a run without "
                                                                 "--ema-decay has none)."),
    (lambda run, photos, tmp: [run, photos, "--top-k", "11"], "--top-k 11: the run has 10 classes."),
    (lambda run, photos, tmp: [_damaged(run, tmp / "empty" / "run"), photos], "run/summary.json does not read "
     "(JSONDecodeError: Expecting value: line 1 column 15 (char 14)); restore it, or run the training command again "
     "with --resume auto, which writes a finished run's outputs anew from its last checkpoint."),
])
def test_bad_input_to_predict_is_one_line_and_writes_nothing(trained, jpeg_folder, tmp_path, args, line):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "p.csv"
    result = predict(*args(trained, jpeg_folder / "test", tmp_path), "--output", out)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and line in lines[-1], lines[-3:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


@pytest.mark.slow
def test_a_copys_own_build_model_predicts_through_its_script(jpeg_folder, tmp_path):
    """A copy of train_cifar.py whose build_model builds its own small network, trained on the JPEGs: predict.py
    rebuilds the network through the copy and its top-1 against the folder names is the run's."""
    script = edited_copy(tmp_path, "build_model", SMALL_NET)
    out = tmp_path / "run"
    result = run_train(["--data-dir", str(jpeg_folder), "--output-dir", str(out), *JOB], script=script,
                       env=script_env(PYTHONPATH=str(REPO)))  # the copy lives outside the checkout
    assert result.returncode == 0, result.stderr[-3000:]
    result = predict(out, jpeg_folder / "test", "--output", tmp_path / "p.csv")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "p.csv")
    top1 = 100.0 * sum(r["prediction"] == Path(r["path"]).parent.name for r in rows) / len(rows)
    assert top1 == read_summary(out)["eval_top1"] and len(rows) == 48


def test_the_folder_top1_reads_each_images_class_as_training_does_and_counts_in_the_singular(tmp_path):
    """The last line's top-1 against the folder names takes each image's top folder, as training reads an image
    folder (cat/2024/a.jpg is a cat: 2 of 3 right, the unreadable one left out), else, where the top folders are not
    the run's classes (photos/cat/a.jpg), the folder each image is in; one unreadable image is said in the singular.
    Images in folders that name no class of the run (unsorted/, or IMAGES itself) are left out of it and counted, their
    folders named (1 of 2 right: 50%, not 25% of 4)."""
    import predict

    classes = ["cat", "dog"]
    for names, predictions, errors, want in (
            (["cat/2024/a.jpg", "cat/b.jpg", "dog/2023/c.jpg", "dog/d.jpg"], ["cat", "dog", "dog", ""],
             ["", "", "", "OSError: truncated"], "66.67% of 3 images"),
            (["photos/cat/a.jpg", "photos/dog/b.jpg"], ["cat", "cat"], ["", ""], "50.00% of 2 images"),
            (["cat/a.jpg", "dog/b.jpg", "unsorted/c.jpg", "d.jpg"], ["cat", "cat", "dog", "dog"], [""] * 4,
             "50.00% of 2 images (2 in ./, unsorted/ left out: not a class of the run)")):
        rows = [{"path": n, "prediction": p, "probability": "0.5", "error": e}
                for n, p, e in zip(names, predictions, errors)]
        out = Path("p.csv")
        line = predict.report(rows, out, classes, *predict.known_labels(str(tmp_path), names, classes))["line"]
        unreadable = "; 1 image could not be read (their error column)" if any(errors) else ""
        assert line == f"wrote {len(names)} predictions to {out}{unreadable}; top-1 against the folder names: {want}"
