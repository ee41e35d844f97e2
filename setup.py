"""Builds coalesced_bcast._C: a CUDAExtension when torch has CUDA and nvcc is found, else a CppExtension.

Sources follow pytorch/extension-cpp: every csrc/*.cpp always, csrc/*.cu only in a CUDA build. The
package's metadata (name, version, dependencies, license) is in pyproject.toml; this file adds the
extension, built against the torch already installed, so the build runs without isolation
(`pip install --no-build-isolation --use-pep517 -e .`, as scripts/setup.sh does).
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import tempfile

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:  # an isolated build: pip's fresh environment holds no torch
    raise RuntimeError("coalesced_bcast builds against the installed torch: install torch first, then build "
                       "without isolation (pip install --no-build-isolation --use-pep517 -e .)") from e

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_cuda_home():
    """torch guesses /usr/local when nvcc is on PATH there, which has no cuda.h; prefer a real toolkit."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", cpp_extension.CUDA_HOME):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
                os.path.join(home, "include", "cuda.h")):
            return home
    return None


def wheel_include(package):
    """Headers that torch's CUDA headers need but a bare toolkit may lack (cusparse.h) ship in nvidia wheels."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [p for p in (os.path.join(d, "include") for d in spec.submodule_search_locations) if os.path.isdir(p)]


_PROBE = "#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n"


def links_libstdcxx_statically(compiler):
    """True when a shared object linked by `compiler` carries its own copy of libstdc++'s code.

    Links a one-function probe and looks for std::ostream::_M_insert<long>, which a plain g++ leaves
    to libstdc++.so.6. Such a copy built for another libstdc++ crashes against the one torch loads.
    """
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            subprocess.run([compiler, "-shared", "-fPIC", "-O1", src, "-o", lib], check=True, capture_output=True,
                           timeout=120)
            symbols = subprocess.run(["nm", "-C", "--defined-only", lib], check=True, capture_output=True, text=True,
                                     timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return False
    return "_M_insert<long>" in symbols


def pick_host_compiler():
    """Build with the system's g++ when CXX names one that links libstdc++ code into the extension.

    The GPU image (torch 2.11, Ubuntu 24.04) sets CC/CXX to /opt/gcc (Red Hat gcc 13.3.1), which puts
    libstdc++ code into the extension; run against Ubuntu's libstdc++.so.6 it crashed the process at
    the first `std::ostream << long` (every TORCH_CHECK message with a number: every error a SIGSEGV).
    COALESCED_BCAST_KEEP_CXX=1 keeps CC/CXX as they are.
    """
    cxx = os.environ.get("CXX")
    if not cxx or os.environ.get("COALESCED_BCAST_KEEP_CXX") == "1" or not links_libstdcxx_statically(cxx):
        return
    system_cxx, system_cc = shutil.which("g++", path="/usr/bin"), shutil.which("gcc", path="/usr/bin")
    if system_cxx is None or system_cc is None or links_libstdcxx_statically(system_cxx):
        print(f"coalesced_bcast: warning: {cxx} links parts of libstdc++ statically and no other g++ was found; "
              "the extension may crash when it formats an error message")
        return
    print(f"coalesced_bcast: building with {system_cxx} instead of CXX={cxx}, which links libstdc++ code into "
          "the extension (it crashes against the libstdc++.so.6 that torch loads)")
    os.environ["CXX"], os.environ["CC"] = system_cxx, system_cc


def nvcc_archs(cuda_home):
    """The compute capabilities this nvcc can compile for ("90", "100", ...); None if it cannot say."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {a.split("_", 1)[1] for a in out.split() if a.startswith("compute_")}


def wheel_archs():
    """The sm_XX that this torch's own kernels were built for (the wheel's list; no GPU needed)."""
    try:
        flags = torch._C._cuda_getArchFlags()  # torch.cuda.get_arch_list() is empty without a GPU on some versions
    except AttributeError:
        flags = " ".join(torch.cuda.get_arch_list())
    return [a.split("_", 1)[1] for a in (flags or "").split() if a.startswith("sm_")]


def default_cuda_arch_list(cuda_home):
    """TORCH_CUDA_ARCH_LIST for a build that did not set it, or None to leave the choice to torch.

    torch's cpp_extension builds for the GPUs visible at build time, which is what a user building on
    their own machine wants: left to it. Without a visible GPU (a CI or login node) it has nothing to
    choose from (torch 2.14 fails with an IndexError), so the build targets the architectures torch
    itself was built for, the ones its users can run, minus those this nvcc cannot compile, with PTX
    for the newest so that later GPUs can JIT it. An explicit TORCH_CUDA_ARCH_LIST always wins.
    """
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return None
    archs = wheel_archs()
    known = nvcc_archs(cuda_home)
    if known is not None:
        archs = [a for a in archs if a in known]
    if not archs:
        raise RuntimeError("coalesced_bcast: no GPU visible, and neither torch's arch list nor nvcc names an "
                           "architecture to build for: set TORCH_CUDA_ARCH_LIST (e.g. 9.0 for H100/H200)")
    # Plain archs only: an "a" variant (sm_90a) runs on that one GPU alone, and the plain one is listed too.
    archs = sorted({int(a) for a in archs if a.isdigit()})
    return ";".join(f"{a // 10}.{a % 10}" for a in archs) + "+PTX"


BUILD_INFO = os.path.join(ROOT, "python", "coalesced_bcast", "_build_info.py")


def write_build_info(with_cuda):
    """Record the torch this build is for: the package checks it before it loads _C (see _compat.py),
    so that a wheel imported under another torch says so instead of failing on an undefined symbol."""
    text = ('"""Written by setup.py at build time: the torch the extension was built against (not in git)."""\n'
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"WITH_CUDA = {bool(with_cuda)!r}\n"
            f"CUDA_ARCH_LIST = {os.environ.get('TORCH_CUDA_ARCH_LIST', '') if with_cuda else ''!r}\n")
    with open(BUILD_INFO, "w") as f:
        f.write(text)


def extension():
    pick_host_compiler()
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda_home = find_cuda_home() if torch.version.cuda and os.environ.get("COALESCED_BCAST_CPU_ONLY") != "1" else None
    cxx = ["-O3"]
    if cuda_home is None:
        write_build_info(False)
        return cpp_extension.CppExtension("coalesced_bcast._C", cpp, extra_compile_args={"cxx": cxx})
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    # The toolkit's own headers first: a wheel's (nvidia/cu13/include) may be of a newer CUDA than this
    # nvcc, and cuda_toolkit.h refuses such a mix (torch 2.15.0+cu132's headers with nvcc 13.0); the
    # wheel only fills in what the toolkit lacks.
    include = [os.path.join(cuda_home, "include")]
    if not os.path.exists(os.path.join(cuda_home, "include", "cusparse.h")):
        include += wheel_include("nvidia.cu13") or wheel_include("nvidia.cu12")
    arch_list = default_cuda_arch_list(cuda_home)
    if arch_list is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        print(f"coalesced_bcast: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building for torch's own list, {arch_list}")
    write_build_info(True)
    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    return cpp_extension.CUDAExtension(
        "coalesced_bcast._C", cpp + cu, include_dirs=include, define_macros=[("WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]})


if __name__ == "__main__":  # tests import the helpers above (runpy) without building
    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    )
