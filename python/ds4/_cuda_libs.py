"""Where pip's NVIDIA wheels keep NVRTC, so that the CUDA backend finds it without a toolkit.

The backend compiles its kernels with NVRTC, loaded at run time. A machine may have a GPU
driver and NVRTC from pip (``pip install ds4[cuda]``, or the ``nvidia-cuda-nvrtc-cu12``
wheel that PyTorch's CUDA 12 builds depend on) but no CUDA toolkit: the loader does not look
in site-packages. At import the package lists those folders in ``_DS4_PIP_CUDA_LIBS``, which
the engine searches after ``DS4_CUDA_LIB``, ``CUDA_HOME``, ``CUDA_PATH`` and
``/usr/local/cuda*`` (rust/engine/backend/cuda/context.rs).
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Iterable

#: The variable the engine reads (a path list, searched last).
ENV = "_DS4_PIP_CUDA_LIBS"
#: Where NVIDIA's wheels put libnvrtc under a site-packages folder: CUDA 13's
#: ``nvidia-cuda-nvrtc``, then CUDA 12's ``nvidia-cuda-nvrtc-cu12``.
SUBDIRS = (("nvidia", "cu13", "lib"), ("nvidia", "cuda_nvrtc", "lib"))


def pip_nvrtc_dirs(paths: Iterable[str] | None = None) -> list[str]:
    """The folders under ``paths`` (default ``sys.path``) that hold a ``libnvrtc.so.*``, in
    the order of ``paths`` and then of :data:`SUBDIRS`, without repeats. The empty entry (the
    current folder) is skipped."""
    found: list[str] = []
    for base in sys.path if paths is None else paths:
        if not base:
            continue
        for sub in SUBDIRS:
            d = os.path.join(base, *sub)
            if d not in found and glob.glob(os.path.join(glob.escape(d), "libnvrtc.so.*")):
                found.append(d)
    return found


def export_pip_nvrtc_dirs() -> None:
    """Sets :data:`ENV` to :func:`pip_nvrtc_dirs` on Linux, unless it is set already or
    there are none."""
    if sys.platform.startswith("linux") and ENV not in os.environ:
        dirs = pip_nvrtc_dirs()
        if dirs:
            os.environ[ENV] = os.pathsep.join(dirs)
