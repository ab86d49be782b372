"""Images decoded on the fly (--decode workers) and the natural-image crop recipe (--augment resized-crop), on
CIFAR-10 images upscaled to 96-128 px JPEGs (tests/conftest.py's write_upscaled_cifar): real jobs through
train_cifar.py, 2 gloo ranks under cpu.yaml, fp32 with --deterministic, so "the same" means bitwise."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from conftest import (
    CPU_YAML,
    PROBE,
    REPO,
    assert_same_parameters,
    evaluate_weights,
    kill_job,
    read_summary,
    run_python,
    run_train,
    script_env,
    start,
    wait_for_checkpoint,
)
from PIL import Image

from utils.data.pixels import CropRecipe, eval_view, resized_crop_draws

TWO_RANKS = ["--config_file", str(CPU_YAML), "--main_process_port", "0"]
ONE_PROCESS = ["--num_processes", "1", "--cpu", "--main_process_port", "0"]
# 192 training images, global batch 32 -> 6 optimizer steps per epoch, 2 epochs; 48 px crops; TrivialAugment (in the
# loader's workers), mixing and random erasing on top of the crops; layer-wise lr decay and drop path; a checkpoint
# every 4 steps (steps 4 and 8 are mid-epoch).
JOB = ["--model", "resnet8", "--image-size", "48", "--augment", "resized-crop", "--mixup", "0.2", "--cutmix", "1.0",
       "--random-erase", "0.25", "--auto-augment", "ta_wide", "--layer-decay", "0.8", "--drop-path", "0.2",
       "--batch-size", "16", "--global-batch-size", "32",
       "--epochs", "2", "--checkpoint-every-steps", "4", "--lr", "0.01", "--grad-clip", "0", "--no-channels-last",
       "--deterministic", "--tracker", "none"]


def args(data, out, *extra) -> list[str]:
    return ["--data-dir", str(data), "--output-dir", str(out), *JOB, *extra]


@pytest.fixture(scope="module")
def two_rank_run(jpeg_parquet, tmp_path_factory):
    """The job on 2 ranks, each with 2 loader workers, over 3 parquet shards, uninterrupted."""
    out = tmp_path_factory.mktemp("onthefly") / "two"
    result = run_train(args(jpeg_parquet, out, "--data-workers", "2"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "decoding each batch in the loader's workers (--decode auto: --augment resized-crop" in result.stdout
    return out


def test_resized_crops_decoded_in_workers_train_the_same_weights_on_two_ranks_as_on_one_process(two_rank_run,
                                                                                                jpeg_parquet, tmp_path):
    """With --augment resized-crop and the images decoded in the loader's workers, 2 ranks x 2 workers and 1 process
    x 1 worker (2 accumulation steps, the same global batch) end with bitwise-equal trainable parameters, each having
    evaluated the 48 test images' centre crops once (fp32, `--deterministic`)."""
    out = tmp_path / "one"
    result = run_train(args(jpeg_parquet, out, "--data-workers", "1"), launch=ONE_PROCESS)
    assert result.returncode == 0, result.stderr[-4000:]
    one, two = read_summary(out), read_summary(two_rank_run)
    assert (one["world_size"], one["grad_accum"], two["world_size"], two["grad_accum"]) == (1, 2, 2, 1)
    assert one["global_step"] == two["global_step"] == 12 and one["train_images_seen"] == 12 * 32
    assert one["dataset"]["decode"] == "workers" and one["eval_examples"] == two["eval_examples"] == 48
    assert_same_parameters(out, two_rank_run)


