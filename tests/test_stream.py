"""Streamed shards (--decode stream, utils/data/stream.py): CIFAR-10 images upscaled to 96-128 px JPEGs, in 5 train
shards (a count that divides neither 2 nor 4) and 3 test shards, as webdataset tars and as parquet (tests/conftest.py's
stream_shards). Real jobs through train_cifar.py (tests/probe_train.py where what each loader worker read is
recorded), 2 gloo ranks x 2 loader workers under cpu.yaml, fp32 with --deterministic, so "the same" means bitwise."""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import (
    CPU_YAML,
    FSDP_CPU_YAML,
    REPO,
    add_tar_sample,
    add_tar_sample_file,
    assert_same_parameters,
    evaluate_weights,
    kill_job,
    read_summary,
    run_train,
    serving,
    small_tmpfs,
    start,
    wait_for_checkpoint,
    write_cifar_tars,
)

from utils.data import stream
from utils.data.builtin import choose_decode
from utils.data.draws import key_stream
from utils.data.stream import class_mix, find_shards, index_shards, stream_plan, warn_if_poorly_mixed

TWO_RANKS = ["--config_file", str(CPU_YAML), "--main_process_port", "0"]
ONE_PROCESS = ["--num_processes", "1", "--cpu", "--main_process_port", "0"]
# 192 training images, global batch 32 -> 6 optimizer steps in the one epoch; a checkpoint at step 4 (mid-epoch);
# resized crops and mixing as the natural-image recipe trains; the shards cut into blocks of 8 rows, each reader
# shuffling within windows of 16 rows.
JOB = ["--decode", "stream", "--shuffle-buffer", "16", "--shuffle-block", "8", "--model", "resnet8", "--image-size",
       "48", "--augment", "resized-crop", "--mixup", "0.2", "--cutmix", "1.0", "--batch-size", "16",
       "--global-batch-size", "32", "--epochs", "1", "--checkpoint-every-steps", "4", "--lr", "0.01", "--grad-clip",
       "0", "--no-channels-last", "--deterministic", "--tracker", "none"]
N_TRAIN, N_TEST = 192, 48


def args(data, out, *extra) -> list[str]:
    return ["--data-dir", str(data), "--output-dir", str(out), *JOB, *extra]


@pytest.fixture(scope="module")
def streamed(stream_shards, tmp_path_factory):
    """The job on 2 ranks x 2 loader workers over the tar shards, uninterrupted, through tests/probe_train.py."""
    out = tmp_path_factory.mktemp("stream") / "two"
    result = run_train(args(stream_shards["tar"], out, "--data-workers", "2"), launch=TWO_RANKS,
                       script=REPO / "tests" / "probe_train.py")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "streaming the shards, each batch decoded in the loader's workers (--decode stream)" in result.stdout
    return out


def stream_log(out) -> tuple[dict, dict]:
    """probe_train's per-worker lines: ({pid: (rank, [fetched batches])}, {pid: [windows read]}), the main
    processes' reads (the mean and std's first images) left out: a pid that fetched nothing."""
    fetched, read = collections.defaultdict(list), collections.defaultdict(list)
    ranks = {}
    for path in out.glob("probe-stream-rank*-*.jsonl"):
        rank, pid = path.stem.removeprefix("probe-stream-rank").split("-")
        ranks[pid] = int(rank)
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "index" not in entry:
                (fetched if "fetch" in entry else read)[pid].append(entry)
    return ({pid: (ranks[pid], f) for pid, f in fetched.items()},
            {pid: r for pid, r in read.items() if pid in fetched})


def test_on_two_ranks_by_two_workers_each_training_image_is_fetched_once_and_read_by_one_worker(streamed,
                                                                                               stream_shards):
    """Streaming 5 tar shards on 2 ranks x 2 loader workers, each training image is decoded once an epoch and read by
    one worker: each of the 8 shards (train and test) is indexed by one process; the batches the four workers decode
    (two per rank) hold each of the 192 training images exactly once; each image is read from its shard by exactly
    one worker, once; every block of 8 rows is read by at most two workers (two where one's range ends inside it),
    and a shard's blocks by several; no read is longer than the 16-row window."""
    indexed = collections.Counter(json.loads(line)["index"] for path in streamed.glob("probe-stream-rank*.jsonl")
                                  for line in path.read_text().splitlines() if '"index"' in line)
    assert indexed == collections.Counter(str(p) for p in stream_shards["tar"].glob("*.tar"))  # each once, by one
    fetched, read = stream_log(streamed)
    train = {pid: [e for e in f if e["fetch"] == "train"] for pid, (_, f) in fetched.items()}
    train = {pid: f for pid, f in train.items() if f}
    rows = [r for f in train.values() for e in f for r in e["rows"]]
    assert sorted(rows) == list(range(N_TRAIN))
    assert sorted(collections.Counter(fetched[pid][0] for pid in train).values()) == [2, 2]  # ranks' workers
    readers = collections.defaultdict(set)
    for pid in train:
        for window in read[pid]:
            assert window["read"] == "train" and len(window["rows"]) <= 16
            for r in window["rows"]:
                readers[r].add(pid)
    assert sorted(readers) == list(range(N_TRAIN)) and all(len(p) == 1 for p in readers.values())
    reads = collections.Counter(r for pid in train for w in read[pid] for r in w["rows"])
    assert set(reads.values()) == {1}  # no row read twice, even by the same worker
    bounds = np.cumsum([0] + [pq.read_metadata(p).num_rows for p in sorted(stream_shards["parquet"].glob("train-*"))])
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert all(1 <= len(set().union(*(readers[r] for r in range(s, min(s + 8, b))))) <= 2 for s in range(a, b, 8))
    assert max(len(set().union(*(readers[r] for r in range(a, b)))) for a, b in zip(bounds[:-1], bounds[1:])) > 2


