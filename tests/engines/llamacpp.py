"""llama.cpp's ``llama-server`` for the tests, built once per machine and cached outside the clone.

Source: the llama.cpp tree vendored in the ``llama-cpp-python`` source distribution on PyPI, pinned by
version and sha256 (PyPI is the one source of llama.cpp this machine and CI can reach; the sdist
carries llama.cpp's own CMake project under ``vendor/llama.cpp``). Built for the CPU, the server
target only, with the host's ``cmake`` (Debian's on the build machines); nothing in the build
reaches the network (the prebuilt web UI download is off).

    ~/.cache/noctaya-engines/llama.cpp-<llama-cpp-python version>/bin/llama-server

``NOCTAYA_ENGINE_CACHE`` moves the cache. One build at a time per cache (a lock file beside it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from tests.third_party import BuildFailed, ThirdPartyUnavailable

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-python/"
BUILD_TIMEOUT_SECONDS = 3600
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
    "-DGGML_NATIVE=OFF",  # the same code whatever CPU the cache was filled on
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI, no download while configuring
]


def cache_dir() -> Path:
    override = os.environ.get("NOCTAYA_ENGINE_CACHE")
    base = Path(override) if override else Path.home() / ".cache" / "noctaya-engines"
    return base / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def binary_path() -> Path:
    return cache_dir() / "bin" / "llama-server"


def _sdist_url() -> str:
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        index = json.load(answer)
    for entry in index["files"]:
        if entry["filename"] == SDIST:
            return entry["url"]
    raise BuildFailed(f"{SDIST} is not in PyPI's index for llama-cpp-python")


def _download(target: Path) -> Path:
    if target.exists() and _sha256(target) == SDIST_SHA256:
        return target
    partial = target.with_suffix(".partial")
    try:
        with urllib.request.urlopen(_sdist_url(), timeout=120) as answer, open(partial, "wb") as out:
            shutil.copyfileobj(answer, out, 1 << 20)
    except OSError as exc:
        raise BuildFailed(f"downloading {SDIST} from PyPI failed: {exc}") from None
    digest = _sha256(partial)
    if digest != SDIST_SHA256:
        partial.unlink()
        raise BuildFailed(f"{SDIST}: sha256 {digest}, pinned {SDIST_SHA256}")
    os.replace(partial, target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unpack(sdist: Path, into: Path) -> Path:
    """Only the vendored llama.cpp tree (the Python bindings are not needed)."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    shutil.rmtree(into, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(into, members=members, filter="data")
    return into / prefix


def _run(argv: list[str], cwd: Path) -> None:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS,
                             check=False)
    except subprocess.TimeoutExpired:
        raise BuildFailed(f"`{' '.join(argv[:4])}` took over {BUILD_TIMEOUT_SECONDS}s") from None
    if out.returncode != 0:
        raise BuildFailed(f"`{' '.join(argv[:4])}` failed: {(out.stderr or out.stdout).strip()[-800:]}")


def llama_server() -> Path:
    """The cached ``llama-server``, built first if need be. Raises ThirdPartyUnavailable (no cmake or
    no C++ compiler) or BuildFailed (a step failed, named in the message)."""
    binary = binary_path()
    if binary.exists():
        return binary
    cmake = shutil.which("cmake")
    if cmake is None:
        raise ThirdPartyUnavailable("cmake not found: needed to build llama-server (apt-get install cmake)")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise ThirdPartyUnavailable("no C++ compiler: needed to build llama-server (apt-get install g++)")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building it: wait, then find it built
        if binary.exists():
            return binary
        started = time.monotonic()
        source = _unpack(_download(root / SDIST), root / "src")
        build = root / "build"
        shutil.rmtree(build, ignore_errors=True)
        _run([cmake, "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], cwd=root)
        _run([cmake, "--build", str(build), "--target", "llama-server", "--parallel", str(os.cpu_count() or 2)],
             cwd=root)
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise BuildFailed(f"the build finished without {built}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, f"{binary}.tmp")
        os.replace(f"{binary}.tmp", binary)
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(root / "src", ignore_errors=True)
    print(f"built llama-server in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return binary


if __name__ == "__main__":
    print(llama_server())