def test_kill_9_mid_epoch_with_images_decoded_in_workers_then_resume_matches_the_uninterrupted_run(two_rank_run,
                                                                                                  jpeg_parquet,
                                                                                                  tmp_path):
    """A 2-rank job decoding resized crops in its loader workers, killed with kill -9 after a mid-epoch checkpoint and
    resumed with --resume auto, ends with the uninterrupted run's trainable parameters bitwise (fp32,
    `--deterministic`)."""
    out = tmp_path / "killed"
    proc = start(args(jpeg_parquet, out, "--data-workers", "2"), TWO_RANKS)
    wait_for_checkpoint(out, proc, 4)
    kill_job(proc)
    assert not (out / "summary.json").exists()
    result = run_train(args(jpeg_parquet, out, "--data-workers", "2", "--resume", "auto"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert int(s["resumed_from"].rsplit("step-", 1)[1]) in (4, 8)  # mid-epoch: 6 steps per epoch
    assert s["global_step"] == 12
    assert_same_parameters(out, two_rank_run)


def test_a_hung_loader_worker_stops_the_job_in_one_line_naming_its_rank_and_resuming_is_exact(two_rank_run,
                                                                                               jpeg_parquet, tmp_path):
    """A loader worker of rank 1 that never returns the batch of optimizer step 10 (epoch 2, after the step-8
    checkpoint), with --dist-timeout 40: the job ends, non-zero, with one error line naming rank 1, the 20 s it waited
    (half --dist-timeout) and its loader's workers, after the hung worker's stacks (once, at 10 s) where it waits;
    step 8 is the newest complete checkpoint, and --resume auto ends with the uninterrupted run's trainable
    parameters bitwise."""
    from utils import checkpoint as ckpt
    from utils.data.draws import key_stream

    order = torch.randperm(192, generator=torch.Generator().manual_seed(int(key_stream(0, 1, 0)[0])))
    sample = int(order[3 * 32 + 16])  # step 10: epoch 2's 4th global batch; its second micro-batch is rank 1's
    out = tmp_path / "hung"
    result = run_train(args(jpeg_parquet, out, "--data-workers", "2", "--dist-timeout", "40"), launch=TWO_RANKS,
                       script=PROBE, env=script_env(PROBE_HANG_SAMPLE=f"1:{sample}"), timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1 waited 20 s (half --dist-timeout) for a batch from its loader's worker processes, "
                      "which hang (a read or a decode that does not return; the worker's stacks are above); this "
                      "process (rank 1) stopped. Continue with --resume auto: it takes the newest complete checkpoint "
                      "(one being written is never used)."], result.stderr[-3000:]
    # faulthandler's dump of the hung worker's threads, once, at 10 s: one of them sleeps in the probe's read
    stacks = result.stderr.split("Timeout (0:00:10)!\n")
    assert len(stacks) == 2 and stacks[1].index(errors[0]) > 0, result.stderr[-3000:]
    threads = [[line.rsplit(" in ", 1)[-1] for line in block.splitlines() if line.startswith("  File")]
               for block in stacks[1].split("\n\n")]
    assert ["hanging_read", "batch", "__getitems__"] in [frames[:3] for frames in threads], stacks[1][:3000]
    complete = [p.name for p in (out / "checkpoints").glob("step-*") if ckpt.problem(p) is None]
    assert max(complete) == "step-00000008" and not (out / "summary.json").exists()
    result = run_train(args(jpeg_parquet, out, "--data-workers", "2", "--resume", "auto"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_summary(out)["resumed_from"].endswith("step-00000008")
    assert_same_parameters(out, two_rank_run)


@pytest.mark.slow
def test_the_small_image_recipe_decoded_in_workers_trains_exactly_as_from_the_decoded_cache(jpeg_folder, tmp_path):
    """--augment standard with --decode workers (each image resized as the cache resizes it, cropped and flipped on
    the device) ends with the trainable parameters and evaluation of --decode cache, bitwise (1 process, fp32,
    `--deterministic`, the JPEG image folder at 48 px)."""
    runs = {}
    for decode in ("cache", "workers"):
        out = tmp_path / decode
        result = run_train(["--data-dir", str(jpeg_folder), "--output-dir", str(out), "--cache-dir",
                            str(tmp_path / "cache"), *JOB, "--augment", "standard", "--decode", decode, "--epochs",
                            "1"], launch=ONE_PROCESS)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[decode] = read_summary(out)
    assert runs["cache"]["dataset"].get("decode") is None and runs["workers"]["dataset"]["decode"] == "workers"
    assert runs["cache"]["eval_loss"] == runs["workers"]["eval_loss"]
    assert_same_parameters(tmp_path / "cache", tmp_path / "workers")


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "test"])
def test_a_corrupt_jpeg_stops_the_job_with_one_line_naming_the_file(jpeg_folder, tmp_path, split):
    """A JPEG whose pixels cannot be decoded (truncated after its header), met at the start while the mean and std
    are estimated (train) or by a loader worker of one rank at the first evaluation, after step 6 (test): exit status
    2, one `error:` line naming the file, no traceback, no summary and no checkpoint after the error (test: the one
    of step 4 only)."""
    data = tmp_path / "data"
    shutil.copytree(jpeg_folder, data)
    victim = sorted((data / split / "cat").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:400])
    out = tmp_path / "out"
    result = run_train(args(data, out, "--data-workers", "1"), launch=TWO_RANKS)
    assert result.returncode == 2 or "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(victim) in lines[0] and "undecodable image" in lines[0], result.stderr[-3000:]
    assert not [line for line in result.stderr.splitlines() if "[rank" in line and "Traceback" in line]  # no rank's
    written = sorted(p.name for p in out.glob("checkpoints/step-*"))
    assert not (out / "summary.json").exists() and written == ([] if split == "train" else ["step-00000004"])


def test_resized_crop_draws_follow_torchvisions_random_resized_crop_distribution():
    """Over 4,000 samples of a 128 x 96 image, the keyed crops' mean area share, mean log aspect ratio, mean centre
    and flip rate are within 0.02 (0.03 for the centre, as a share of the image) of torchvision's RandomResizedCrop
    (its own RNG) and every box lies inside the image with its area share in --crop-scale."""
    recipe, n, (width, height) = CropRecipe(), 4000, (128, 96)
    boxes, mirrored = resized_crop_draws(0, 0, np.arange(n), [(width, height)] * n, recipe)
    torch.manual_seed(0)
    ref = np.array([[p["top"], p["left"], p["height"], p["width"]] for p in
                    (T.RandomResizedCrop(48).make_params([torch.empty(3, height, width)]) for _ in range(n))])

    def stats(b):
        top, left, h, w = (b[:, k].astype(float) for k in range(4))
        return (np.mean(h * w / (width * height)), np.mean(np.log(w / h)), np.mean((top + h / 2) / height),
                np.mean((left + w / 2) / width))

    ours, reference = stats(boxes), stats(ref)
    assert all(math.isclose(a, b, abs_tol=tol) for a, b, tol in zip(ours, reference, (0.02, 0.02, 0.03, 0.03))), (
        ours, reference)
    assert abs(mirrored.mean() - 0.5) < 0.02
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= height).all() and (left + w <= width).all()
    share = h * w / (width * height)
    assert share.min() >= 0.08 * 0.95 and share.max() <= 1.0