def test_evaluation_on_two_ranks_by_two_workers_counts_each_test_image_once(streamed, stream_shards):
    """A streamed evaluation over 3 test shards on 2 ranks x 2 loader workers counts each of the 48 test images once:
    the metrics count 48 images, whose labels are the test shards' labels; every test image is decoded, and only
    Accelerate's padding of the last round (the first images, dropped by gather_for_metrics) is decoded twice."""
    labels = np.concatenate([pq.read_table(p, columns=["label"]).column(0).to_numpy() for p in
                             sorted(stream_shards["parquet"].glob("test-*"))])
    assert read_summary(streamed)["eval_examples"] == N_TEST
    gathered = sum((json.loads((streamed / f"probe-rank{r}.json").read_text())["eval_outputs"][0]["labels"]
                    for r in (0, 1)), [])
    assert len(gathered) == 2 * N_TEST and sorted(gathered) == sorted(labels.tolist() * 2)  # each rank sees all
    fetched, _ = stream_log(streamed)
    rows = collections.Counter(r for _, f in fetched.values() for e in f if e["fetch"] == "test" for r in e["rows"])
    assert sorted(rows) == list(range(N_TEST))
    # 48 rows in micro-batches of 16 on 2 ranks: 3 batches, padded to 4 with the first 16 rows
    assert [r for r, n in rows.items() if n > 1] == list(range(16)) and set(rows.values()) == {1, 2}


@pytest.fixture(scope="module")
def killed(stream_shards, tmp_path_factory):
    """The 2-rank x 2-worker job killed with kill -9 after its mid-epoch checkpoint of step 4."""
    out = tmp_path_factory.mktemp("stream-killed") / "killed"
    proc = start(args(stream_shards["tar"], out, "--data-workers", "2"), TWO_RANKS)
    wait_for_checkpoint(out, proc, 4)
    kill_job(proc)
    assert not (out / "summary.json").exists()
    # the checkpoint's stream state, JSON: the epoch in progress, its layout (2 processes x 2 workers x 16), window
    # and block
    assert json.loads((out / "checkpoints" / "step-00000004" / "stream.json").read_text()) == {
        "epoch": 0, "layout": [2, 2, 16], "window": 16, "block": 8}
    return out


@pytest.mark.parametrize(("launch", "workers"), [(TWO_RANKS, "2"), (ONE_PROCESS, "1")], ids=["2x2", "1x1"])
def test_kill_9_mid_epoch_then_resume_reads_the_same_images_in_the_same_order(streamed, killed, stream_shards,
                                                                                tmp_path, launch, workers):
    """A streaming job on 2 ranks x 2 loader workers killed with kill -9 mid-epoch and resumed, on 2 ranks x 2 workers
    or on 1 process x 1 worker, ends with the uninterrupted run's trainable parameters bitwise (fp32,
    `--deterministic`): the kill comes after the step-4 checkpoint, `--resume auto` continues from it, and the
    interrupted epoch is finished in the order it was planned in."""
    out = tmp_path / "resumed"
    shutil.copytree(killed, out)
    result = run_train(args(stream_shards["tar"], out, "--data-workers", workers, "--resume", "auto"), launch=launch)
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert int(s["resumed_from"].rsplit("step-", 1)[1]) == 4 and s["global_step"] == 6
    assert_same_parameters(out, streamed)


