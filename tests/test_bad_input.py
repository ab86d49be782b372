"""Bad input: one clear line on stderr, exit status 2, and nothing already on disk is touched."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import (
    CIFAR_CLASSES,
    CPU_YAML,
    NEEDS_TORCHCODEC,
    REPO,
    run_train,
    script_env,
    serving,
    small_tmpfs,
    write_cifar_dir,
    write_image_folder,
    write_parquet,
)
from PIL import Image


def _digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _fails_cleanly(tmp_path: Path, args: list[str], message: str, launch=None, env=None) -> str:
    """Runs train_cifar.py on an output dir holding an earlier run's files; checks exit 2 (or the launcher's
    non-zero status), exactly one `error:` line naming `message`, no Python traceback from our processes,
    and that the earlier run's files and the data files are byte-identical afterwards."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "summary.json").write_text('{"eval_top1": 93.1}')
    (out / "model.safetensors").write_bytes(b"weights of an earlier run")
    before = _digest(tmp_path)
    result = run_train(["--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--tracker", "none", *args],
                       launch=launch, env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == (2 if launch is None else 1), result.stderr[-3000:]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if "Traceback" in line and (launch is None or "[rank" in line)]
    assert not ours, result.stderr[-3000:]
    if launch is not None:  # the launcher's failure report names the line as its root cause, not "enable traceback"
        assert f"traceback : {errors[0]}" in result.stderr, result.stderr[-3000:]
    after = _digest(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("cache/")} == \
           {k: v for k, v in before.items() if not k.startswith("cache/")}
    return errors[0]


@pytest.fixture
def small_data(tmp_path) -> Path:
    return write_cifar_dir(tmp_path / "data", n_train=64, n_test=16)


def test_missing_data_dir(tmp_path):
    _fails_cleanly(tmp_path, ["--data-dir", str(tmp_path / "nope")], "does not exist")


def test_a_missing_data_dir_is_the_only_output_and_creates_no_output_folder(tmp_path):
    """A --data-dir that does not exist is checked when the flags are parsed: the one line is all the job prints (no
    config dump, no setup line, stdout empty), it says how to get the data, and no output folder is created."""
    out = tmp_path / "new-run"
    result = run_train(["--data-dir", str(tmp_path / "nope"), "--output-dir", str(out), "--tracker", "none"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: --data-dir {tmp_path / 'nope'} does not exist. --data-dir takes a folder of train-*.parquet / "
        f"test-*.parquet files (a Hub dataset's layout) or an image folder (train/<class>/*.png, test/<class>/... or "
        f"val/<class>/...; or <class>/*.png alone); leave it out to download uoft-cs/cifar10 from the Hub, or pass "
        f"--dataset OWNER/NAME."]
    assert not out.exists()


def test_a_data_dir_pointing_into_an_image_folder_stops_with_one_line_and_leaves_no_folder_anywhere(tmp_path):
    """--data-dir mine/train (the training split of an image folder, not the folder) into a new --output-dir
    runs/new: one line naming the folder to pass, exit 2; no output folder (nor runs/), and nothing new in the data
    folder (no cache folder). (Class folders in a folder of another name are a train split: test_data.py.)"""
    mine = tmp_path / "mine"
    for split in ("train", "test"):
        for c in ("cat", "dog"):
            (mine / split / c).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (12, 12), (40 * i, 0, 200)).save(mine / split / c / f"{i}.png")
    before = sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*"))
    out = tmp_path / "runs" / "new"
    result = run_train(["--data-dir", str(mine / "train"), "--output-dir", str(out), "--tracker", "none"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --data-dir {mine / 'train'} holds no train/ folder: it is named as a split of an image folder; pass "
        f"the folder that holds train/ and test/ (here {mine}), or give the class folders a folder of another name to "
        f"train on them alone.")
    assert not (tmp_path / "runs").exists()
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == before


def test_empty_data_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    _fails_cleanly(tmp_path, ["--data-dir", str(tmp_path / "empty")], "holds no train-*.parquet file")


def test_corrupt_parquet_file(tmp_path, small_data):
    train = small_data / "train-00000-of-00001.parquet"
    train.write_bytes(train.read_bytes()[: train.stat().st_size // 2])  # truncated download
    line = _fails_cleanly(tmp_path, ["--data-dir", str(small_data)], "is not a readable parquet file")
    assert train.name in line


def test_integer_labels_that_are_not_0_to_c_minus_1(tmp_path, small_data):
    """Without class names the labels must be 0..C-1: 0, 3 and 11 are three labels, so 3 and 11 name no class."""
    write_parquet(small_data / "train-00000-of-00001.parquet", 20, labels=[3] * 7 + [11] + [0] * 12, class_names=None)
    write_parquet(small_data / "test-00000-of-00001.parquet", 8, labels=[0] * 8, class_names=None)
    line = _fails_cleanly(tmp_path, ["--data-dir", str(small_data)], "has label 3 at row 0 (8 rows in all)")
    assert line.endswith("must hold the integers 0..C-1, and the training split has 3 distinct labels."), line


def test_train_and_test_splits_with_different_classes(tmp_path, small_data):
    write_parquet(small_data / "test-00000-of-00001.parquet", 8, class_names=("cat", "dog"))
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data)], "the test split names other classes than the train "
                   "split (airplane, automobile, bird, deer, frog, horse, ship, truck in one of them only): every "
                   "split must name the same classes.")


