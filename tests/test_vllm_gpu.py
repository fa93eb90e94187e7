"""The in-process vLLM engine on real GPUs: bench/vllm_check.py under torchrun (1 GPU; 2 GPUs with gen_tp 2
and with two engines when present). Skipped without CUDA and vllm. NANODAPO_VLLM_TEST_MODEL picks the model
directory (default: the shipped demo model)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vllm"),
              pytest.mark.slow]  # torchrun


@pytest.mark.parametrize("gpus,gen_tp", [(1, 1), (2, 2), (2, 1)])
def test_vllm_engine_against_trainer_and_builtin_engine(gpus, gen_tp):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    model = os.environ.get("NANODAPO_VLLM_TEST_MODEL", os.path.join(ROOT, "demo", "model"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
           os.path.join(ROOT, "bench", "vllm_check.py"), model, "--gen_tp", str(gen_tp)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