@pytest.mark.slow
def test_parquet_shards_tar_shards_and_tar_shards_over_http_train_the_same_weights(stream_shards, http_shards,
                                                                                   tmp_path):
    """The same rows as parquet shards (read without read-ahead), as webdataset tars, and as those tars served over
    HTTP (byte ranges, through fsspec: the path object storage takes), 1 process x 1 worker, one epoch: bitwise-equal
    trainable parameters and evaluation loss. Every reader gives the same bytes in the same order."""
    runs = {"parquet": stream_shards["parquet"], "tar": stream_shards["tar"], "http": http_shards}
    for name, data in runs.items():
        ahead = ["--read-ahead", "0"] if name == "parquet" else []
        result = run_train(args(data, tmp_path / name, "--data-workers", "1", "--cache-dir", str(tmp_path / "cache"),
                                *ahead), launch=ONE_PROCESS)
        assert result.returncode == 0, result.stderr[-4000:]
    summaries = {name: read_summary(tmp_path / name) for name in runs}
    assert {s["dataset"]["decode"] for s in summaries.values()} == {"stream"}
    assert summaries["http"]["dataset"]["source"] == http_shards
    assert summaries["parquet"]["eval_loss"] == summaries["tar"]["eval_loss"] == summaries["http"]["eval_loss"]
    assert_same_parameters(tmp_path / "parquet", tmp_path / "tar")
    assert_same_parameters(tmp_path / "http", tmp_path / "tar")


@pytest.mark.slow
def test_fsdp_streams_the_shards_and_evaluate_checkpoint_streams_the_test_shards_again(stream_shards, tmp_path):
    """Under fsdp_cpu.yaml (FSDP2 on 2 CPU ranks x 2 loader workers) a streaming job trains its 6 steps on the 192
    training images and evaluates the 48 test images once; evaluate_checkpoint.py on its model.safetensors (1
    process, the run's config: the stream) reports the same 48 images, the run's top-1 and its loss to 1e-4."""
    out = tmp_path / "fsdp"
    result = run_train(args(stream_shards["tar"], out, "--data-workers", "2"),
                       launch=["--config_file", str(FSDP_CPU_YAML), "--main_process_port", "0"])
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert (s["world_size"], s["distributed_type"], s["dataset"]["decode"]) == (2, "FSDP", "stream")
    assert (s["global_step"], s["train_images_seen"], s["eval_examples"]) == (6, N_TRAIN, N_TEST)
    evaluated = evaluate_weights(out / "model.safetensors")
    assert (evaluated["examples"], evaluated["top1"]) == (N_TEST, s["eval_top1"])
    assert evaluated["loss"] == pytest.approx(s["eval_loss"], rel=1e-4)


def nested(flat: Path, root: Path) -> Path:
    """The shards of `flat` in nested folders that keep their sorted order (training shards 0-1 in 2026/a/, 2-4 in
    2026/b/, the test shards in eval/), beside the cache folder a local run keeps in its data folder
    (.decoded/stream-index, written by indexing the shards there) and a hidden folder holding a stale copy of a
    training shard: a listing that walks into either trains on other rows, or asks for what is not a shard."""
    kind = "tar" if any(flat.glob("*.tar")) else "parquet"
    for shard in sorted(flat.glob(f"*.{kind}")):
        k = int(shard.name.split("-")[1])
        part = "eval" if shard.name.startswith("test") else "2026/a" if k < 2 else "2026/b"
        (root / part).mkdir(parents=True, exist_ok=True)
        shutil.copy(shard, root / part / shard.name)
    (root / ".old").mkdir()
    shutil.copy(flat / f"train-00001-of-00005.{kind}", root / ".old" / f"train-00005-of-00006.{kind}")
    found = find_shards(str(root))
    for urls in found.values():
        index_shards(urls, (None, None), root / ".decoded" / "stream-index")
    assert len(list((root / ".decoded" / "stream-index").glob("index-*.npz"))) == 8
    return root


@pytest.mark.slow
@pytest.mark.parametrize("every", [2, 3])
def test_nested_shards_over_a_server_failing_every_kth_request_train_as_the_local_ones(streamed, stream_shards,
                                                                                       tmp_path, every):
    """The tar shards in nested folders beside a cache folder and a hidden folder, served over HTTP by a server that
    answers every k-th request (k = 2, 3) with 503, on 2 ranks x 2 loader workers reading ahead: the run trains the
    192 training images of the 5 shards and ends with the local flat folder's trainable parameters bitwise; no
    request goes into a hidden folder. (A refused request is answered when asked again: each request is retried on
    its own; the server refused at least 10.)"""
    served = nested(stream_shards["tar"], tmp_path / "served")
    with serving(served, every=every) as (url, state):
        out = tmp_path / "flaky"
        result = run_train(args(url, out, "--data-workers", "2", "--cache-dir", str(tmp_path / "cache")),
                           launch=TWO_RANKS)
        assert result.returncode == 0, result.stderr[-4000:]
        assert len(state["refused"]) >= 10
        assert [path for _, path in state["log"] if "/." in path] == []
    s = read_summary(out)
    assert (s["dataset"]["source"], s["dataset"]["shards"], s["train_images_seen"]) == \
        (url, {"train": 5, "test": 3}, N_TRAIN)
    assert_same_parameters(out, streamed)


@pytest.mark.parametrize(("kind", "fault", "every"), [("tar", "refuse", 2), ("tar", "cut", 2), ("tar", "stall", 4),
                                                      ("parquet", "refuse", 2), ("parquet", "cut", 3)])
