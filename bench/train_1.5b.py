# A training run on a random Qwen2.5-1.5B-shaped model (bench/make_random_model.py /tmp/q15 writes it); every
# response runs to max_response_length (a random model rarely samples EOS):
#   torchrun --nproc-per-node 2 train_dapo.py bench/train_1.5b.py --out_dir=/tmp/r2
model_path = "/tmp/q15/model"
train_files = ["/tmp/q15/train.parquet"]
val_files = []
max_prompt_length = 64
max_response_length = 1024
overlong_buffer_len = 128
train_batch_size = 16
gen_batch_size = 16
n = 8
ppo_mini_batch_size = 16
ppo_micro_batch_size_per_gpu = 16
use_dynamic_bsz = True
ppo_max_token_len_per_gpu = 16384
log_prob_max_token_len_per_gpu = 32768
filter_groups = False
lr = 1e-6
total_training_steps = 3
save_freq = -1
resume = "disable"
logger = ["console", "jsonl"]
