# The CPU demo: DAPO on a tiny warm-started model, synthetic two-number addition, no downloads.
#   python train_dapo.py configs/tiny.py          # ~3.5 min on 2 CPU cores; then see out/tiny/metrics.png
# Expected (measured 2026-11-30, 2-core CPU): val/acc 0.327 at step 0 -> 0.774 at step 100.
# demo/model is made by `python demo/warmstart.py` (format learned, answers often wrong); demo/data holds
# addition problems in verl's parquet schema, val problems disjoint from train ones.
model_path = "demo/model"
train_files = ["demo/data/train.parquet"]
val_files = ["demo/data/val.parquet"]
out_dir = "out/tiny"
max_prompt_length = 32
max_response_length = 16  # "Answer: 123" + EOS is 12 tokens
overlong_buffer_len = 4  # DAPO overlong shaping over the last 4 tokens
# DAPO: clip-higher, dynamic sampling on acc, token-mean (the defaults), no KL
train_batch_size = 64
gen_batch_size = 96
n = 8
ppo_mini_batch_size = 64  # one on-policy update per step
ppo_micro_batch_size_per_gpu = 512
max_num_gen_batches = 0
lr = 2e-4  # 6e-4 collapsed this model in the warm-start experiments; 2e-4 learns steadily
lr_warmup_steps = 5
betas = (0.9, 0.999)
weight_decay = 0.01
gradient_checkpointing = False  # a tiny model: recomputation costs more than it saves
val_n = 4  # val/acc = mean@4 at temperature 1.0 on 200 held-out problems
val_top_p = 1.0
test_freq = 10
save_freq = 50
total_training_steps = 100
cpu_threads = 1  # one thread per process is fastest for this size; the reward worker takes the other core
reward_num_workers = 1
resume = "disable"