def test_a_listing_the_indices_and_an_epochs_reads_through_a_failing_server_give_the_local_bytes(
        stream_shards, tmp_path, monkeypatch, kind, fault, every):
    """Listing the nested folders (`nested`), indexing the shards without a cache and reading an epoch's windows
    (reading ahead) over HTTP from a server failing every k-th request, the first time it comes: answered 503
    ("refuse"), its body cut short and the connection closed ("cut"), or no answer within the timeout ("stall",
    TIMEOUT_S 0.5 s here, the server silent for 2 s): the same shards, the same labels and the same bytes of every
    row, in order, as the local folder gives. At least 5 requests failed."""
    monkeypatch.setattr(stream, "BACKOFF_S", 0.0)
    monkeypatch.setattr(stream, "TIMEOUT_S", 0.5)
    served = nested(stream_shards[kind], tmp_path / "served")

    def read_all(data_dir: str):
        found = find_shards(data_dir)
        rows = stream.StreamRows(index_shards(found["train"], (None, None)), "train",
                                 stream.StreamSettings(window=16, block=8, read_ahead=2))
        rows.use_plan(stream_plan(rows.counts, 192, (1, 1, 16), 16, 8, key_stream(0, 0, 0)))
        names = {s: [u.removeprefix(data_dir.rstrip("/") + "/") for u in urls] for s, urls in found.items()}
        return names, rows.labels.tolist(), rows.fetch(rows.plan.order)

    local = read_all(str(served))
    with serving(served, every=every, fault=fault, stall=2.0) as (url, state):
        remote = read_all(url)
        failed = len(state["refused"])
    assert remote[0] == local[0] == {"train": [f"2026/{'a' if k < 2 else 'b'}/train-0000{k}-of-00005.{kind}"
                                               for k in range(5)],
                                     "test": [f"eval/test-0000{k}-of-00003.{kind}" for k in range(3)]}
    assert remote[1] == local[1] and len(local[1]) == N_TRAIN
    assert remote[2] == local[2]
    assert failed >= 5


def test_the_listing_skips_hidden_folders_and_the_cache_folder(stream_shards, tmp_path):
    """A local folder's listing leaves out the shards in a hidden folder and, given the cache folder (--cache-dir
    inside the data folder), those in it; the cache folder not given, its shard is listed."""
    served = nested(stream_shards["tar"], tmp_path / "served")
    (served / "cache" / "stream-index").mkdir(parents=True)
    shutil.copy(served / "eval" / "test-00000-of-00003.tar", served / "cache" / "test-00003-of-00004.tar")
    skipping = find_shards(str(served), served / "cache" / "stream-index")
    assert [Path(u).relative_to(served).as_posix() for u in skipping["test"]] == \
        [f"eval/test-0000{k}-of-00003.tar" for k in range(3)]
    assert len(skipping["train"]) == 5
    assert len(find_shards(str(served))["test"]) == 4