def test_a_label_column_that_is_neither_class_names_nor_integers(tmp_path, small_data):
    import datasets

    ds = datasets.Dataset.from_parquet(str(small_data / "test-00000-of-00001.parquet"))
    ds.cast_column("label", datasets.Value("string")).to_parquet(str(small_data / "test-00000-of-00001.parquet"))
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data)], "the test split's label column 'label' is Value(")


def test_an_image_folder_of_one_class_is_one_line_not_a_run_at_100_percent(tmp_path):
    """All the photos in one folder under train/ (and test/): one class, which would train to a loss of 0 and a
    top-1 of 100% that mean nothing, stops with one line."""
    folder = write_image_folder(tmp_path / "photos", ("photos",))
    _fails_cleanly(tmp_path, ["--data-dir", str(folder)], "error: load_data gives 1 class (photos); a classifier needs "
                   "at least 2 (an image folder: a folder of images per class, in train/ and test/).")


def test_images_of_different_sizes_without_image_size(tmp_path, small_data):
    write_parquet(small_data / "test-00000-of-00001.parquet", 8, size=(28, 28))
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data)], "the images do not share one square size (32x32 (the "
                   "train split's row 0), 28x28 (the test split's row 0)); pass --image-size S to resize every image "
                   "to S x S (photos of many sizes and shapes: --image-size S --augment resized-crop, the "
                   "natural-image recipe, crops each as it is decoded).")


@pytest.mark.parametrize(("flag", "value"), [("--lr", "0"), ("--batch-size", "0"), ("--epochs", "-1")])
def test_non_positive_lr_batch_epochs(tmp_path, small_data, flag, value):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), flag, value],
                   f"{flag} must be positive (got {float(value):g}")


@pytest.mark.parametrize(("flags", "message"), [
    (["--ema-decay", "1"], "--ema-decay must be between 0 and 1, e.g. 0.999 (got 1.0)."),
    (["--eval-every-steps", "0"], "--eval-every-steps must be positive (got 0)."),
    (["--layer-decay", "0"], "--layer-decay is a factor per layer, in (0, 1] (got 0)."),
    (["--layer-decay", "1.5"], "--layer-decay is a factor per layer, in (0, 1] (got 1.5)."),
    (["--drop-path", "1"], "--drop-path is a chance per block, in [0, 1) (got 1)."),
    (["--backbone-lr-factor", "-1"], "--backbone-lr-factor must not be negative (got -1)."),
    (["--backbone-lr-factor", "0", "--model", "resnet8"], "--backbone-lr-factor 0 trains a pretrained model's new "
                                                          "head alone; --model resnet8 holds no pretrained tensors."),
])
def test_a_decay_chance_or_interval_outside_its_range_is_one_line(tmp_path, small_data, flags, message):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), *flags], message)


def test_zero_decode_workers(tmp_path, small_data):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--decode-workers", "0"],
                   "--decode-workers must be positive (got 0).")


def test_a_decode_cache_that_does_not_fit_its_disk_stops_before_decoding_and_leaves_no_file(tmp_path, small_data):
    """80 images at 128 x 128 need 3.75 MiB; the cache folder is a 1 MiB filesystem; --decode cache asked for."""
    with small_tmpfs(tmp_path / "cache", "1m") as disk:  # the folder _fails_cleanly passes as --cache-dir
        _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--image-size", "128", "--decode", "cache"],
                       f"the decoded images need 3.8 MiB in {disk}, which has 1.0 MiB free (No space left on "
                       f"device); free some space, or pass --cache-dir on a larger disk (or a smaller --image-size).")
        assert list(disk.iterdir()) == []  # nor a temporary file


