"""Build frugal_kernels._C with CMake and Ninja.

Environment variables:
  FRUGAL_CUDA=auto|0|1        build the CUDA kernels when CMake finds nvcc (auto:
                              a warning without it), never (0), or fail without it (1)
  FRUGAL_CUDA_ARCHS="80;90"   CUDA architectures; PTX is embedded for the newest
  FRUGAL_CPU_ISA=all|baseline CPU ISA levels compiled (all: every level of the
                              architecture, picked at run time)
  FRUGAL_BUILD_TYPE=Release   CMake build type
  FRUGAL_BUILD_JOBS=N         parallel compile jobs

The CMake build folder (build/cmake.<platform>-<python>) is the same for every way of
building from this tree (`pip install .`; `pip install -e .`, whose setuptools gives
build_ext a new temporary folder each time; `pip wheel .`; `setup.py build_ext`) and is
kept between them, so that a second install of the same tree compiles only what
changed. pip builds in a temporary environment whose cmake, ninja and pybind11 are
deleted afterwards, and CMake's cache keeps the path of the ninja it was configured
with: so every configure names the ninja found now (CMAKE_MAKE_PROGRAM), and pybind11
is copied into the build folder, so that the binding's compile commands, and with them
ninja's decisions, do not change from one environment to the next.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = cmake_build_dir(Path(self.build_temp).resolve() / "cmake")
        pybind11_dir = stable_pybind11(pybind11, build_dir)

        # CMakeLists.txt alone decides whether CUDA is built (it looks for nvcc).
        config = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('FRUGAL_BUILD_TYPE', 'Release')}",
            # Linked inside the build folder and copied to where setuptools wants it (a
            # new temporary folder at each editable install): a build with nothing to
            # compile then does not link again either (the link-time optimisation
            # pybind11 turns on makes the link the slowest step).
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build_dir / 'lib'}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11_dir}",
            f"-DFRUGAL_CUDA={os.environ.get('FRUGAL_CUDA', 'auto')}",
            f"-DFRUGAL_CUDA_ARCHS={os.environ.get('FRUGAL_CUDA_ARCHS', '80;90')}",
            f"-DFRUGAL_CPU_ISA={os.environ.get('FRUGAL_CPU_ISA', 'all')}",
        ]
        ninja = shutil.which("ninja")
        if ninja is not None:
            # The ninja of this environment, not the one the cache remembers (which pip
            # may have deleted with its build environment).
            config.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
            if cached_program_gone(build_dir):
                say("frugal_kernels: the build folder's ninja is gone (an earlier pip build "
                    f"environment); configuring it with {ninja}")
        fresh = not (build_dir / "build.ninja").exists()
        say(f"frugal_kernels: {'compiling' if fresh else 'updating'} the C++ kernels "
            f"(CPU, and CUDA where nvcc is found) with CMake + Ninja in {build_dir}"
            + (": a first build takes 1 to 3 minutes on 2 cores for the CPU kernels, "
               "several more with CUDA (`pip install -v` shows each file)" if fresh else
               ": only what changed since the last build is compiled"))
        start = time.monotonic()
        subprocess.run(config, check=True)
        build = ["cmake", "--build", str(build_dir)]
        jobs = os.environ.get("FRUGAL_BUILD_JOBS")
        if jobs:
            build += ["-j", jobs]
        subprocess.run(build, check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "lib" / target.name, target)
        say(f"frugal_kernels: kernels built in {time.monotonic() - start:.0f} s")


def cmake_build_dir(fallback: Path) -> Path:
    """build/cmake.<platform>-<python> in the source tree, or ``fallback`` (setuptools'
    build_temp) where the tree is not writable."""
    tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    build_dir = ROOT / "build" / f"cmake.{tag}"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        build_dir = fallback
        build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


def say(line: str) -> None:
    """A line for the user; pip shows a build's output with -v (and on failure)."""
    print(line, file=sys.stderr, flush=True)


def cached_program_gone(build_dir: Path) -> bool:
    """Whether the build folder's CMake cache names a ninja that no longer exists (an
    earlier pip build environment's)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return False
    found = re.search(r"^CMAKE_MAKE_PROGRAM:[A-Z]+=(.+)$",
                      cache.read_text(errors="replace"), re.MULTILINE)
    return found is not None and not Path(found.group(1)).exists()


def stable_pybind11(pybind11, build_dir: Path) -> str:
    """pybind11's CMake folder, from a copy of the package kept in the build folder (one
    per version), so that its include path is the same in every build environment."""
    source = Path(pybind11.__file__).resolve().parent
    copy = build_dir / f"pybind11-{pybind11.__version__}"
    if not (copy / "__init__.py").exists():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    cmake_dir = Path(pybind11.get_cmake_dir()).resolve()
    return str(copy / cmake_dir.relative_to(source))


setup(
    ext_modules=[CMakeExtension("frugal_kernels._C")],
    cmdclass={"build_ext": CMakeBuild},
)