@pytest.mark.slow
def test_a_listing_the_server_always_refuses_is_one_line_naming_the_url_and_writes_nothing(stream_shards, tmp_path):
    """A --data-dir URL whose server answers every request with 503: the job stops with one line naming the URL,
    the server's answer and the 6 tries, after 6 requests for the listing, and leaves no output folder."""
    with serving(stream_shards["tar"], always=True) as (url, state):
        out = tmp_path / "runs" / "out"
        result = run_train(args(url, out, "--cache-dir", str(tmp_path / "cache")))
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip().splitlines()[-1] == (
            f"error: cannot list --data-dir {url} (ClientResponseError: 503, message='Service Unavailable', "
            f"url='{url}', 6 tries).")
        assert state["log"] == [("GET", "/")] * 6
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_test_shards_holding_training_images_get_one_warning_reading_only_the_candidates(cifar_dir, tmp_path,
                                                                                           capsys, monkeypatch):
    """A stream of tar shards whose test shard holds 2 training images byte for byte (under other keys) among 6: one
    warning line counts 2 and names the first pair by shard and row; a training image saved again as PNG (other
    bytes) and new images are not counted. Only the members whose size the other split has are read (from the
    index: the 2 copies, their 2 originals and a training image of the same size), their first 4 KB each, then
    whole only those whose digests agree. Parquet shards, and tar shards at a URL, are not checked: no line, nothing
    read."""
    from PIL import Image

    from utils.data.builtin import load_encoded
    from utils.data.stream import StreamRows, StreamSettings

    table = pq.read_table(cifar_dir / "train-00000-of-00001.parquet").slice(0, 34)  # 30 hold every class
    images, labels = [cell["bytes"] for cell in table.column("img").to_pylist()], table.column("label").to_pylist()
    folder = tmp_path / "shards"
    folder.mkdir()
    with tarfile.open(folder / "cifar-train-00000.tar", "w") as tar:
        for row in range(30):
            add_tar_sample(tar, f"train{row:05d}", "png", images[row], labels[row])
    resaved = io.BytesIO()
    Image.open(io.BytesIO(images[3])).save(resaved, "PNG", compress_level=0)
    test = [(images[7], labels[7]), (images[30], labels[30]), (images[11], labels[11]), (resaved.getvalue(),
            labels[3]), (images[31], labels[31]), (images[32], labels[32])]
    with tarfile.open(folder / "cifar-test-00000.tar", "w") as tar:
        for row, (image, label) in enumerate(test):
            add_tar_sample(tar, f"test{row:05d}", "png", image, label)
    reads, real_encoded = [], StreamRows.encoded
    monkeypatch.setattr(StreamRows, "encoded", lambda self, indices, limit=None: reads.append(
        (self.split, sorted(np.asarray(indices).tolist()), limit)) or real_encoded(self, indices, limit))
    load_encoded(str(folder), image_size=32, stream=StreamSettings(index_cache=None))
    lines = [line for line in capsys.readouterr().out.splitlines() if "also training images" in line]
    assert lines == [f"warning: 2 of the 6 evaluation images are also training images, byte for byte (the first: "
                     f"{folder / 'cifar-test-00000.tar'} row 0 and {folder / 'cifar-train-00000.tar'} row 7); the "
                     f"evaluation counts them as unseen."]
    sizes = [[len(image) for image, _ in split] for split in (zip(images[:30], labels), test)]
    shared = [[k for k, n in enumerate(mine) if n in theirs] for mine, theirs in zip(sizes, sizes[::-1])]
    assert shared == [[7, 11, 27], [0, 2]]  # train row 27: the size of row 7 or 11, other bytes
    assert sorted(reads, key=repr) == sorted([("train", [7, 11, 27], 4096), ("test", [0, 2], 4096),
                                              ("train", [7, 11], None), ("test", [0, 2], None)], key=repr)
    reads.clear()
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    pq.write_table(table.slice(0, 30), parquet / "train-00000.parquet")
    pq.write_table(table.slice(7, 6), parquet / "test-00000.parquet")
    load_encoded(str(parquet), image_size=32, stream=StreamSettings(index_cache=None))
    assert "also training images" not in capsys.readouterr().out and reads == []
    with serving(folder) as (url, _):  # the tar shards over HTTP: not checked either
        load_encoded(url, image_size=32, stream=StreamSettings(index_cache=None))
    assert "also training images" not in capsys.readouterr().out and reads == []


def test_a_tar_shard_leaves_out_macos_hidden_members_and_names_a_sample_with_neither_image_nor_label(tmp_path):
    """A webdataset tar as macOS's tar writes it, a ._KEY.jpg and ._KEY.cls (AppleDouble) before each file: its index
    holds the 3 samples and their labels alone; a sample of a .json alone is one line saying it has neither an
    image nor a .cls label."""
    from utils.data.stream import index_shard

    shard = tmp_path / "cifar-train-0.tar"
    with tarfile.open(shard, "w") as tar:
        for row in range(3):
            for hidden in (f"._s{row}.jpg", f"._s{row}.cls"):
                add_tar_sample_file(tar, hidden, b"\0\5\26\7" + bytes(60))
            add_tar_sample(tar, f"s{row}", "jpg", b"\xff\xd8 not decoded here", 7 - row)
    indexed = index_shard(str(shard), (None, None))
    assert indexed.labels.tolist() == [7, 6, 5] and len(indexed.members) == 3
    with tarfile.open(shard, "a") as tar:
        add_tar_sample_file(tar, "s3.json", b"{}")
    with pytest.raises(stream.UserError) as error:
        index_shard(str(shard), (None, None))
    assert str(error.value) == f"{shard}: the sample s3 has other files but no .cls label and no image."


def test_a_second_start_reads_no_tar_through_and_a_changed_shard_is_read_again(stream_shards, tmp_path):
    """Indexing tar shards over HTTP with a cache folder, a second start sends no byte of them and gives the same index;
    a tar whose modification time changes is sent again, alone. The 5 training tars; the server counts the .tar
    bytes it sends: the first pass sends each tar once, whole; the second (the same URL) none; after one tar's
    modification time (its Last-Modified) moves, the next pass sends that tar, whole."""
    folder = tmp_path / "tars"
    shutil.copytree(stream_shards["tar"], folder, ignore=shutil.ignore_patterns(".decoded"))
    sizes = {p.name: p.stat().st_size for p in folder.glob("train-*.tar")}
    with serving(folder) as (url, state):
        urls = find_shards(url)["train"]
        first = index_shards(urls, (None, None), tmp_path / "cache")
        assert state["tar_bytes"] == sum(sizes.values())
        second = index_shards(urls, (None, None), tmp_path / "cache")
        assert state["tar_bytes"] == sum(sizes.values())
        for a, b in zip(first, second):
            assert np.array_equal(a.labels, b.labels) and np.array_equal(a.members, b.members)
        changed = folder / "train-00001-of-00005.tar"
        os.utime(changed, (changed.stat().st_atime, changed.stat().st_mtime + 5))
        index_shards(urls, (None, None), tmp_path / "cache")
        assert state["tar_bytes"] == sum(sizes.values()) + sizes[changed.name]