@pytest.mark.slow
def test_decode_auto_decodes_in_the_loader_workers_when_the_cache_would_not_fit_its_disk(tmp_path, small_data):
    """--decode auto with 80 images at 128 x 128 (3.75 MiB decoded) and a 1 MiB cache filesystem: the job says it
    decodes in the loader's workers and why, trains and evaluates every test image, and writes nothing there."""
    with small_tmpfs(tmp_path / "cache", "1m") as disk:
        result = run_train(["--data-dir", str(small_data), "--image-size", "128", "--cache-dir", str(disk),
                            "--output-dir", str(tmp_path / "out"), "--model", "resnet8", "--batch-size", "16",
                            "--epochs", "1", "--tracker", "none"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert (f"decoding each batch in the loader's workers (--decode auto: the decoded images take 3.8 MiB at 128 x "
                f"128 px, {disk} has 1.0 MiB free)") in result.stdout
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["dataset"]["decode"] == "workers" and summary["eval_examples"] == 16
        assert list(disk.iterdir()) == []


@pytest.mark.parametrize("size", ["4", "1025"])
def test_image_size_outside_8_to_1024(tmp_path, small_data, size):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--image-size", size],
                   f"--image-size must be between 8 and 1024 pixels (got {size}).")


@pytest.mark.parametrize(("extra", "message"), [
    (["--dataset", "uoft-cs/cifar100"], "pass either --data-dir ({data}) or --dataset (uoft-cs/cifar100), not both."),
    (["--val-fraction", "1.5"], "--val-fraction must be between 0 and 1 (got 1.5)."),
    (["--label-column", "species"], "the train split has no column 'species' (--label-column); its columns: "
                                    "['img', 'label']."),
    (["--decode", "cache", "--augment", "resized-crop"], "--augment resized-crop crops whole images as they are "
                                                         "decoded: it needs --decode workers (or auto), not --decode "
                                                         "cache."),
    (["--crop-scale", "0.5", "0.2"], "--crop-scale takes two shares of the area, 0 < MIN <= MAX <= 1 (got (0.5, "
                                     "0.2))."),
    (["--random-erase", "1.5"], "--random-erase is a chance per image, at most 1 (got 1.5)."),
    (["--random-erase", "-0.1"], "--random-erase must not be negative (got -0.1)."),
    (["--random-erase", "0.25", "--augment", "none"], "--random-erase erases augmented images: it needs --augment "
                                                       "standard or resized-crop."),
    (["--auto-augment", "ta_wide", "--augment", "none"], "--auto-augment augments the training crops: it needs "
                                                          "--augment standard or resized-crop."),
    (["--auto-augment", "ra", "--ra-magnitude", "31"], "--ra-magnitude is a bin of RandAugment's 31, 0-30 (got 31)."),
    (["--auto-augment", "augmix", "--augmix-severity", "0"], "--augmix-severity is 1-10, AugMix's (got 0)."),
    (["--ra-ops", "0"], "--ra-ops must be positive (got 0)."),
    (["--decode", "stream", "--val-fraction", "0.2"], "--decode stream evaluates on the source's own test or "
                                                      "validation shards; --val-fraction holds rows out of a table, "
                                                      "not of a stream."),
    (["--data-dir", "s3://bucket/shards", "--decode", "cache"], "--data-dir s3://bucket/shards is a URL: its shards "
                                                                "are streamed (--decode stream or auto), not read "
                                                                "through --decode cache."),
    (["--data-dir", "s3://bucket/shards", "--decode", "gpu"], "--data-dir s3://bucket/shards is a URL: its shards "
                                                              "are streamed (--decode stream or auto), not read "
                                                              "through --decode gpu."),
])
def test_contradicting_or_missing_data_flags(tmp_path, small_data, extra, message):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), *extra], message.format(data=small_data))


@NEEDS_TORCHCODEC
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the CUDA device --decode gpu needs")
def test_decode_gpu_without_a_cuda_device_is_one_line(tmp_path, small_data):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--decode", "gpu"],
                   "--decode gpu decodes JPEGs on the GPU (nvJPEG), and this process has no CUDA device; use --decode "
                   "workers (or auto) to decode in the loader's workers.")


