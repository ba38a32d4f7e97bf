"""The ``ds4`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ds4", *args], capture_output=True, text=True, timeout=120)


def test_info(llamacpp_tiny_l: Path) -> None:
    r = run("info", str(llamacpp_tiny_l))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "GGUF v3" in out
    assert "general.architecture" in out and "'deepseek4'" in out
    assert "tensors (116)" in out
    assert "blk.0.ffn_gate_tid2eid.weight" in out and "I32" in out
    assert "(512 items)" in out  # long arrays are shortened


def test_info_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x09\0\0\0")
    r = run("info", str(bad))
    assert r.returncode == 1
    assert r.stderr.startswith("ds4: error: unsupported GGUF version 9")
    r = run("info", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and "No such file" in r.stderr
    assert "os error" not in r.stderr  # Python's text, not Rust's
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_bytes(b"garbage\n")
    r = run("info", str(not_gguf))
    assert r.returncode == 1
    assert r.stderr.startswith('ds4: error: not a GGUF file: it starts with "garb", expected "GGUF"'), r.stderr


def test_block_option_is_checked_before_loading(tmp_path: Path) -> None:
    # argparse rejects it (exit 2) naming the option, before any file is read.
    for bad, why in [("0", "must be in 1..16, got 0"), ("17", "got 17"), ("x", "not an integer")]:
        r = run("generate", str(tmp_path / "absent.gguf"), "hi", "--spec", "ngram", "--block", bad)
        assert r.returncode == 2
        assert "argument --block" in r.stderr and why in r.stderr, r.stderr


def test_version() -> None:
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("ds4 ")
