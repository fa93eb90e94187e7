"""`python tests/helpers/fake_vllm_launch.py FLAGS` is `python train_dapo.py FLAGS` with tests/helpers/fake_vllm.py standing in for
vllm: torchrun tests of the vLLM engine's paths on CPU ranks (the repository on PYTHONPATH)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_vllm  # noqa: E402

fake_vllm.install_globally()

import train_dapo  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_dapo.main(sys.argv[1:]))
