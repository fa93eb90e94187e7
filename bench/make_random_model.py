"""
A random-init model directory of a published shape, with arithmetic train/val parquet files beside it, for GPU
runs without downloads (a random model rarely samples EOS: every response runs to max length).

    python bench/make_random_model.py /tmp/q15 --shape qwen2.5-1.5b
"""
import argparse
import dataclasses
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not bench/

import data  # noqa: E402
import hf  # noqa: E402
import parallel  # noqa: E402
from tools.prepare_data import make_arith_rows  # noqa: E402
from bench.common import model_config, write_random_model  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(hf.KNOWN_CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (the shape cut)")
    a = ap.parse_args()
    cfg = model_config(a.shape)
    if a.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers)
    write_random_model(os.path.join(a.out, "model"), cfg, parallel.get_device())
    data.write_parquet(make_arith_rows(2000, "train", seed=0), os.path.join(a.out, "train.parquet"))
    data.write_parquet(make_arith_rows(64, "val", seed=0), os.path.join(a.out, "val.parquet"))
    print(f"wrote {a.out}/model ({cfg.num_params() / 1e9:.2f} B params), train.parquet, val.parquet")
