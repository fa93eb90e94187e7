# A task with reasoning length: DAPO on SmolLM2-135M-Instruct, sums of three or four one-digit numbers, the
# running total written out line by line before the answer ("7 + 5 = 12\n12 + 8 = 20\nAnswer: 20"), so that
# responses are 20-100 tokens rather than the addition recipe's ~6 and token- vs sequence-level losses, overlong
# shaping and length effects have something to act on (README "Ablations").
#
# The model, as for configs/smollm2_135m_dapo.py (its header has the GGUF conversion command), at
# models/smollm2-135m-instruct. The data (20000 train, 256 held-out problems, never a training one):
#   python tools/prepare_data.py make-fewshot-sums data/fewshot_sums
# The run (one GPU; vLLM generates when it is installed, --rollout_engine=torch for the built-in engine):
#   python train_dapo.py configs/smollm2_135m_sums.py
# Several arms side by side on one GPU (README "Ablations"):
#   python bench/ablation.py configs/smollm2_135m_sums.py --arms loss_agg_mode=token-mean,seq-mean-token-mean \
#       --seeds 2 --extra=--rollout_engine=torch
#
# The prompt: six worked examples (three to five terms) in the chat before the question; the verifier is DAPO's
# (data_source math_dapo, the last "Answer:" line, +1 / -1). Tuned on the base model so that it starts above
# 0: on 32-48 held-out prompts each (same CPU and sampling), three to five terms gave 0.016 with 30% one-digit
# terms and 0.036 with 70%, and three or four terms (70% one-digit) solved as rewrites ("= 12 + 8") 0.026.
# Measured 2026-12-06 before any training, on a 2-core CPU (the built-in engine, fp32, the converted Q4_1 GGUF),
# at this config's validation sampling (mean@4, temperature 1, top_p 1) on the first 128 held-out problems:
# val/acc 0.059 (30 of 512 responses; 0.060 on three terms, 0.058 on four), an "Answer:" line in 60% of the
# responses, response length mean 42 tokens (median 36, 10th-90th percentile 21-77), 6.6% of the responses
# (34 of 512) reaching max_response_length = 96 (rambling on after or instead of the steps). Just inside the
# 0.05-0.5 this task was tuned for: 256 problems on a GPU may well measure a little under 0.05.
# The trainer gives the same step-0 val/acc (30 of 512): python train_dapo.py configs/smollm2_135m_sums.py
# --rollout_engine=torch --val_max_samples=128, stopped with Ctrl-C after it (8 min on 2 shared cores).
# On one H200 (2026-12-06, twelve runs sharing it, the built-in engine, bf16, 128 held-out problems, the lab command
# of README "Ablations" with --val_max_samples=128 --gradient_checkpointing=True --ppo_micro_batch_size_per_gpu=16
# --max_num_seqs=256): val/acc 0.062-0.078 at step 0 -> 0.59-0.60 at step 20 -> 0.83-0.85 at step 30 (2 seeds),
# response length falling from ~40 tokens at step 1 to ~28 at step 30, 2% of responses a step reaching
# max_response_length. Not yet measured: a run that has the GPU to itself (step time, memory against
# --dry_run's plan), and vLLM.
model_path = "models/smollm2-135m-instruct"
train_files = ["data/fewshot_sums/train.parquet"]
val_files = ["data/fewshot_sums/val.parquet"]
out_dir = "out/smollm2_sums"
max_prompt_length = 416  # the templated chat with six worked examples is 401-404 tokens
max_response_length = 96  # a worked answer is 20-35 tokens; rambling runs on to the limit
overlong_buffer_len = 32  # the penalty ramps over tokens 64-96
# DAPO: clip-higher, dynamic sampling on acc, token-mean (the defaults), no KL; batches as the addition recipe
train_batch_size = 64
gen_batch_size = 96
n = 8
ppo_mini_batch_size = 32
ppo_micro_batch_size_per_gpu = 32  # 32 x 512 tokens: --dry_run plans 8.4 GiB of activations
log_prob_micro_batch_size_per_gpu = 64
max_num_gen_batches = 10
lr = 5e-6
lr_warmup_steps = 5
weight_decay = 0.01
gradient_checkpointing = False
val_n = 4  # val/acc = mean@4 at temperature 1 on 256 held-out problems
val_top_p = 1.0
test_freq = 10
save_freq = 50
total_training_steps = 300
max_num_seqs = 1024  # a validation (256 x 4) in one wave
gpu_memory_utilization = 0.3  # a small share: ablation arms run side by side on one GPU
calculate_log_probs = True  # rollout/logp_mismatch
