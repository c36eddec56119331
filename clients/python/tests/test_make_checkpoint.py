"""make_checkpoint.py writes a case as a checkpoint directory, sharded or,
when the layers fit one shard, as a single model.safetensors (which
huggingface_hub writes without an index). Needs no daemon."""

import json
import os
import subprocess
import sys

import pytest

import needs

needs.module("torch")
needs.module("transformers")
safetensors = needs.module("safetensors")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_checkpoint.py")


@pytest.mark.parametrize("shard_size,one", [("1GB", True), ("16KB", False)])
def test_make_checkpoint(tmp_path, shard_size, one):
    d = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, SCRIPT, "qwen3_moe-bf16", str(d), "--max-shard-size", shard_size],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if one:
        assert files == ["model.safetensors"], files
    else:
        assert len(files) > 1, files
    names = []
    for name in files:
        with safetensors.safe_open(d / name, "np") as f:
            names += f.keys()
    assert out.stdout.strip() == f"{d}: {len(names)} tensors in {len(files)} shards", out.stdout
    assert any(".mlp.experts." in name for name in names), names[:5]
