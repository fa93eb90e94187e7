# DAPO on Qwen3-8B (the post-trained model, in thinking mode), one node of 8 GPUs.
#
# Run:
#   torchrun --nproc-per-node 8 train_dapo.py configs/qwen3_8b_dapo.py
# Check it first, without GPUs or the model (batch arithmetic and per-GPU memory for 8 GPUs):
#   python train_dapo.py configs/qwen3_8b_dapo.py --dry_run
#
# Model and data (verl's DAPO files, unchanged):
#   huggingface-cli download Qwen/Qwen3-8B --local-dir ~/models/Qwen3-8B
#   wget -O ~/data/dapo-math-17k.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet?download=true"
#   wget -O ~/data/aime-2024.parquet \
#     "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/aime-2024.parquet?download=true"
#   python tools/prepare_data.py inspect ~/data/dapo-math-17k.parquet --tokenizer ~/models/Qwen3-8B --max_prompt_length 2048
#
# Thinking template: prompts go through the model's own chat template with no extra arguments, and Qwen3's template
# then leaves thinking on: the response is "<think>...</think>" followed by the answer; the verifier reads the
# "Answer:" line at the end. (chat_template_kwargs = {"enable_thinking": False} would turn thinking off.)
#
# Expected result: none published for this exact setup, and not measured yet. Qwen3-8B already solves part of
# AIME 2024 at step 0 (val_before_train logs it); watch val/acc against that and response_length/clip_ratio:
# thinking traces longer than 16384 tokens are cut and penalized, which pushes the policy to think shorter.
#
# Same recipe as configs/qwen2.5_7b_dapo.py, except: responses of 16384 tokens (Qwen3 thinks long) with the
# overlong penalty over the last 4096, and validation with Qwen3's recommended thinking-mode sampling
# (T 0.6, top_p 0.95, top_k 20). Rollout: the in-process vLLM engine, two engines of TP 4 per node at
# gpu_memory_utilization 0.6 (rollout_engine='torch' for the built-in engine).
# The --dry_run planner: peak ~65 GiB per GPU on 80 GiB while vLLM is awake (~173 GiB of KV cache per engine:
# ~68 full-length sequences in flight); on 141 GiB GPUs ~120 GiB during the update ('auto' checkpoints fewer blocks).

import os

# model and data
model_path = os.path.expanduser("~/models/Qwen3-8B")
train_files = [os.path.expanduser("~/data/dapo-math-17k.parquet")]
val_files = [os.path.expanduser("~/data/aime-2024.parquet")]
max_prompt_length = 2048
max_response_length = 16384
truncation = "left"

# batch: 128 groups of 16 per step from rounds of 384 prompts; 4 optimizer steps of 32 groups
train_batch_size = 128
gen_batch_size = 384
n = 16
ppo_mini_batch_size = 32
use_dynamic_bsz = True
ppo_max_token_len_per_gpu = 36864  # 2 x (prompt + response)
log_prob_max_token_len_per_gpu = 36864

# DAPO
clip_ratio_low = 0.2
clip_ratio_high = 0.28
clip_ratio_c = 10.0
loss_agg_mode = "token-mean"
use_kl_loss = False
use_kl_in_reward = False
entropy_coeff = 0.0
filter_groups = True
filter_groups_metric = "acc"
max_num_gen_batches = 10
overlong_buffer = True
overlong_buffer_len = 4096
overlong_penalty_factor = 1.0

# optimizer
lr = 1e-6
lr_warmup_steps = 10
weight_decay = 0.1
grad_clip = 1.0

# sampling: train at T 1.0; validate as Qwen3 recommends for thinking mode
temperature = 1.0
top_p = 1.0
top_k = -1
val_n = 1
val_temperature = 0.6
val_top_p = 0.95
val_top_k = 20
val_do_sample = True

# rollout: in-process vLLM
rollout_engine = "vllm"
gen_tp = 4
gpu_memory_utilization = 0.6
enable_chunked_prefill = True
max_num_seqs = 256

# parallelism
nnodes = 1
n_gpus_per_node = 8

# schedule and run
total_epochs = 1
test_freq = 5
save_freq = 10
resume = "auto"
project_name = "DAPO"
experiment_name = "DAPO-Qwen3-8B"
out_dir = "out/DAPO-Qwen3-8B"
