"""Shared test helpers: where the data is, tiny parquet files, and running train_cifar.py for real."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import io
import json
import os
import select
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from utils.models import named_model

REPO = Path(__file__).resolve().parents[1]
SHARED_CIFAR = REPO.parent / "shared" / "data" / "cifar10"
CPU_YAML = REPO / "accelerate_configs" / "cpu.yaml"
FSDP_CPU_YAML = REPO / "accelerate_configs" / "fsdp_cpu.yaml"
PROBE = REPO / "tests" / "probe_train.py"
GPU_YAML = REPO / "accelerate_configs" / "1gpu.yaml"
# A test marked `cuda` runs where torch sees a GPU (bench/gpu_check.sh runs them: python -m pytest -m cuda) and is
# skipped elsewhere. DEVICES parametrizes a test over the CPU and, marked so, CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CUDA = torch.cuda.is_available()


def torchcodec_imports() -> bool:
    try:
        import torchcodec.decoders  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or built for another torch release
        return False
    return True


# --decode gpu's decoder. Each TorchCodec release loads with one torch release only; a machine whose torch it was not
# built for skips the tests that decode through it, but CI (whose torch the requirements pin it for) runs them all.
TORCHCODEC = bool(os.environ.get("CI")) or torchcodec_imports()
NEEDS_TORCHCODEC = pytest.mark.skipif(not TORCHCODEC, reason="TorchCodec does not import with this torch")


# Fixtures that run training jobs (real processes): a test that uses one is `slow`, as is every test marked so by hand
# (it starts a job itself). `python -m pytest -m "not slow"` is the quick subset for the edit-test loop.
JOB_FIXTURES = {"reference", "small_run", "ddp_jobs", "bf16_jobs", "fsdp_jobs", "vit_jobs", "tracked_runs",
                "two_rank_run", "fine_tuned", "streamed", "killed", "sources", "timm_runs", "vit_fsdp_run",
                "resized_crop_run"}


def cross_entropy(logits, labels):
    """The templates' compute_loss without label smoothing, as evaluate() takes it: (the loss, no named terms)."""
    return torch.nn.functional.cross_entropy(logits, labels), {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if JOB_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bench/gpu_check.sh runs these there)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def cpu_bf16_native_here() -> bool | None:
    """Whether this CPU computes bf16 natively, read from /proc/cpuinfo independently of utils.launch (None: no x86
    flags line, as on ARM or macOS)."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), None)
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def write_parquet(path: Path, n: int, seed: int = 0, size=(32, 32), mode: str = "RGB", labels=None, fmt="PNG",
                  class_names=CIFAR_CLASSES, columns=("img", "label")) -> Path:
    """A parquet file with the schema of uoft-cs/cifar10 (img {bytes, path}, label: a ClassLabel of class_names;
    plain int64 labels with class_names=None). Images are a class-coloured square on noise, so a model can learn
    them: class k has its own colour and place (classes k and k + 10 look alike)."""
    import datasets

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(class_names or range(10)), n) if labels is None else np.asarray(labels)
    images = []
    for label in labels:
        arr = rng.integers(0, 80, (size[1], size[0], 3), dtype=np.uint8)
        k = int(label) % 10
        arr[(k % 5) * 5:(k % 5) * 5 + 12, (k // 5) * 14:(k // 5) * 14 + 12] = (k * 25, 255 - k * 25, 128 + k * 12)
        im = Image.fromarray(arr).convert(mode)
        buf = io.BytesIO()
        im.save(buf, format=fmt)
        images.append({"bytes": buf.getvalue(), "path": None})
    label = datasets.ClassLabel(names=list(class_names)) if class_names else datasets.Value("int64")
    features = datasets.Features({columns[0]: datasets.Image(), columns[1]: label})
    datasets.Dataset.from_dict({columns[0]: images, columns[1]: labels.tolist()}, features=features).to_parquet(
        str(path))
    return path


def encoded_rows(images: list, split: str = "train"):
    """utils.data.sources.Rows over encoded images (bytes or file paths) in a datasets table, labelled 0 .. n-1, as
    a parquet file's or an image folder's rows are read."""
    import datasets

    from utils.data.sources import read_rows

    cells = [{"bytes": im, "path": None} if isinstance(im, bytes) else {"bytes": None, "path": str(im)}
             for im in images]
    features = datasets.Features({"image": datasets.Image(decode=False), "label": datasets.Value("int64")})
    return read_rows(datasets.Dataset.from_dict({"image": cells, "label": list(range(len(images)))}, features=features),
                     split, (None, None))


def write_image_folder(root: Path, classes, size=(32, 32), mode: str = "RGB") -> Path:
    """An image folder (train/<class>/0.png, test/<class>/0.png) with one plain image per class and split."""
    for split in ("train", "test"):
        for k, name in enumerate(classes):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            Image.new(mode, size, color=k * 20).save(root / split / name / "0.png")
    return root


def write_mixed_folder(root: Path) -> Path:
    """3 classes; per split one 20x20 grayscale, one 40x30 RGBA and one 64x64 RGB image of each class."""
    for split in ("train", "test"):
        for k, name in enumerate(("ant", "bee", "cow")):
            folder = root / split / name
            folder.mkdir(parents=True)
            Image.new("L", (20, 20), 60 * k).save(folder / "gray.png")
            Image.new("RGBA", (40, 30), (60 * k, 10, 200, 128)).save(folder / "alpha.png")
            Image.new("RGB", (64, 64), (60 * k, 100, 50)).save(folder / "rgb.jpg")
    return root


def export_png_folder(root, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], split_names=None) -> None:
    """CIFAR-10 images (label k: CIFAR_CLASSES[k]) as lossless PNGs in <split>/<class name>/<row>.png."""
    for split, (images, labels) in pairs.items():
        for row, (image, label) in enumerate(zip(images, labels.tolist())):
            folder = root / (split_names or {}).get(split, split) / CIFAR_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{row:05d}.png")


def digests(images: torch.Tensor, labels: torch.Tensor) -> list[tuple[int, str]]:
    """Each (label, sha256 of the pixels), sorted: equal for the same (image, label) pairs in any order."""
    return sorted((label, hashlib.sha256(image.permute(1, 2, 0).contiguous().numpy().tobytes()).hexdigest())
                  for image, label in zip(images, labels.tolist()))


def write_cifar_dir(root: Path, n_train: int = 256, n_test: int = 64, **kwargs) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_parquet(root / "train-00000-of-00001.parquet", n_train, seed=1, **kwargs)
    write_parquet(root / "test-00000-of-00001.parquet", n_test, seed=2, **kwargs)
    return root


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """The real CIFAR-10 copy: $TEST_DATA_DIR, else the one beside the checkout (CI has it); else generated learnable
    stand-ins."""
    for real in (os.environ.get("TEST_DATA_DIR"), SHARED_CIFAR):
        if real and (Path(real) / "train-00000-of-00001.parquet").exists():
            return Path(real)
    return write_cifar_dir(tmp_path_factory.mktemp("cifar"), n_train=8192, n_test=2000)


def oriented_exif(tag: int) -> bytes:
    """An EXIF block holding only the orientation `tag` (1-8), as a camera writes it."""
    exif = Image.Exif()
    exif[0x0112] = tag
    return exif.tobytes()


def write_upscaled_cifar(root: Path, cifar: Path, n_train: int = 192, n_test: int = 48, sizes=(96, 112, 128),
                         parquet_shards: int = 0, test_shards: int = 1, photos: int = 0, grain: float = 0.0) -> Path:
    """Natural-image stand-ins from the CIFAR-10 copy: its first images upscaled (bicubic) to one of `sizes` by row
    (a side: square, and 16 px less high for every third image; or a (width, height) pair) and saved as JPEGs
    (quality 90), as an image folder (train/<class>/<row>.jpg, test/...) or, with parquet_shards, as that many
    train-*.parquet shards (and test_shards test-*.parquet files) in the Hub's schema. photos: every that-many-th
    image (from the first) is stored as a phone stores a photo it took held sideways: its pixels rotated, with EXIF
    orientation 6, so that it shows as the others do. grain: the standard deviation of a sensor-like noise added
    (one draw per pixel, to all three channels), so that camera-size JPEGs are about as large as a camera's."""
    import datasets

    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        ds = datasets.load_dataset("parquet", data_files=str(cifar / f"{split}-00000-of-00001.parquet"),
                                   split="train").select(range(n))
        images, labels = [], ds["label"]
        for row, (image, label) in enumerate(zip(ds["img"], labels)):
            side = sizes[row % len(sizes)]
            size = side if isinstance(side, tuple) else (side, side - 16 * (row % 3 == 2))
            im, exif = image.convert("RGB").resize(size, Image.Resampling.BICUBIC), {}
            if grain:
                noise = np.random.default_rng(row).normal(0, grain, (size[1], size[0], 1)).astype(np.float32)
                im = Image.fromarray((np.asarray(im, dtype=np.float32) + noise).clip(0, 255).astype(np.uint8))
            if photos and row % photos == 0:  # shown upright: ROTATE_270 of the stored pixels
                im, exif = im.transpose(Image.Transpose.ROTATE_90), {"exif": oriented_exif(6)}
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90, **exif)
            if parquet_shards:
                images.append({"bytes": buf.getvalue(), "path": None})
            else:
                (root / split / CIFAR_CLASSES[label]).mkdir(parents=True, exist_ok=True)
                (root / split / CIFAR_CLASSES[label] / f"{row:05d}.jpg").write_bytes(buf.getvalue())
        if parquet_shards:
            features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(
                names=list(CIFAR_CLASSES))})
            table = datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)
            shards = parquet_shards if split == "train" else test_shards
            for k in range(shards):
                table.shard(shards, k, contiguous=True).to_parquet(
                    str(root / f"{split}-{k:05d}-of-{shards:05d}.parquet"))
    return root