def test_a_read_the_server_keeps_refusing_is_one_line_naming_the_shard(stream_shards, monkeypatch):
    """Training windows read over HTTP, reading ahead, from a server that answers one shard with 503 only (after
    the index was read): a window without rows of that shard reads as before; the first window with one stops with
    one line naming the shard, the server's answer and the tries."""
    monkeypatch.setattr(stream, "BACKOFF_S", 0.0)
    with serving(stream_shards["tar"]) as (url, state):
        rows = stream.StreamRows(index_shards(find_shards(url)["train"], (None, None)), "train",
                                 stream.StreamSettings(window=16, block=8, read_ahead=2))
        rows.use_plan(stream_plan(rows.counts, 192, (1, 1, 16), 16, 8, key_stream(0, 0, 0)))
        state["broken"].add("train-00002-of-00005.tar")
        shard = f"{url}train-00002-of-00005.tar"
        windows = rows.plan.order.reshape(-1, 16)  # the plan's windows of 16 rows, in order (1 reader)
        in_shard = [bool(np.isin(w, np.arange(78, 116)).any()) for w in windows]  # shard 2: rows 78-115
        fine = rows.fetch(windows[in_shard.index(False)])
        with pytest.raises(stream.UserError) as e:
            rows.fetch(windows[in_shard.index(True)])
    assert str(e.value) == (f"cannot read the train shard {shard} (ClientResponseError: 503, message='Service "
                            f"Unavailable', url='{shard}', {stream.ATTEMPTS} tries).")
    assert len(fine) == 16


@pytest.fixture(scope="module")
def class_sorted(cifar_dir, tmp_path_factory) -> dict[str, Path]:
    """4,000 CIFAR-10 training images and 5,000 test images: as 10 tar shards sorted by class, as 10 tar shards in
    the copy's shuffled order, and as parquet files of the same rows (random access)."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("class-sorted")
    table = root / "parquet"
    table.mkdir()
    for split, n in (("train", 4000), ("test", 5000)):
        pq.write_table(pq.read_table(cifar_dir / f"{split}-00000-of-00001.parquet").slice(0, n),
                       table / f"{split}-00000-of-00001.parquet")
    return {"sorted": write_cifar_tars(root / "sorted", cifar_dir, 4000, 5000, by_class=True),
            "shuffled": write_cifar_tars(root / "shuffled", cifar_dir, 4000, 5000, by_class=False),
            "workers": table}


@pytest.mark.slow
def test_class_sorted_shards_train_as_well_as_shuffled_shards_and_random_access(class_sorted, tmp_path):
    """From 10 tar shards sorted by class, a 2-rank stream trains to within 8 points of the top-1 of the same rows
    shuffled and of random access: 4,000 CIFAR-10 training images (each shard about one class; the shuffled shards in
    the copy's own order), 5 epochs of resnet8 (fp32, --deterministic, seed 4, 1 loader worker a rank, windows of
    1,024 rows and blocks of 32), evaluated on 5,000 test images; random access is --decode workers on the same rows.
    Every top-1 is above 30% (chance: 10%), and the start warns of no poor mix. (Single runs of one recipe spread
    over 2 to 3 points: the margin.)"""
    top1 = {}
    for name, data in class_sorted.items():
        decode = ["--decode", "workers"] if name == "workers" else ["--decode", "stream", "--shuffle-buffer", "1024",
                                                                     "--shuffle-block", "32"]
        out = tmp_path / name
        result = run_train(["--data-dir", str(data), "--output-dir", str(out), *decode, "--data-workers", "1",
                            "--model", "resnet8", "--epochs", "5", "--batch-size", "64", "--seed", "4",
                            "--deterministic", "--no-channels-last", "--tracker", "none"], launch=TWO_RANKS)
        assert result.returncode == 0, result.stderr[-4000:]
        assert "warning: the stream's shuffle" not in result.stdout
        summary = read_summary(out)
        assert (summary["world_size"], summary["eval_examples"]) == (2, 5000)
        top1[name] = summary["eval_top1"]
    assert min(top1.values()) > 30, top1
    assert abs(top1["sorted"] - top1["shuffled"]) <= 8 and abs(top1["sorted"] - top1["workers"]) <= 8, top1


def assigned(order: np.ndarray, layout: tuple[int, int, int]) -> np.ndarray:
    """Each position of the sampler's order -> the reader that gets it: Accelerate hands micro-batch k to process
    k mod P, and a process's DataLoader hands its j-th batch to worker j mod W (their documented contracts)."""
    processes, workers, micro = layout
    k = np.arange(len(order)) // micro
    return (k % processes) * workers + (k // processes) % workers


@pytest.mark.parametrize(("counts", "layout", "window", "block"), [
    ([39, 39, 38, 38, 38], (2, 2, 16), 16, 8), ([39, 39, 38, 38, 38], (3, 2, 4), 5, 3), ([17], (4, 3, 2), 3, 64),
    ([100, 1, 60, 31], (1, 4, 8), 7, 1), ([100, 0, 60, 31], (2, 1, 8), 32, 16)])
def test_a_stream_plan_reads_each_row_once_in_one_contiguous_range_per_reader(counts, layout, window, block):
    """stream_plan for training: whole global batches of the stream (the shards' blocks of `block` rows in a drawn
    order: each block's rows consecutive in one shard, every block once), each reader's rows one contiguous stretch
    of it, shuffled within windows of at most `window` rows; the order is the same for the same (seed, epoch) and
    another for the next epoch."""
    processes, workers, micro = layout
    keep = sum(counts) // (processes * micro) * processes * micro
    starts = np.cumsum([0] + counts)
    blocks = {(s, min(s + block, b)) for a, b in zip(starts[:-1], starts[1:]) for s in range(a, b, block)}
    orders = []
    for epoch in (0, 0, 1):
        plan = stream_plan(np.array(counts), keep, layout, window, block, key_stream(0, epoch, 0))
        order, stream = plan.order, plan.stream
        orders.append(order)
        assert len(order) == keep and len(set(order.tolist())) == keep and set(order) <= set(stream[:keep])
        full = stream_plan(np.array(counts), sum(counts), (1, 1, 1), window, block, key_stream(0, epoch, 0)).stream
        runs = np.split(full, np.flatnonzero(np.isin(full, [a for a, _ in blocks])))[1:]  # cut at each block's first
        assert sorted((int(r[0]), int(r[-1]) + 1) for r in runs) == sorted(blocks)
        assert all(np.array_equal(r, np.arange(r[0], r[-1] + 1)) for r in runs)
        position = {int(r): i for i, r in enumerate(stream)}
        reader = assigned(order, layout)
        for r in range(processes * workers):
            mine = sorted(position[int(x)] for x in order[reader == r])
            assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True
            assert not mine or plan.ranges[r] == mine[0]
        assert np.diff(plan.cuts).max() <= window and set(plan.ranges[:-1]) <= set(plan.cuts)
    assert np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], orders[2])


