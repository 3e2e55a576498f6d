"""Build frugal_kernels._C with CMake and Ninja.

Environment variables:
  FRUGAL_CUDA=auto|0|1        build the CUDA kernels when CMake finds nvcc (auto:
                              a warning without it), never (0), or fail without it (1)
  FRUGAL_CUDA_ARCHS="80;90"   CUDA architectures; PTX is embedded for the newest
  FRUGAL_CPU_ISA=all|baseline CPU ISA levels compiled (all: every level of the
                              architecture, picked at run time)
  FRUGAL_BUILD_TYPE=Release   CMake build type
  FRUGAL_BUILD_JOBS=N         parallel compile jobs
"""

import os
import subprocess
import sys
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

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)

        # CMakeLists.txt alone decides whether CUDA is built (it looks for nvcc).
        config = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('FRUGAL_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DFRUGAL_CUDA={os.environ.get('FRUGAL_CUDA', 'auto')}",
            f"-DFRUGAL_CUDA_ARCHS={os.environ.get('FRUGAL_CUDA_ARCHS', '80;90')}",
            f"-DFRUGAL_CPU_ISA={os.environ.get('FRUGAL_CPU_ISA', 'all')}",
        ]
        subprocess.run(config, check=True)
        build = ["cmake", "--build", str(build_dir)]
        jobs = os.environ.get("FRUGAL_BUILD_JOBS")
        if jobs:
            build += ["-j", jobs]
        subprocess.run(build, check=True)


setup(
    ext_modules=[CMakeExtension("frugal_kernels._C")],
    cmdclass={"build_ext": CMakeBuild},
)