def test_the_evaluation_view_is_torchvisions_resize_then_centre_crop():
    """eval_view at S = 48 with --eval-crop 0.875 equals torchvision's Resize(54) then CenterCrop(48) on the PIL
    image, pixel for pixel, for a landscape, a portrait and a square image."""
    rng = np.random.default_rng(0)
    for size in ((128, 96), (96, 128), (112, 112)):
        im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        expected = T.Compose([T.Resize(54, antialias=True), T.CenterCrop(48)])(im)
        assert np.array_equal(eval_view(im, 48, CropRecipe()), np.asarray(expected))


@pytest.mark.slow
def test_train_vit_decodes_in_workers_and_evaluate_checkpoint_reads_its_run_the_same_way(jpeg_folder, tmp_path):
    """train_vit.py (vit_micro at 32 px) with the crop recipe decoded in the loader's workers on 2 ranks x 2 workers
    trains 12 steps and evaluates the 48 test images' centre crops once; evaluate_checkpoint.py on its weights (1
    process, the run's config: decoded in workers) reports the same 48 images, the run's top-1 and its loss to
    1e-4; its --decode replaces the run's (without CUDA, --decode gpu is refused in one line, exit 2)."""
    out = tmp_path / "vit"
    result = run_train(["--data-dir", str(jpeg_folder), "--output-dir", str(out), "--model", "vit_micro",
                        "--image-size", "32", "--augment", "resized-crop", "--batch-size", "16",
                        "--global-batch-size", "32", "--epochs", "2", "--deterministic", "--tracker", "none",
                        "--data-workers", "2"], launch=TWO_RANKS, script=REPO / "train_vit.py")
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert (s["world_size"], s["dataset"]["decode"], s["global_step"], s["eval_examples"]) == (2, "workers", 12, 48)
    line = evaluate_weights(out / "model.safetensors")
    assert (line["script"], line["examples"], line["top1"]) == ("train_vit.py", 48, s["eval_top1"])
    assert line["loss"] == pytest.approx(s["eval_loss"], rel=1e-4)
    if not torch.cuda.is_available():  # --decode replaces the run's: here one that needs a GPU, refused in one line
        asked = run_python([str(REPO / "evaluate_checkpoint.py"), str(out / "model.safetensors"), "--decode", "gpu"],
                           script_env(), timeout=300)
        assert asked.returncode == 2, asked.stderr[-3000:]  # the CUDA line (or TorchCodec's, where it cannot load)
        assert asked.stderr.strip().splitlines()[-1].startswith("error: --decode gpu decodes "), asked.stderr[-3000:]