def test_an_evaluation_plan_covers_every_row_once_with_a_short_last_batch():
    """stream_plan for evaluation (no shuffle, no batch dropped): 17 rows in micro-batches of 4 on 2 processes x 2
    workers: every row once, the shards in order, each reader's rows contiguous."""
    plan = stream_plan(np.array([10, 7]), 17, (2, 2, 4), 4)
    assert sorted(plan.order.tolist()) == list(range(17)) and plan.stream.tolist() == list(range(17))
    reader = assigned(plan.order, (2, 2, 4))
    for r in range(4):
        mine = sorted(plan.order[reader == r].tolist())
        assert mine == list(range(mine[0], mine[0] + len(mine)))


@pytest.mark.parametrize(("data", "why"), [("tar", "--data-dir holds tar shards"), ("url", "--data-dir is a URL"),
                                          ("parquet", None)])
def test_decode_auto_streams_a_url_and_a_folder_of_tar_shards(stream_shards, capsys, data, why, tmp_path):
    """--decode auto streams a --data-dir URL or a folder of tar shards, and says why; a folder of parquet files is
    decoded into the cache when its images at their own size (the first one's, 96 x 96) fit the cache folder, and the
    line says what was weighed."""
    folder = {"tar": str(stream_shards["tar"]), "url": "https://example.org/shards/",
              "parquet": str(stream_shards["parquet"])}[data]
    cfg = SimpleNamespace(decode="auto", data_dir=folder, augment="standard", image_size=None, cache_dir=str(tmp_path),
                          val_fraction=None, eval_split=None, image_column=None, label_column=None)
    assert choose_decode(cfg, None)[0] == ("stream" if why else "cache")
    out = capsys.readouterr().out
    if why:
        assert out == f"streaming the shards, each batch decoded in the loader's workers (--decode auto: {why})\n"
    else:  # 240 images x 3 x 96 x 96 bytes
        assert out.startswith(f"reading the decoded images from the cache, decoded once on a first run (--decode auto: "
                              f"the decoded images take "
                              f"{240 * 3 * 96 * 96 / 2**20:,.1f} MiB at 96 x 96 px, {tmp_path} has ")