@pytest.fixture(scope="session")
def jpeg_folder(cifar_dir, tmp_path_factory) -> Path:
    """write_upscaled_cifar's image folder: 192 training and 48 test JPEGs of 96-128 px."""
    return write_upscaled_cifar(tmp_path_factory.mktemp("jpegs"), cifar_dir)


@pytest.fixture(scope="session")
def jpeg_parquet(cifar_dir, tmp_path_factory) -> Path:
    """The same images as jpeg_folder's in 3 train-*.parquet shards (a count that divides neither 2 nor 4) and one
    test file."""
    return write_upscaled_cifar(tmp_path_factory.mktemp("jpeg-parquet"), cifar_dir, parquet_shards=3)


def add_tar_sample(tar: tarfile.TarFile, key: str, ext: str, image: bytes, label: int) -> None:
    """One webdataset sample: KEY.<ext> (the image's bytes) and KEY.cls (its label as text)."""
    for name, blob in ((f"{key}.{ext}", image), (f"{key}.cls", str(label).encode())):
        add_tar_sample_file(tar, name, blob)


def add_tar_sample_file(tar: tarfile.TarFile, name: str, blob: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(blob)
    tar.addfile(info, io.BytesIO(blob))


def write_tar_shards(root: Path, parquet_dir: Path) -> Path:
    """Each *.parquet shard of parquet_dir (write_upscaled_cifar's) as a webdataset tar of the same name and rows:
    KEY.jpg (the JPEG's bytes) and KEY.cls (its label), KEY the split and row."""
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    for shard in sorted(parquet_dir.glob("*.parquet")):
        table = pq.read_table(shard)
        with tarfile.open(root / f"{shard.stem}.tar", "w") as tar:
            images, labels = table.column("img").to_pylist(), table.column("label").to_pylist()
            for row, (image, label) in enumerate(zip(images, labels)):
                add_tar_sample(tar, f"{shard.stem.split('-')[0]}{row:05d}", "jpg", image["bytes"], label)
    return root


@pytest.fixture(scope="session")
def stream_shards(cifar_dir, tmp_path_factory) -> dict[str, Path]:
    """jpeg_folder's images as 5 train shards (39, 39, 38, 38, 38 rows: a count that divides neither 2 nor 4) and 3
    test shards (16 rows each), twice: parquet ('parquet') and webdataset tars of the same rows ('tar')."""
    parquet = write_upscaled_cifar(tmp_path_factory.mktemp("stream-parquet"), cifar_dir, parquet_shards=5,
                                   test_shards=3)
    return {"parquet": parquet, "tar": write_tar_shards(tmp_path_factory.mktemp("stream-tar"), parquet)}


def write_cifar_tars(root: Path, cifar: Path, n_train: int, n_test: int, by_class: bool, shards: int = 10) -> Path:
    """The first n_train training and n_test test images of the CIFAR-10 copy as webdataset tars (KEY.png, the
    copy's own PNG bytes, and KEY.cls): `shards` training shards holding the rows sorted by class (by_class: each
    shard about one class, as converting an image folder writes them) or in the copy's own (shuffled) order, and
    two test shards."""
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    for split, n, count in (("train", n_train, shards), ("test", n_test, 2)):
        table = pq.read_table(cifar / f"{split}-00000-of-00001.parquet").slice(0, n)
        images, labels = table.column("img").to_pylist(), table.column("label").to_pylist()
        order = np.argsort(labels, kind="stable") if by_class and split == "train" else np.arange(len(labels))
        for k, part in enumerate(np.array_split(order, count)):
            with tarfile.open(root / f"cifar-{split}-{k:05d}.tar", "w") as tar:
                for row in part.tolist():
                    add_tar_sample(tar, f"{split}{row:05d}", "png", images[row]["bytes"], labels[row])
    return root


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """http.server's file handler, answering byte ranges (Range: bytes=A-B, A- or -N) as object stores do."""

    def end_headers(self):
        self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def send_head(self):
        wanted = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if not wanted or not path.is_file():
            return super().send_head()
        data = path.read_bytes()
        first, last = wanted.removeprefix("bytes=").split("-")
        first, last = (int(first), int(last or len(data) - 1)) if first else (len(data) - int(last), len(data) - 1)
        part = data[first:last + 1]
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {first}-{first + len(part) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        return io.BytesIO(part)

    def log_message(self, *args):
        pass


class FlakyRangeHandler(RangeHandler):
    """RangeHandler that counts the bytes of the .tar files it sends and fails requests as its server's `state`
    says: with every = n, every n-th request fails, the first time it comes (asked again, it is answered, so each
    request succeeds within a few tries), the way `fault` says: "refuse" answers 503, "cut" sends the headers and
    half the body, then closes the connection, "stall" answers nothing for `stall` seconds, then closes it. Every
    request for a file named in `broken` is answered 503, and with `always`, every request."""

    state: dict

    def send_head(self):
        state, key = self.state, (self.command, self.path, self.headers.get("Range"))
        with state["lock"]:
            state["requests"] += 1
            state["log"].append((self.command, self.path))
            fail = state["always"] or Path(self.path).name in state["broken"] or (
                state["every"] and state["requests"] % state["every"] == 0 and key not in state["refused"])
            if fail:
                state["refused"].add(key)
        faulty = fail and not state["always"] and Path(self.path).name not in state["broken"]  # else: a 503
        self.cut = faulty and state["fault"] == "cut"
        if fail and not self.cut:
            if faulty and state["fault"] == "stall":
                time.sleep(state["stall"])
                self.close_connection = True
                return None
            self.send_error(503)
            return None
        return super().send_head()

    def copyfile(self, source, outputfile):
        data = source.read()
        try:
            outputfile.write(data[:len(data) // 2] if self.cut else data)
        except (BrokenPipeError, ConnectionResetError):  # a client that stopped reading (fsspec's size probe)
            return
        if self.cut:
            self.close_connection = True
            return
        if self.path.endswith(".tar"):
            with self.state["lock"]:
                self.state["tar_bytes"] += len(data)


@contextlib.contextmanager
def serving(folder: Path, every: int = 0, broken: tuple[str, ...] = (), fault: str = "refuse", stall: float = 0.0,
            always: bool = False):
    """folder served over HTTP from this process by FlakyRangeHandler: (its URL, the server's state)."""
    state = {"lock": threading.Lock(), "requests": 0, "tar_bytes": 0, "refused": set(), "every": every,
             "broken": set(broken), "log": [], "fault": fault, "stall": stall, "always": always}
    handler = functools.partial(type("Handler", (FlakyRangeHandler,), {"state": state}), directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def http_shards(stream_shards):
    """stream_shards' tar folder served over HTTP from this process (byte ranges answered): its URL."""
    handler = functools.partial(RangeHandler, directory=str(stream_shards["tar"]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One decoded-tensor cache for the whole session: the first run decodes, the rest load. $TEST_CACHE_DIR shares
    one with other programs (bench/gpu_check.sh: the tests and the benchmarks decode CIFAR-10 once)."""
    shared = os.environ.get("TEST_CACHE_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("decoded")


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str):
    """A real filesystem with a real size limit mounted at folder (needs root, as in CI); skips the test otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def script_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WANDB_"))}
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1"})
    env.update(extra)
    return env


_FORK_SERVER: subprocess.Popen | None = None
_UNREAD = b""  # what the fork server wrote that _answer has not taken yet
_ENDED: dict[int, int] = {}  # the fork server's children that have ended: pid -> exit status


def _fork_server() -> subprocess.Popen:
    global _FORK_SERVER, _UNREAD
    if _FORK_SERVER is None or _FORK_SERVER.poll() is not None:
        _FORK_SERVER = subprocess.Popen([sys.executable, str(REPO / "tests" / "forked.py")], cwd=REPO,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        _UNREAD = b""
    return _FORK_SERVER


def _answer(deadline: float) -> tuple[str, int] | None:
    """The fork server's next answer: ("started", pid); an ended child's status goes to _ENDED and ("ended", pid)
    is returned. None if no answer has come by the deadline."""
    global _UNREAD
    server = _fork_server()
    while b"\n" not in _UNREAD:
        if not select.select([server.stdout], [], [], max(0.0, deadline - time.time()))[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 1 << 16)
        assert chunk, "the test fork server died"
        _UNREAD += chunk
    line, _UNREAD = _UNREAD.split(b"\n", 1)
    kind, pid, *status = line.decode().split()
    if kind == "ended":
        _ENDED[int(pid)] = int(status[0])
    return kind, int(pid)


LAUNCHER = ["-m", "accelerate.commands.launch"]  # `accelerate launch`, as `python` arguments


def launch_argv(launch: list[str], script: Path, args: list[str]) -> list[str]:
    """`accelerate launch <launch> --main_process_port 0 SCRIPT ARGS` (a free port) as `python` arguments."""
    return [*LAUNCHER, *launch, "--main_process_port", "0", str(script), *args]


class Forked:
    """`python <argv>` in the repository, started in the background in a fresh process forked from tests/forked.py,
    which has imported torch and accelerate already (its docstring says why, and when that is the same): what the
    tests use of subprocess.Popen (text mode, stdout and stderr captured). When argv is `-m accelerate.commands.launch
    ...` (launch_argv), the launcher's workers are forked too, except with CUDA (forked.py says why)."""

    def __init__(self, argv: list[str], env: dict):
        self._tmp = tempfile.TemporaryDirectory()
        out, err = Path(self._tmp.name, "stdout"), Path(self._tmp.name, "stderr")
        out.touch()
        err.touch()
        self.args, self.returncode = argv, None
        self.stdout, self.stderr = out.open(), err.open()
        request = {"argv": argv, "env": env, "cwd": str(REPO), "stdout": str(out), "stderr": str(err),
                   "fork_workers": argv[:2] == LAUNCHER and not CUDA}
        _fork_server().stdin.write((json.dumps(request) + "\n").encode())
        deadline = time.time() + 120
        while (answer := _answer(deadline)) is not None and answer[0] != "started":
            pass
        assert answer is not None, "the test fork server did not answer"
        self.pid = answer[1]

    def poll(self) -> int | None:
        return self.wait(0.0, raise_timeout=False)

    def wait(self, timeout: float | None = None, raise_timeout: bool = True) -> int | None:
        deadline = time.time() + (1e9 if timeout is None else timeout)
        while self.returncode is None:
            if self.pid in _ENDED:
                self.returncode = _ENDED.pop(self.pid)
            elif _answer(deadline) is None:
                if raise_timeout:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                break
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()

    def __del__(self):
        self.stdout.close()
        self.stderr.close()


def run_python(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python <argv>` run to its end as a Forked process; on a timeout the process and what it started are killed."""
    proc = Forked(argv, env)
    try:
        proc.wait(timeout)
    except BaseException as e:  # the timeout, or pytest-timeout's
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started (forked.run made it a group)
        if isinstance(e, subprocess.TimeoutExpired):
            e.output, e.stderr = proc.stdout.read(), proc.stderr.read()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, proc.stdout.read(), proc.stderr.read())


def pytest_unconfigure(config):
    if _FORK_SERVER is not None:  # end of input: the server leaves its loop and exits
        _FORK_SERVER.stdin.close()
        _FORK_SERVER.wait(timeout=60)
        _FORK_SERVER.stdout.close()


def run_train(args: list[str], launch: list[str] | None = None, env: dict | None = None, timeout: int = 600,
              script: Path = REPO / "train_cifar.py", fork: bool = True):
    """train_cifar.py (or the probe around it) in real processes: plain `python`, or `accelerate launch <launch>`
    with a free port. The launcher is forked from tests/forked.py, and without CUDA so are its workers (its docstring
    says what is the same and what differs). A one-process run is forked too, unless fork=False: a fresh interpreter,
    as the user's would be (tests/test_distributed.py's ddp_jobs, whose one-process runs are compared bitwise with
    forked 2-rank jobs: the evidence that forking changes no number)."""
    argv = [str(script), *args] if launch is None else launch_argv(launch, script, args)
    if launch is not None or fork:
        return run_python(argv, env or script_env(), timeout)
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env or script_env(), capture_output=True, text=True,
                          timeout=timeout)


def evaluate_weights(weights: Path, *extra) -> dict:
    """evaluate_checkpoint.py on `weights` in a process of its own: its JSON line."""
    result = run_python([str(REPO / "evaluate_checkpoint.py"), str(weights), *extra], script_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def read_summary(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "summary.json").read_text())


def start(args, launch: list[str], script: Path = REPO / "train_cifar.py", env=None) -> Forked:
    """A launched job in the background (for signals and kills): `accelerate launch <launch>` with a free port, forked
    as run_train's are (workers() finds its workers)."""
    return Forked(launch_argv(launch, script, args), env or script_env())


def wait_for_checkpoint(out: Path, proc: Forked, step: int, timeout: float = 300) -> None:
    done = out / "checkpoints" / f"step-{step:08d}" / "trainer_state.json"
    deadline = time.time() + timeout
    while not done.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def kill_job(proc: Forked) -> None:
    """kill -9 of every process of a launched job, launcher and workers (which run in sessions of their own), as a
    node loss would; returns once they are gone."""
    job = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    for process in job:
        process.kill()
    proc.wait()
    psutil.wait_procs(job, timeout=10)


def workers(proc: Forked) -> dict[int, psutil.Process]:
    """The training processes of a launched job (torchrun's workers) by rank: forked ones by the name tests/forked.py
    gives them (rankN), started ones by their command line and RANK."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=False):
        if child.name().startswith("rank"):
            found[int(child.name()[4:])] = child
        elif any(name in " ".join(child.cmdline()) for name in ("train_cifar.py", "probe_train.py", "train_vit.py")):
            found[int(child.environ()["RANK"])] = child
    return found


def assert_same_state(a: Path, b: Path) -> None:
    sa, sb = load_file(a), load_file(b)
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


# The checkpoint/resume job (tests/test_checkpoint.py, tests/test_fsdp.py, tests/test_ema.py): 256 images, micro-batch
# 16, global batch 32 (2 processes x 1 or 1 process x 2 accumulation steps) -> 8 optimizer steps per epoch, 2 epochs, a
# checkpoint and an evaluation of the weights and their EMA (decay 0.9) on 50 test images every 3 steps (and at each
# epoch's end), mixup and cutmix (the mixing drawn per image, so resume stays exact), NCHW (the layout
# evaluate_checkpoint.py and FSDP2 use), train/loss logged at every step. SGD at lr 0.01 without clipping:
# tests/test_fsdp.py's docstring says why FSDP's comparison with DDP needs both.
CHECKPOINT_JOB = ["--model", "resnet8", "--train-subset", "256", "--eval-subset", "50",
                  "--batch-size", "16", "--global-batch-size", "32", "--epochs", "2", "--checkpoint-every-steps", "3",
                  "--eval-every-steps", "3", "--ema-decay", "0.9", "--mixup", "0.2", "--cutmix", "1.0",
                  "--deterministic", "--tracker", "none",
                  "--lr", "0.01", "--grad-clip", "0", "--log-every", "1", "--no-channels-last"]
# Tensors of the reference job's state recorded after every optimizer step (tests/test_ema.py): a convolution, the
# stem's BatchNorm statistics, a late BatchNorm's weight and the head.
RECORDED_WEIGHTS = ["conv1.weight", "bn1.running_mean", "bn1.running_var", "layer3.0.bn2.weight", "fc.weight",
                    "fc.bias"]


@pytest.fixture(scope="session")
def reference(cifar_dir, cache_dir, tmp_path_factory) -> Path:
    """The checkpoint job on 2 gloo ranks (cpu.yaml, fp32), uninterrupted, through tests/probe_train.py: the run
    every resumed run must reproduce (tests/test_checkpoint.py), and DDP's side of the FSDP comparison
    (tests/test_fsdp.py)."""
    out = tmp_path_factory.mktemp("reference")
    result = run_train(job_args(cifar_dir, cache_dir, out, *CHECKPOINT_JOB), launch=["--config_file", str(CPU_YAML)],
                       script=PROBE, env=script_env(PROBE_RECORD_WEIGHTS=",".join(RECORDED_WEIGHTS)))
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def assert_same_parameters(a: Path, b: Path, atol: float = 0.0, file: str = "model.safetensors") -> None:
    """The trainable parameters of two runs' exported weights (`file`: model.safetensors, or the EMA's
    model_ema.safetensors) are bitwise equal, or within atol (not BatchNorm's running statistics: under DDP they are
    rank 0's, from its micro-batches only, so they differ between process counts by design)."""
    sa, sb = load_file(Path(a) / file), load_file(Path(b) / file)
    model = json.loads((Path(a) / "summary.json").read_text())["model"]["name"]
    names = [n for n, _ in named_model(model).named_parameters()]
    differ = [n for n in names if not torch.allclose(sa[n], sb[n], rtol=0, atol=atol)]
    assert not differ, f"{len(differ)} of {len(names)} parameters differ, e.g. {differ[:3]}"


def job_args(cifar_dir, cache_dir, out, *extra) -> list[str]:
    return ["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out), *extra]


TRACKED_JOB = ["--model", "resnet8", "--train-subset", "256", "--eval-subset", "64",
               "--batch-size", "16", "--global-batch-size", "32", "--epochs", "2", "--log-every", "2", "--tracker",
               "wandb"]


@pytest.fixture(scope="session")
def tracked_runs(cifar_dir, cache_dir, tmp_path_factory) -> dict[str, Path]:
    """Three offline W&B runs (resnet8, 256 training / 64 test images, micro-batch 16, global batch 32 -> 8
    steps per epoch, 2 epochs, log every 2 steps):
      a0  1 process, lr 0.05, seed 0, --group A
      a1  1 process, lr 0.05, seed 1, group A from $WANDB_RUN_GROUP (W&B's own variables keep working)
      b   2 processes (cpu.yaml), lr 0.2, --group B, --run-name b-run, --tags x,y, --progress-every 0, --profile,
          --wandb-log-model checkpoints
    Each run's stdout is kept in <run>/stdout.txt."""
    root = tmp_path_factory.mktemp("tracked")
    specs = {"a0": (["--lr", "0.05", "--group", "A"], None, {}),
             "a1": (["--lr", "0.05", "--seed", "1"], None, {"WANDB_RUN_GROUP": "A"}),
             "b": (["--lr", "0.2", "--group", "B", "--run-name", "b-run", "--tags", "x,y",
                    "--progress-every", "0", "--profile", "--wandb-log-model", "checkpoints"],
                   ["--config_file", str(CPU_YAML)], {})}
    out = {}
    for name, (extra, launch, env) in specs.items():
        out[name] = root / name
        result = run_train(["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out[name]),
                            *TRACKED_JOB, *extra], launch=launch, env=script_env(**env))
        assert result.returncode == 0, result.stderr[-3000:]
        (out[name] / "stdout.txt").write_text(result.stdout)
    return out


def metric_script(name: str, compute: str, imports: str = "") -> str:
    """The text of a local `evaluate` metric script (what `evaluate.load(path)` and --metric PATH take) on class
    predictions: class `name`, whose _compute is `compute` (its def and body, indented as a method); `imports`: what
    that body needs besides datasets and evaluate."""
    return (f"{imports}import datasets\nimport evaluate\n\n\nclass {name}(evaluate.Metric):\n"
            f"    def _info(self):\n"
            f"        features = {{'predictions': datasets.Value('int64'), 'references': datasets.Value('int64')}}\n"
            f"        return evaluate.MetricInfo(description={name!r}, citation='', inputs_description='',\n"
            f"                                   features=datasets.Features(features))\n"
            f"\n{compute}")


def kill_9_after_checkpoint(args: list[str], launch: list[str], script: Path, env: dict, out: Path,
                            step: int = 3) -> None:
    """Starts the job, kills every process of it with kill -9 once its step-`step` checkpoint is written, and checks
    that it left no summary.json (it was killed before its end)."""
    proc = start(args, launch, script=script, env=env)
    wait_for_checkpoint(out, proc, step)
    kill_job(proc)
    assert not (out / "summary.json").exists()
