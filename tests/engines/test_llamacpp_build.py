"""What building llama-server needs from the machine (tests/engines/llamacpp.py), without building it:

- CMake is the one pinned in requirements-dev.txt, from PyPI, ahead of any host ``cmake`` on PATH; the
  host's only when that package is missing, and neither is a failure that says what to install;
- a machine without a C++ compiler fails the set-up step (``python -m tests.setup test`` exits 1 naming
  the step and what to install) before anything is downloaded: not a skip;
- with a compiler and make on PATH, or $CXX naming one, nothing is missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import setup
from tests.engines import llamacpp
from tests.third_party import BuildFailed

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements-dev.txt"


def programs(directory: Path, *names: str) -> Path:
    """A PATH directory holding only ``names``, each a program that does nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        program = directory / name
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o755)
    return directory


@pytest.fixture
def bare_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No llama-server in a fresh cache; PATH an empty directory; no CC, CXX or CMAKE_GENERATOR."""
    monkeypatch.setenv("NOCTAYA_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(programs(tmp_path / "bin")))
    for variable in ("CC", "CXX", "CMAKE_GENERATOR"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path / "bin"


def test_the_pinned_cmake_from_pypi_comes_before_the_hosts(bare_machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cmake

    programs(bare_machine, "cmake")
    chosen = llamacpp.cmake_program()
    assert chosen == str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    pin = re.search(r"^cmake==(\S+)", REQUIREMENTS.read_text(), re.M)
    version = subprocess.run([chosen, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    assert pin and f"cmake version {pin.group(1)}\n" in version, (pin, version)

    monkeypatch.setitem(sys.modules, "cmake", None)  # the package not installed
    assert llamacpp.cmake_program() == str(bare_machine / "cmake")
    (bare_machine / "cmake").unlink()
    with pytest.raises(BuildFailed, match=r"cmake not found.*pip install -r requirements-dev\.txt"):
        llamacpp.cmake_program()


def test_no_cxx_compiler_fails_the_setup_step_naming_what_to_install(
        bare_machine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    programs(bare_machine, "cc", "make")  # a C compiler and make, no C++ compiler
    step = next(s for s in setup.STEPS if s.name == "llama-server")
    monkeypatch.setattr(setup, "steps_for_target", lambda target: [step])
    assert setup.main(["test"]) == 1
    err = capsys.readouterr().err
    assert "FAILED: set-up step 'llama-server'" in err, err
    assert "no C++ compiler (none of c++, g++, clang++ on PATH)" in err and "apt-get install g++ (" in err, err
    assert "C compiler (" not in err and "no make" not in err and "skipped" not in err, err
    assert not llamacpp.cache_dir().exists(), "nothing downloaded or unpacked before the check"


def test_every_missing_tool_is_named_with_its_package(bare_machine: Path) -> None:
    with pytest.raises(BuildFailed) as failed:
        llamacpp.llama_server()
    message = str(failed.value)
    for what in ("no C compiler", "no C++ compiler", "no make"):
        assert what in message, message
    assert "apt-get install g++ make (" in message, message


def test_compilers_and_make_on_path_or_named_by_cc_and_cxx_are_found(bare_machine: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    programs(bare_machine, "gcc", "clang++", "make")
    assert llamacpp.missing_build_tools() == {}
    monkeypatch.setenv("CXX", "g++-14 -O2")
    assert llamacpp.missing_build_tools() == {"C++ compiler": "$CXX is 'g++-14', not found"}
    programs(bare_machine, "g++-14")
    assert llamacpp.missing_build_tools() == {}
