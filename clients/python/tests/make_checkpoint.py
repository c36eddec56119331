"""Writes one of test_hf_checkpoint.py's cases as a checkpoint directory:
a small random transformers MoE block's layer (and a second MoE layer) in
the layout of the model's FP8 release, or of its BF16/FP16 release (the
*-bf16* and *-fp16* cases, which the daemon quantizes as it loads them),
sharded with model.safetensors.index.json, with config.json. For trying
expertd-load and RemoteMoE without downloading a model; needs torch and
transformers (the Python that make test installs has them:
.tools/e2e/venv/bin/python).

    .tools/e2e/venv/bin/python clients/python/tests/make_checkpoint.py deepseek_v3-block-fp8 /tmp/models/tiny-dsv3
    .tools/e2e/venv/bin/python clients/python/tests/make_checkpoint.py qwen3_moe-bf16 /tmp/models/tiny-qwen3-bf16

The MoE layers are 1 and 3 (of num_hidden_layers 4).
"""

import argparse
import importlib.util
import os
import sys

# Checked before the import below, which would otherwise end in a pytest
# skip's traceback.
_missing = [m for m in ("torch", "transformers", "huggingface_hub", "pytest") if importlib.util.find_spec(m) is None]
if _missing:
    sys.exit(f"make_checkpoint.py: {sys.executable} lacks {', '.join(_missing)}; run it with a Python that has "
             f"torch and transformers, such as .tools/e2e/venv/bin/python (make test installs it)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_hf_checkpoint as hf  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=sorted(hf.CASES))
    p.add_argument("dir", help="the checkpoint directory to create (it must not exist)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="1MB", help="shard size, as huggingface_hub takes it")
    a = p.parse_args()
    os.makedirs(a.dir)
    cfg, _, ts, ts_other, *_ = hf.make_case(a.case, hf.torch.Generator().manual_seed(a.seed))
    weight_map = hf._write_checkpoint(a.dir, cfg, hf.CASES[a.case], {**ts_other, **ts}, a.max_shard_size)
    print(f"{a.dir}: {len(weight_map)} tensors in {len(set(weight_map.values()))} shards")


if __name__ == "__main__":
    main()
