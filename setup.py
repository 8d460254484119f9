# The PyTorch extension: the library's headers (include/) compiled into
# hisparse/_C, registered through LibTorch's stable ABI. The C++ core stays
# header-only and torch-free; only python/ depends on torch.
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

# The architectures the C++ build supports (CMakeLists.txt); set
# TORCH_CUDA_ARCH_LIST to build fewer (e.g. "9.0a" on an H100/H200 host).
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.9;9.0a")

here = os.path.dirname(os.path.abspath(__file__))
nvcc = [
    "-O3",
    "-std=c++20",
    # torch's defaults hide the half and bfloat16 operators the kernels use.
    "-DUSE_CUDA",  # declares the CUDA part of the stable C shim (the current stream)
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-DHISPARSE_EXTERN_TEMPLATES",
]

# nvcc's host compiler is the one that links the extension (torch would pass
# $CC, which may name another toolchain).
linker = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
if shutil.which(linker):
    nvcc += ["-ccbin", shutil.which(linker)]

# The ops throw C++ exceptions that torch catches and rethrows, so the
# extension must share torch's C++ runtime: the shared libstdc++ is named as
# a link input by its path, which binds the extension to it even where the
# compiler links a static copy by default (the GPU host's /opt/gcc/bin/g++
# does, and rewrites a plain -lstdc++ to the static one too; with a private
# copy the first exception an op threw crashed Python).
link = []
if shutil.which(linker):
    shared = subprocess.run([shutil.which(linker), "-print-file-name=libstdc++.so.6"], capture_output=True,
                            text=True).stdout.strip()
    if os.path.isabs(shared) and os.path.exists(shared):
        link.append(shared)
if not link:
    print(f"hisparse setup.py: WARNING: {linker} names no shared libstdc++.so.6; if it links libstdc++ "
          "statically, an op's exception will crash Python", file=sys.stderr)

# The standard kernel instances compile in their own files (so a parallel
# build splits them) and the ops' files declare them extern
# (HISPARSE_EXTERN_TEMPLATES); the fp8 one is not used. HISPARSE_INSTANCES
# names a CMake build directory whose instance libraries (built for every
# architecture, position-independent) are linked instead of compiled again:
# scripts/test.sh builds them just before.
sources = ["python/csrc/select_ops.cu", "python/csrc/cache_ops.cu"]
objects = []
prebuilt = os.environ.get("HISPARSE_INSTANCES")
if prebuilt:
    objects = [os.path.join(prebuilt, f"libhisparse_instances_{n}.a") for n in ("bf16", "rest")]
    missing = [o for o in objects if not os.path.exists(o)]
    if missing:
        sys.exit(f"hisparse setup.py: HISPARSE_INSTANCES={prebuilt} lacks {', '.join(missing)}")
else:
    sources += sorted(f"instances/{f}" for f in os.listdir(os.path.join(here, "instances")) if "fp8" not in f)

setup(
    packages=["hisparse"],
    package_dir={"": "python"},
    ext_modules=[
        CUDAExtension(
            "hisparse._C",
            sources=sources,
            extra_objects=objects,
            include_dirs=[os.path.join(here, "include")],
            extra_compile_args={"cxx": ["-O2", "-std=c++20"], "nvcc": nvcc},
            extra_link_args=link,
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