def test_decode_gpu_without_an_importable_torchcodec_is_one_line(tmp_path, small_data):
    """A TorchCodec that does not import (here a package that raises as one built for another torch does)."""
    shadow = tmp_path / "shadow" / "torchcodec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise OSError('libtorchcodec_core.so: undefined symbol')\n")
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--decode", "gpu"],
                   "--decode gpu decodes through TorchCodec, which does not import here (OSError: "
                   "libtorchcodec_core.so: undefined symbol); pip install torchcodec (a release built for this torch), "
                   "or use --decode workers.", env=script_env(PYTHONPATH=f"{shadow.parent}:{REPO}"))


def test_eval_subset_larger_than_the_split(tmp_path, small_data):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--eval-subset", "17"],
                   "--eval-subset 17 is larger than the split (16 images)")


def test_output_dir_that_cannot_be_written(tmp_path, small_data):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # root may write anywhere, but not below a regular file
    result = run_train(["--data-dir", str(small_data), "--output-dir", str(blocker / "run"), "--tracker", "none"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --output-dir {blocker / 'run'} cannot be written")
    assert blocker.read_text() == "not a folder"


@pytest.mark.slow
def test_bad_labels_under_two_ranks_stop_both_with_one_line(tmp_path, small_data):
    write_parquet(small_data / "train-00000-of-00001.parquet", 20, labels=[-1] * 20)  # -1: the Hub's "no label"
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data)], "has label -1 at row 0 (20 rows in all); labels must "
                   "be 0-9.", launch=["--config_file", str(CPU_YAML)])


@pytest.mark.slow
def test_a_user_error_on_every_rank_is_printed_even_when_rank_0_reaches_it_last(tmp_path):
    """torchrun stops the other ranks when one exits: a rank other than 0 exiting first used to take rank 0 (the
    one that prints) down before its line was out (seen in CI on a loaded machine: the FSDP-version-1 test)."""
    script = tmp_path / "fails.py"
    script.write_text(f"""import os, sys, time
sys.path.insert(0, {str(REPO)!r})
from utils import UserError
from utils.launch import run
def job():
    if os.environ["RANK"] == "0":
        time.sleep(2)  # rank 0 is the slower one to reach the error
    raise UserError("the same bad input on every rank")
sys.exit(run(job))
""")
    result = run_train([], launch=["--config_file", str(CPU_YAML)], script=script)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and errors == ["error: the same bad input on every rank"], result.stderr[-3000:]