# A native thread that holds the interpreter's thread-list lock (runtime->interpreters.mutex, HEAD_LOCK in CPython's
# pystate.c) 5 ms of every 5.5: what a library's thread does for an instant when it calls into Python.
HOLDS_THE_THREAD_LIST_LOCK = r"""
#define Py_BUILD_CORE
#include <Python.h>
#include <internal/pycore_runtime.h>
#include <pthread.h>
#include <unistd.h>
static void *hold(void *unused) {
    for (;;) {
        PyThread_acquire_lock(_PyRuntime.interpreters.mutex, WAIT_LOCK);
        usleep(5000);
        PyThread_release_lock(_PyRuntime.interpreters.mutex);
        usleep(500);
    }
    return unused;
}
int start(void) { pthread_t t; return pthread_create(&t, 0, hold, 0); }
"""

LOADER_BESIDE_THE_LOCK = """
import ctypes, os, sys
import torch
from utils.data.images import TensorImages
from utils.data.loaders import make_loader

def main():
    ctypes.PyDLL(sys.argv[1]).start()
    images = TensorImages(torch.arange(64, dtype=torch.uint8).view(64, 1, 1, 1).expand(64, 3, 4, 4).contiguous())
    images.workers = 2  # read in 2 loader worker processes, as the encoded kinds are
    loader = make_loader(images, torch.arange(64), 16, train=True, timeout=30)
    for epoch in range(3):  # each epoch starts its workers anew
        loader.sampler.set_epoch(epoch)
        print(sorted(int(i) for _, labels, _ in loader for i in labels), flush=True)
    os._exit(0)  # the holding thread never stops: no interpreter shutdown under it

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the lock is CPython 3.10-3.11's (3.12 reinitialises it)")
@pytest.mark.skipif(shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None, reason="no C compiler")
def test_loader_workers_start_while_another_thread_holds_the_interpreters_thread_list_lock(tmp_path):
    """CPython before 3.11.10 deadlocks a child forked while another thread holds the interpreter's thread-list lock
    (gh-112275: the child waits for it in os.fork(); on this machine 19 of 20 plain forks beside the holding thread
    below hung), which a library's native thread takes whenever it calls into Python: the loader worker that hung a
    2-rank job 3 times in 227 runs under load. With that lock held 5 ms of every 5.5 by a native thread, a loader
    with 2 worker processes delivers each of its 64 samples once in each of 3 epochs (each epoch starts its workers
    anew), within its 30 s timeout."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    (tmp_path / "hold.c").write_text(HOLDS_THE_THREAD_LIST_LOCK)
    subprocess.run([*cc, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", str(tmp_path / "hold.so"),
                    str(tmp_path / "hold.c"), "-lpthread"], check=True)
    (tmp_path / "loader.py").write_text(LOADER_BESIDE_THE_LOCK)
    result = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(tmp_path / "hold.so")], cwd=REPO,
                            env=script_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [str(list(range(64)))] * 3