@pytest.mark.parametrize("decode", ["cache", "workers"])
def test_a_folder_of_tar_shards_asked_to_decode_other_than_as_a_stream_is_one_line(stream_shards, decode, tmp_path):
    """Tar shards are read as a stream only: --decode cache or workers on a folder of them is refused in one line
    that says which flag reads them."""
    cfg = SimpleNamespace(decode=decode, data_dir=str(stream_shards["tar"]), augment="standard", image_size=None,
                          cache_dir=str(tmp_path), val_fraction=None, eval_split=None, image_column=None,
                          label_column=None)
    with pytest.raises(stream.UserError) as e:
        choose_decode(cfg, None)
    assert str(e.value) == (f"--decode {decode}: --data-dir {stream_shards['tar']} holds tar shards, which are read as "
                            f"a stream (--decode stream, or auto).")


def test_decode_auto_weighs_the_images_own_size_when_no_image_size_is_given(stream_shards, capsys, tmp_path):
    """--decode auto with no --image-size, on 240 parquet images whose first is 96 x 96 (6.3 MiB decoded) and a 1 MiB
    cache filesystem: the workers path, and the line says the size it weighed."""
    with small_tmpfs(tmp_path / "cache", "1m") as disk:
        cfg = SimpleNamespace(decode="auto", data_dir=str(stream_shards["parquet"]), augment="standard",
                              image_size=None, cache_dir=str(disk), val_fraction=None, eval_split=None,
                              image_column=None, label_column=None)
        assert choose_decode(cfg, None)[0] == "workers"
        assert capsys.readouterr().out == (
            f"decoding each batch in the loader's workers (--decode auto: the decoded images take 6.3 MiB at 96 x 96 "
            f"px, {disk} has 1.0 MiB free)\n")


def test_class_sorted_shards_give_micro_batches_of_nearly_every_class():
    """10 shards of 1,000 rows, each one class (shards written class by class), planned for 2 processes x 1 worker x
    micro-batch 64 with the default window (4096) and block (64): over 3 epochs a micro-batch holds at least 9.9 of
    the 10 classes on average (9 at least), where a uniform shuffle gives 9.99 (computed independently here, by
    drawing), and the stream's first k blocks hold each class's blocks within 2 of k times its share, for every k.
    Blocks as large as a shard (the shards' order shuffled, not their rows) give about 4."""
    labels = np.repeat(np.arange(10), 1000)
    rng = np.random.default_rng(0)
    drawn = np.mean([len(set(rng.choice(labels, 64, replace=False))) for _ in range(2000)])
    assert drawn > 9.9
    for epoch in range(3):
        plan = stream_plan(np.full(10, 1000), 9984, (2, 1, 64), 4096, 64, key_stream(4, epoch, 0), labels)
        per_batch = [len(set(b)) for b in labels[plan.order].reshape(-1, 64)]
        assert np.mean(per_batch) >= 9.9 and min(per_batch) >= 9
        planned, uniform = class_mix(plan.order, labels, 64)
        assert planned == pytest.approx(np.mean(per_batch)) and uniform == pytest.approx(drawn, abs=0.05)
        full = stream_plan(np.full(10, 1000), 10000, (1, 1, 1), 4096, 64, key_stream(4, epoch, 0), labels).stream
        firsts = full[full % 1000 % 64 == 0]  # each shard's 16 blocks (15 of 64 rows, one of 40), in stream order
        assert len(firsts) == 160 and all(np.array_equal(full[i:i + 64 if r % 1000 < 960 else i + 40], np.arange(
            r, r + (64 if r % 1000 < 960 else 40))) for i, r in zip(np.flatnonzero(full % 1000 % 64 == 0), firsts))
        for c in range(10):  # 16 of the 160 blocks are class c's
            assert np.abs(np.cumsum(labels[firsts] == c) - np.arange(1, 161) * 0.1).max() <= 2
    whole = stream_plan(np.full(10, 1000), 9984, (2, 1, 64), 4096, 1000, key_stream(4, 0, 0), labels)
    assert np.mean([len(set(b)) for b in labels[whole.order].reshape(-1, 64)]) < 4.5


def test_a_poorly_mixed_plan_is_said_in_one_line_with_what_to_do(capsys):
    """The start's warning: on class-sorted shards, blocks of 1,000 rows in windows of 4,096 put about 4 classes in a
    micro-batch of 64 (one line, with the uniform figure and the flags to change); blocks of 64: no line."""
    labels = np.repeat(np.arange(10), 1000)
    for block in (1000, 64):
        plan = stream_plan(np.full(10, 1000), 9984, (2, 1, 64), 4096, block, key_stream(4, 0, 0))
        warn_if_poorly_mixed(plan, labels, 64, 4096, block)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("warning: the stream's shuffle puts 4.1 classes in a micro-batch of 64 "
                                               "on average, where a uniform shuffle puts 10.0: ")
    assert "Raise --shuffle-buffer, lower --shuffle-block, or write the shards with their rows shuffled." in out[0]
