"""
A deterministic reward for benchmarks: sha256 of the response text, mapped to 0 or 1. It needs no
correct answers (a random model has none) yet gives groups reward variance, so the GRPO advantages and
the policy loss are non-trivial. The same function serves both trainers in bench/step.py:

    nanodapo:  reward_fn = "bench/hash_reward.py:compute_score"   (verl's compute_score signature)
    TRL:       GRPOTrainer(reward_funcs=[trl_reward], ...)        (prompts, completions, **kwargs)
"""
import hashlib


def hash_score(text: str) -> float:
    return float(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[0] & 1)


def compute_score(data_source, solution_str, ground_truth=None, extra_info=None) -> dict:
    s = hash_score(solution_str)
    return {"score": s, "acc": s > 0}


def trl_reward(prompts=None, completions=None, **kwargs) -> list[float]:
    """TRL reward function: completions are strings, or (conversational prompts) lists of messages."""
    out = []
    for c in completions:
        if isinstance(c, list):  # [{"role": "assistant", "content": ...}]
            c = "".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in c)
        out.append(hash_score(c))
    return out
