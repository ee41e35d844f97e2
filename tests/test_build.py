"""setup.py: its choice of host compiler (see its pick_host_compiler: a compiler that links libstdc++
code into the extension made every error message crash the process on the GPU image), the GPU
architectures a CUDA build targets, and the torch version a build records and checks at import;
pyproject.toml: the package's metadata, its one version and its license."""
import os
import re
import runpy
import shutil
import stat
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
needs_gxx = pytest.mark.skipif(not (shutil.which("g++") and shutil.which("nm") and os.path.exists("/usr/bin/g++")),
                               reason="needs g++, nm and /usr/bin/g++")


@pytest.fixture(scope="module")
def setup_py():
    return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup_py_under_test")


def _static_gxx(tmp_path) -> str:
    """A g++ that, like the GPU image's /opt/gcc one, puts libstdc++ code into what it links."""
    path = tmp_path / "g++"
    path.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@needs_gxx
def test_probe_tells_a_static_libstdcxx_from_the_system_one(setup_py, tmp_path):
    probe = setup_py["links_libstdcxx_statically"]
    assert probe(_static_gxx(tmp_path)) is True
    assert probe("/usr/bin/g++") is False
    assert probe(str(tmp_path / "no-such-compiler")) is False


@needs_gxx
def test_such_a_cxx_is_replaced_by_the_system_gxx(setup_py, tmp_path, monkeypatch):
    static = _static_gxx(tmp_path)
    monkeypatch.setenv("CC", "gcc")  # registered, so that both are put back after the test
    monkeypatch.setenv("CXX", static)
    monkeypatch.delenv("COALESCED_BCAST_KEEP_CXX", raising=False)
    setup_py["pick_host_compiler"]()
    assert os.environ["CXX"] == "/usr/bin/g++" and os.environ["CC"] == "/usr/bin/gcc"
    monkeypatch.setenv("CXX", static)
    monkeypatch.setenv("COALESCED_BCAST_KEEP_CXX", "1")
    setup_py["pick_host_compiler"]()
    assert os.environ["CXX"] == static


# ------------------------------------------------------------------ which GPUs a CUDA build targets

needs_cuda_torch = pytest.mark.skipif(not torch.version.cuda, reason="a CPU-only torch builds no CUDA code")


@needs_cuda_torch
def test_explicit_arch_list_is_what_the_build_uses(setup_py, monkeypatch):
    """CI and bench/device_run.sh set a short list: setup.py keeps it, and torch turns it into one gencode."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert setup_py["default_cuda_arch_list"]("/usr/local/cuda") is None
    assert cpp_extension._get_cuda_arch_flags() == ["-gencode=arch=compute_90,code=sm_90"]


@needs_cuda_torch
@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="with a GPU visible torch builds for it: nothing to choose")
def test_default_arch_list_without_a_gpu_is_the_wheels(setup_py, monkeypatch):
    """No GPU and no TORCH_CUDA_ARCH_LIST: every architecture this torch was built for (that nvcc knows),
    PTX for the newest; no longer Hopper alone (9.0+PTX, which A100, A10G, L40S and RTX 4090 cannot run)."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    cuda_home = setup_py["find_cuda_home"]()
    wheel = {int(a) for a in setup_py["wheel_archs"]() if a.isdigit()}
    nvcc = setup_py["nvcc_archs"](cuda_home) if cuda_home else None
    expect = sorted(a for a in wheel if nvcc is None or str(a) in nvcc)
    assert len(expect) >= 2, (wheel, nvcc)  # every CUDA wheel of torch 2.4-2.15 lists several
    arch_list = setup_py["default_cuda_arch_list"](cuda_home)
    assert arch_list == ";".join(f"{a // 10}.{a % 10}" for a in expect) + "+PTX"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)  # what setup.py's extension() exports
    flags = cpp_extension._get_cuda_arch_flags()
    assert {f"-gencode=arch=compute_{a},code=sm_{a}" for a in expect} <= set(flags)
    assert f"-gencode=arch=compute_{expect[-1]},code=compute_{expect[-1]}" in flags  # PTX of the newest
    assert len(flags) == len(expect) + 1, flags