def test_no_data_dir_and_no_hub_access_names_both_options(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what a machine without internet amounts to, without the retries
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # and nothing downloaded before
    line = _fails_cleanly(tmp_path, [], "could not download uoft-cs/cifar10 from the Hugging Face Hub")
    assert "--data-dir" in line and "internet" in line


def test_datasets_cache_on_a_full_disk_says_so_and_where(tmp_path):
    data = write_cifar_dir(tmp_path / "data", n_train=600, n_test=16)  # a 1.3 MiB train file for a 1 MiB cache disk
    with small_tmpfs(tmp_path / "cache" / "hf", "1m") as disk:  # cache/ is left out of the before-after digest
        line = _fails_cleanly(tmp_path, ["--data-dir", str(data)], "no space left on device",
                              env=script_env(HF_DATASETS_CACHE=str(disk / "datasets")))
    assert f"its cache {disk / 'datasets'} (" in line and "HF_DATASETS_CACHE" in line, line


def test_image_folder_whose_image_cannot_be_decoded_names_the_file(tmp_path):
    from conftest import CIFAR_CLASSES as CLASSES

    write_image_folder(tmp_path / "folder", CLASSES)
    broken = tmp_path / "folder" / "test" / "cat" / "1.jpg"
    broken.write_bytes(b"\xff\xd8 half a jpeg")
    line = _fails_cleanly(tmp_path, ["--data-dir", str(tmp_path / "folder")], f"undecodable image at {broken} (")
    assert line.startswith("error: the test split has"), line


def test_sync_bn_on_cpu_stops_with_a_clear_message(tmp_path, small_data):
    _fails_cleanly(tmp_path, ["--data-dir", str(small_data), "--sync-bn"], "--sync-bn needs CUDA GPUs")


# --decode stream: shards ------------------------------------------------------------------------------------------
STREAM = ["--decode", "stream", "--image-size", "48", "--model", "resnet8", "--batch-size", "16", "--epochs", "1"]


def _shards(tmp_path: Path, stream_shards: dict, kind: str) -> Path:
    data = tmp_path / "data"
    shutil.copytree(stream_shards[kind], data)
    return data


@pytest.mark.parametrize("kind", ["parquet", "tar"])
def test_an_unreadable_shard_stops_with_one_line_naming_it(tmp_path, stream_shards, kind):
    data = _shards(tmp_path, stream_shards, kind)
    victim = data / f"train-00002-of-00005.{kind}"
    victim.write_bytes(b"not a shard " * 100)
    _fails_cleanly(tmp_path, ["--data-dir", str(data), *STREAM], f"{victim} is not a readable {kind} shard (")


@pytest.mark.slow
def test_an_unreadable_shard_met_by_the_second_rank_stops_both_ranks_with_one_line(tmp_path, stream_shards):
    data = _shards(tmp_path, stream_shards, "tar")
    victim = data / "train-00003-of-00005.tar"  # shard 3 of 5: indexed by rank 1 of 2
    victim.write_bytes(b"not a shard " * 100)
    _fails_cleanly(tmp_path, ["--data-dir", str(data), *STREAM], f"{victim} is not a readable tar shard (",
                   launch=["--config_file", str(CPU_YAML)])


def test_a_shard_whose_class_names_lack_a_class_stops_with_one_line_naming_it(tmp_path, stream_shards):
    import datasets

    data = _shards(tmp_path, stream_shards, "parquet")
    victim = data / "train-00003-of-00005.parquet"
    ds = datasets.load_dataset("parquet", data_files=str(victim), split="train")
    ds = ds.filter(lambda label: label != 9, input_columns="label")
    ds.cast_column("label", datasets.ClassLabel(names=list(CIFAR_CLASSES[:9]))).to_parquet(str(victim))
    _fails_cleanly(tmp_path, ["--data-dir", str(data), *STREAM],
                   f"{victim} names other classes than {data / 'train-00000-of-00005.parquet'} (truck in one of them "
                   f"only): every shard must name the same classes.")


def test_a_tar_sample_without_its_label_stops_with_one_line_naming_the_shard(tmp_path, stream_shards):
    data = _shards(tmp_path, stream_shards, "tar")
    victim = data / "test-00001-of-00003.tar"
    with tarfile.open(victim) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.name != "test00000.cls"]
    with tarfile.open(victim, "w") as tar:
        for m, blob in members:
            tar.addfile(m, io.BytesIO(blob))
    _fails_cleanly(tmp_path, ["--data-dir", str(data), *STREAM],
                   f"{victim}: the sample test00000 has an image but no .cls label.")


@pytest.mark.slow
def test_a_corrupt_jpeg_in_a_streamed_shard_stops_with_one_line_naming_the_shard_and_row(tmp_path, stream_shards):
    data = _shards(tmp_path, stream_shards, "tar")
    victim = data / "test-00002-of-00003.tar"
    with tarfile.open(victim) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(victim, "w") as tar:
        for m, blob in members:
            blob = blob[:400] if m.name == "test00005.jpg" else blob  # the header reads, the pixels do not
            m.size = len(blob)
            tar.addfile(m, io.BytesIO(blob))
    _fails_cleanly(tmp_path, ["--data-dir", str(data), *STREAM, "--data-workers", "1"],
                   f"the test split has an undecodable image at {victim} row 5 (")


@pytest.mark.slow
def test_a_shard_the_server_keeps_refusing_stops_with_one_line_naming_it_after_its_retries(tmp_path, stream_shards):
    """Tar shards over HTTP whose server answers every request for one shard with 503: the run stops with one line
    naming that shard, the server's answer and the 6 tries it was given (each try a HEAD, as fsspec opens a file)."""
    data = _shards(tmp_path, stream_shards, "tar")
    with serving(data, broken=("train-00002-of-00005.tar",)) as (url, state):
        shard = f"{url}train-00002-of-00005.tar"
        _fails_cleanly(tmp_path, ["--data-dir", url, *STREAM], f"{shard} is not a readable tar shard ("
                       f"ClientResponseError: 503, message='Service Unavailable', url='{shard}', 6 tries).")
        assert state["log"].count(("HEAD", "/train-00002-of-00005.tar")) == 6


def test_a_best_metric_the_run_does_not_evaluate_stops_before_training_naming_the_ones_it_does(tmp_path, small_data):
    flags = ["--data-dir", str(small_data), "--model", "resnet8", "--batch-size", "16", "--best-metric", "f1"]
    _fails_cleanly(tmp_path, flags, "--best-metric f1: not a metric this run evaluates (loss, top1, top5).")
