"""NVRTC from pip (python/ds4/_cuda_libs.py): the package lists the folders where NVIDIA's
wheels keep libnvrtc, for the CUDA backend to load on a machine without a CUDA toolkit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4._cuda_libs import ENV, pip_nvrtc_dirs

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pip's NVRTC is looked for on Linux")


def fake_site(root: Path, *subdirs: tuple[str, ...], lib: str = "libnvrtc.so.12") -> Path:
    for sub in subdirs:
        d = root.joinpath(*sub)
        d.mkdir(parents=True)
        (d / lib).write_bytes(b"")
    return root


def test_finds_the_folders_of_both_cuda_majors_in_path_order(tmp_path: Path) -> None:
    a = fake_site(tmp_path / "a", ("nvidia", "cuda_nvrtc", "lib"), ("nvidia", "cu13", "lib"))
    b = fake_site(tmp_path / "b", ("nvidia", "cuda_nvrtc", "lib"))
    # A folder of the right name without the library, another library: not listed.
    fake_site(tmp_path / "c", ("nvidia", "cuda_nvrtc", "lib"), lib="libcublas.so.12")
    (tmp_path / "d" / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    got = pip_nvrtc_dirs(["", str(b), str(tmp_path / "c"), str(a), str(tmp_path / "d"), str(b)])
    assert got == [
        str(b / "nvidia" / "cuda_nvrtc" / "lib"),
        str(a / "nvidia" / "cu13" / "lib"),
        str(a / "nvidia" / "cuda_nvrtc" / "lib"),
    ]
    assert pip_nvrtc_dirs([str(tmp_path / "c"), str(tmp_path / "missing")]) == []


def import_ds4_env(extra_path: Path | None, preset: str | None) -> str | None:
    """``_DS4_PIP_CUDA_LIBS`` in a fresh interpreter after ``import ds4``."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if preset is not None:
        env[ENV] = preset
    code = "import os, ds4; v = os.environ.get(%r); print('<unset>' if v is None else v)" % ENV
    if extra_path is not None:
        # Appended to sys.path, as a site-packages folder would be.
        code = "import sys; sys.path.append(%r); " % str(extra_path) + code
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    out = run.stdout.strip()
    return None if out == "<unset>" else out


@linux_only
def test_import_lists_pip_nvrtc_for_the_engine(tmp_path: Path) -> None:
    site = fake_site(tmp_path / "site", ("nvidia", "cuda_nvrtc", "lib"))
    got = import_ds4_env(site, None)
    assert got is not None
    assert str(site / "nvidia" / "cuda_nvrtc" / "lib") in got.split(os.pathsep)


@linux_only
def test_a_value_already_set_is_kept(tmp_path: Path) -> None:
    site = fake_site(tmp_path / "site", ("nvidia", "cuda_nvrtc", "lib"))
    assert import_ds4_env(site, "/opt/my-nvrtc") == "/opt/my-nvrtc"


@linux_only
@pytest.mark.skipif(importlib.util.find_spec("nvidia") is None, reason="no NVIDIA wheel installed (ds4[cuda])")
def test_the_cuda_extra_is_found() -> None:
    spec = importlib.util.find_spec("nvidia")
    assert spec is not None and spec.submodule_search_locations is not None
    subdirs = (("cu13", "lib"), ("cuda_nvrtc", "lib"))
    folders = [os.path.join(p, *sub) for p in spec.submodule_search_locations for sub in subdirs]
    libs = [d for d in folders if os.path.isdir(d) and any(n.startswith("libnvrtc.so.") for n in os.listdir(d))]
    if not libs:
        pytest.skip("the NVIDIA wheels installed hold no NVRTC")
    got = import_ds4_env(None, None)
    assert got is not None
    assert set(libs) <= set(got.split(os.pathsep))
