"""llama.cpp's ``llama-server`` for the tests, built once per machine and cached outside the clone.

Source: the llama.cpp tree vendored in the ``llama-cpp-python`` source distribution on PyPI, pinned by
version and sha256 (PyPI is the one source of llama.cpp this machine and CI can reach; the sdist
carries llama.cpp's own CMake project under ``vendor/llama.cpp``). Built for the CPU, the server
target only; nothing in the build reaches the network (the prebuilt web UI download is off).

What the build needs from the machine:

- CMake: the ``cmake`` package from PyPI pinned in requirements-dev.txt (so the venv has it on every
  machine), found through its module's ``CMAKE_BIN_DIR``; the host's ``cmake`` on PATH only when that
  package is not installed (this module run outside the venv);
- a C and a C++ compiler and ``make`` (CMake's default generator), which PyPI does not provide: without
  them the build fails at once, naming what to install (``apt-get install g++ make`` on Debian), and so
  does the set-up step (``python -m tests.setup test|e2e`` exits 1), never a skip.

    ~/.cache/noctaya-engines/llama.cpp-<llama-cpp-python version>/bin/llama-server

The cache is keyed by the llama-cpp-python version only: a cached binary is kept when the CMake that
built it changes (the pin moves, or the host's was used), since CMake only drives the build; what the
binary is comes from the pinned sources, CMAKE_OPTIONS and the compiler. Delete the directory to
rebuild (after a compiler change, say). ``NOCTAYA_ENGINE_CACHE`` moves the cache. One build at a time
per cache (a lock file beside it).
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

from tests.third_party import BuildFailed

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


def cmake_program() -> str:
    """The pinned ``cmake`` from PyPI (requirements-dev.txt) when it is installed, else the host's."""
    try:
        import cmake  # the PyPI package: the CMake binaries in its data directory
    except ImportError:
        pass
    else:
        pinned = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if os.access(pinned, os.X_OK):
            return str(pinned)
    host = shutil.which("cmake")
    if host is None:
        raise BuildFailed("cmake not found: needed to build llama-server; install the pinned one from PyPI "
                          "(.venv/bin/pip install -r requirements-dev.txt)")
    return host


# What CMake looks for (its own search order, first found wins; $CC / $CXX first).
COMPILERS = {"C compiler": ("CC", ("cc", "gcc", "clang")), "C++ compiler": ("CXX", ("c++", "g++", "clang++"))}
DEBIAN_PACKAGE = {"C compiler": "g++", "C++ compiler": "g++", "make": "make"}  # g++ brings gcc


def missing_build_tools() -> dict[str, str]:
    """What the build needs from the machine and does not find on PATH: tool -> why it is missing."""
    missing = {}
    for what, (variable, names) in COMPILERS.items():
        chosen = os.environ.get(variable, "").split()
        if chosen and shutil.which(chosen[0]) is None:
            missing[what] = f"${variable} is {chosen[0]!r}, not found"
        elif not chosen and not any(shutil.which(name) for name in names):
            missing[what] = f"none of {', '.join(names)} on PATH"
    if os.environ.get("CMAKE_GENERATOR", "Unix Makefiles") == "Unix Makefiles" and shutil.which("make") is None:
        missing["make"] = "not on PATH; CMake's Unix Makefiles generator runs it"
    return missing


def _check_build_tools() -> None:
    missing = missing_build_tools()
    if missing:
        packages = " ".join(sorted({DEBIAN_PACKAGE[what] for what in missing}))
        reasons = "; ".join(f"no {what} ({why})" for what, why in missing.items())
        raise BuildFailed(f"cannot build llama-server: {reasons}. Install: apt-get install {packages} "
                          "(Debian, Ubuntu)")


def llama_server() -> Path:
    """The cached ``llama-server``, built first if need be. Raises BuildFailed naming the reason: no
    cmake, no C or C++ compiler or make (with what to install), or a step of the build that failed."""
    binary = binary_path()
    if binary.exists():
        return binary
    cmake = cmake_program()
    _check_build_tools()
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
