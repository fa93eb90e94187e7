"""
A reward for benchmarks that needs no correct answers (a random model has none): sha256 of the response text,
mapped to 0 or 1, so groups still have reward variance and the policy loss is not trivial. One function for
nanodapo (verl's compute_score signature) and TRL (trl_reward, a GRPOTrainer reward function):

    python bench/step.py --sides nanodapo_torch,trl     # gives it to both trainers
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
