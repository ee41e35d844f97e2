"""setup.py's choice of host compiler (see its pick_host_compiler): a compiler that links libstdc++
code into the extension made every error message crash the process on the GPU image."""
import os
import runpy
import shutil
import stat

import pytest

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