def test_built_extension_holds_the_recorded_archs():
    """The built _C holds device code for exactly the architectures its build recorded (a CUDA build)."""
    from coalesced_bcast import _C, _build_info

    if not _C.with_cuda:
        assert _build_info.WITH_CUDA is False and _build_info.CUDA_ARCH_LIST == ""
        pytest.skip("a CPU-only build: no device code")
    want = {a.split("+")[0].replace(".", "") for a in _build_info.CUDA_ARCH_LIST.split(";")}
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if os.path.exists(cuobjdump):
        out = subprocess.run([cuobjdump, "--list-elf", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
        have = set(re.findall(r"\.sm_(\d+[a-z]?)\.", out))  # 90a stays 90a: 9.0a is its own target
    else:  # a toolkit without cuobjdump (the CI machine's): each cubin keeps its ptxas options, "-arch sm_XX"
        with open(_C.__file__, "rb") as f:
            out = f.read()
        have = {m.decode() for m in re.findall(rb"-arch sm_(\d+[a-z]?)", out)}
    assert have == want, (have, _build_info.CUDA_ARCH_LIST)


# ------------------------------------------------------------------ the torch a build is for

def test_build_records_the_torch_it_was_built_against():
    from coalesced_bcast import _build_info, _compat

    assert _compat.built_torch_version() == _build_info.TORCH_VERSION == torch.__version__


def test_another_torch_is_refused_naming_both_versions():
    from coalesced_bcast import _compat

    _compat.check_torch("2.14.1+cu130", "2.14.1+cu130")
    _compat.check_torch("2.14.1+cu130", "2.14.1")  # the local tag is not compared
    _compat.check_torch(None, "2.4.1")  # never built: importing _C says what is wrong
    with pytest.raises(ImportError) as e:
        _compat.check_torch("2.14.1+cu130", "2.15.0+cu132")
    assert "built against torch 2.14.1+cu130" in str(e.value) and "torch 2.15.0+cu132 is installed" in str(e.value)
    assert "torch==2.14.1" in str(e.value)
    with pytest.raises(ImportError, match="2.4.1"):
        _compat.check_torch("2.4.1", "2.4.0")


def test_import_under_another_torch_fails_with_the_check_not_a_symbol_error(tmp_path):
    """A fresh interpreter whose recorded build torch differs: `import coalesced_bcast` raises the
    ImportError of the check, before _C is loaded (so no undefined-symbol error can come first)."""
    import coalesced_bcast

    pkg = os.path.dirname(coalesced_bcast.__file__)
    fake = tmp_path / "coalesced_bcast"
    shutil.copytree(pkg, fake, ignore=shutil.ignore_patterns("__pycache__"))
    (fake / "_build_info.py").write_text('TORCH_VERSION = "1.0.0+cu000"\nWITH_CUDA = False\nCUDA_ARCH_LIST = ""\n')
    code = ("import sys\ntry:\n    import coalesced_bcast\nexcept ImportError as e:\n"
            "    print('ImportError:', e); print('C loaded:', 'coalesced_bcast._C' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert f"built against torch 1.0.0+cu000, but torch {torch.__version__} is installed" in out.stdout, out
    assert "C loaded: False" in out.stdout, out


def test_import_leaves_dtensor_unimported():
    """`import coalesced_bcast` does not import torch.distributed.tensor (~0.5 s on the CPU machine: sympy, its op
    table) for processes that only sync; the load and refit paths take DTensor's classes where some module has
    imported them (no object is a DTensor before). install() still imports FSDP1 to patch it, and FSDP1 DTensor."""
    import coalesced_bcast

    root = os.path.dirname(os.path.dirname(coalesced_bcast.__file__))
    code = ("import sys, torch, torch.distributed, torch.nn.parallel\nimport coalesced_bcast\n"
            "print('dtensor:', sorted(m for m in sys.modules if m.startswith(('torch.distributed.tensor', "
            "'torch.distributed._tensor'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out
    assert "dtensor: []" in out.stdout, out


# ------------------------------------------------------------------ metadata, version, license

def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.9, 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_version_is_read_from_one_file():
    """_version.py holds the version; pyproject.toml reads it (setuptools' dynamic attr), the package
    exports it, and the installed distribution's metadata carries it."""
    import importlib.metadata

    import coalesced_bcast

    own = runpy.run_path(os.path.join(ROOT, "python", "coalesced_bcast", "_version.py"))["__version__"]
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", own), own
    assert coalesced_bcast.__version__ == own
    meta = _pyproject()
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "coalesced_bcast._version.__version__"}
    try:
        installed = importlib.metadata.version("coalesced_bcast")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("coalesced_bcast is not installed (imported from PYTHONPATH): no metadata to compare")
    assert installed == own


def test_pyproject_builds_without_isolation_against_the_installed_torch():
    """torch is a dependency, not a build requirement (an isolated build would install another torch and
    build the extension against it); the license is BSD-3-Clause, its text the LICENSE file."""
    meta = _pyproject()
    requires = meta["build-system"]["requires"]
    assert meta["build-system"]["build-backend"] == "setuptools.build_meta"
    assert not any(r.split(">")[0].split("=")[0].strip() == "torch" for r in requires), requires
    project = meta["project"]
    assert project["name"] == "coalesced_bcast" and project["requires-python"] == ">=3.9"
    assert project["dependencies"] == ["torch>=2.4"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("BSD 3-Clause License") and "the coalesced_bcast authors" in text
