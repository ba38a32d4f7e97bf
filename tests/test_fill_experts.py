"""scripts/fill_experts.py: pseudo-random blocks in the routed experts of the first layers, in
place, with finite small scales; every other byte of the file as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

import ds4
from ds4.testing import TINY, random_model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fill_experts.py"
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def test_fills_the_experts_of_the_first_layers_and_nothing_else(tmp_path: Path) -> None:
    path = random_model(tmp_path / "tiny.gguf", TINY, seed=3, dtype="q8_0")
    before = path.read_bytes()
    f = ds4.GGUFFile(str(path))
    spans = {name: (t.offset, t.nbytes) for name, t in f.tensors.items()}
    header = f.data_offset
    del f

    # No disk reserve: the file is tiny, and a CI machine's disk may hold less than the default 6 GiB.
    args = [sys.executable, str(SCRIPT), str(path), "--layers", "2", "--reserve-gib", "0"]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "2 of" in r.stdout

    after = path.read_bytes()
    assert len(after) == len(before)
    assert after[:header] == before[:header]
    filled = {f"blk.{il}.{n}" for il in range(2) for n in EXPERTS}
    assert filled <= spans.keys()
    for name, (off, size) in spans.items():
        changed = after[off : off + size] != before[off : off + size]
        assert changed == (name in filled), name

    g = ds4.GGUFFile(str(path))
    for name in filled:
        w = g.read(name)
        # Q8_0 blocks with scale 1e-3 (f16) and random quants: |w| <= 128 * 1e-3.
        assert np.isfinite(w).all(), name
        assert 0 < np.abs(w).max() <= 128 * float(np.float16(1e-3)), name


def test_a_file_without_experts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek4")
    w.add_uint32("deepseek4.block_count", 1)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    before = path.read_bytes()
    r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "no routed expert tensors" in r.stderr
    assert path.read_bytes() == before
