"""
A random-init model directory of a real shape, for GPU runs without downloads:

    python bench/make_random_model.py /tmp/qwen1.5b --shape qwen2.5-1.5b

Writes config.json + bf16 safetensors (model.save_pretrained), the demo's byte-level tokenizer with its
chat template (token ids < 259 of the model's 151936), and arithmetic train/val parquet files beside it
({out}/train.parquet, {out}/val.parquet). A random model rarely samples EOS, so responses run to
max_response_length: the worst case for generation and update time.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402
from demo.warmstart import write_tokenizer  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(M.KNOWN_CONFIGS))  # published shapes
    a = ap.parse_args()
    cfg = M.ModelConfig.from_hf(M.KNOWN_CONFIGS[a.shape])
    device = parallel.get_device()
    with torch.device(device):
        m = M.Transformer(cfg)
    m.init_weights(seed=0)  # drawn on the device: seconds instead of a minute on the CPU
    M.save_pretrained(m.to(torch.bfloat16), os.path.join(a.out, "model"))
    write_tokenizer(os.path.join(a.out, "model"))
    data.write_parquet(data.make_arith_rows(2000, "train", seed=0), os.path.join(a.out, "train.parquet"))
    data.write_parquet(data.make_arith_rows(64, "val", seed=0), os.path.join(a.out, "val.parquet"))
    print(f"wrote {a.out}/model ({cfg.num_params() / 1e9:.2f} B params), train.parquet, val.parquet")
