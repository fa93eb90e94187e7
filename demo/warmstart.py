"""
The warm start for the CPU demo: a tiny Qwen2 model that already answers in the format
("Answer: 85" then <|im_end|>) but is often wrong, so that DAPO has something to learn in minutes.

    PYTHONPATH=. python demo/warmstart.py     # from the repo root; ~70 s on 2 CPU cores
    PYTHONPATH=. python demo/warmstart.py --experts 4 --out /tmp/demo_moe   # the same task on a tiny Qwen3-MoE

Writes demo/model/ (config.json, fp32 model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) and demo/data/{train,val}.parquet (5000 / 200 problems a+b with a, b in 0..99;
train and val share no problem). Deterministic from --seed on a given machine and torch build.

Tokenizer: byte-level BPE, one token per byte (so per digit) plus whole-word tokens "user" and
"assistant", and the specials <|endoftext|> <|im_start|> <|im_end|>: 277 ids; Qwen-style chat template.
Model: Qwen2, hidden 128, 4 layers, 4 heads / 2 kv heads, MLP 384, tied embeddings: 0.82M params. With
--experts E: Qwen3-MoE of the same shape whose MLPs are E experts of width 192, top-2, renormalised.
Training: supervised on "Answer: {a+b}<|im_end|>" (loss on the response only), AdamW lr 1e-3, batch 64,
stopped once sampled accuracy on a probe of train problems reaches --target_acc (about 500 steps).
Prints on val: greedy accuracy, sampled accuracy at T=1 (mean over 8), pass@8, the format rate
("Answer: <int><|im_end|>") and the wall time. Expected about 0.5 / 0.3 / 0.8 / 0.98.
"""
import argparse
import functools
import json
import os
import re
import time

import torch

import data
import hf
import model as M
from tools import prepare_data
from reward import compute_score
from rollout import SamplingParams, TorchEngine

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant"]  # one token each: prompts of 14 tokens instead of 25
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")

# -----------------------------------------------------------------------------
# tokenizer


def write_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))  # GPT-2's printable stand-in for each byte, as ByteLevel emits them
    alphabet = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    vocab, merges = {c: i for i, c in enumerate(alphabet)}, []  # token id = byte value
    for word in WORDS:  # a chain of merges makes the word one token
        w = "".join(alphabet[b] for b in word.encode())
        for i in range(2, len(w) + 1):
            merges.append((w[:i - 1], w[i - 1]))
            vocab[w[:i]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # the last three ids
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 256}
    for name, d in (("tokenizer_config.json", config), ("generation_config.json", {"eos_token_id": eos})):
        with open(os.path.join(path, name), "w") as f:
            json.dump(d, f, indent=2)
    # check: data.Tokenizer reads it back, and a templated prompt round-trips through encode/decode
    t = data.Tokenizer.from_pretrained(path)
    text = t.apply_chat_template([{"role": "user", "content": "37+48="}], add_generation_prompt=True)
    assert text == "<|im_start|>user\n37+48=<|im_end|>\n<|im_start|>assistant\n", text
    ids = t.encode(text)
    assert t.decode(ids, skip_special_tokens=False) == text and len(ids) == 14 and t.eos_token_ids == [eos]
    assert t.encode("Answer: 85") == list(b"Answer: 85")
    return t

# -----------------------------------------------------------------------------
# evaluation and supervised batches


@torch.no_grad()
def evaluate(model, tok, rows, n=8, seed=0):
    """-> greedy acc, sampled acc at T=1 (mean over n), pass@n, format rate of the samples."""
    model.eval()
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows]
    engine, stats = TorchEngine(model, max_num_seqs=512), {}
    for name, sp in (("greedy", SamplingParams(n=1, temperature=0)), ("sampled", SamplingParams(n=n, seed=seed))):
        sp.max_tokens, sp.stop_token_ids = 16, tok.eos_token_ids
        outs = engine.generate(prompts, sp)
        correct = [[compute_score("arith", tok.decode(c.token_ids), r["reward_model"]["ground_truth"])["acc"]
                    for c in cs] for cs, r in zip(outs, rows)]
        stats[name] = sum(map(sum, correct)) / (len(rows) * sp.n)
    # pass@n and the format rate of the sampled run (correct, outs are still those)
    stats[f"pass@{n}"] = sum(map(any, correct)) / len(rows)
    texts = [tok.decode(c.token_ids, skip_special_tokens=False) for cs in outs for c in cs]
    stats["format"] = sum(re.fullmatch(r"Answer: \d+<\|im_end\|>", t) is not None for t in texts) / len(texts)
    return stats


def sft_batch(tok, rows):
    """Right-padded (input ids, target ids, loss mask on the response tokens)."""
    seqs, masks = [], []
    for r in rows:
        prompt = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        response = tok.encode(f"Answer: {r['reward_model']['ground_truth']}") + tok.eos_token_ids
        seqs.append(prompt + response)
        masks.append([0] * len(prompt) + [1] * len(response))
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (T - len(m)) for m in masks], dtype=torch.float)
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]

# -----------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_operand", type=int, default=99)
    p.add_argument("--target_acc", type=float, default=0.3)  # stop once sampled probe accuracy reaches it
    p.add_argument("--max_steps", type=int, default=1500)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--experts", type=int, default=0)  # > 0: a Qwen3-MoE with this many experts per layer
    args = p.parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    model_dir = os.path.join(args.out, "model")
    tok = write_tokenizer(model_dir)
    rows = functools.partial(prepare_data.make_arith_rows, max_operand=args.max_operand)
    val_rows = rows(200, "val", seed=args.seed)
    data.write_parquet(rows(5000, "train", seed=args.seed), os.path.join(args.out, "data", "train.parquet"))
    data.write_parquet(val_rows, os.path.join(args.out, "data", "val.parquet"))
    sft_rows = rows(args.max_steps * args.batch_size, "train", seed=args.seed + 1)
    probe_rows = rows(128, "train", seed=args.seed + 2)  # the stopping rule looks at train problems only

    moe = dict(architecture="Qwen3MoeForCausalLM", num_experts=args.experts, num_experts_per_tok=2,
               moe_intermediate_size=192, norm_topk_prob=True) if args.experts else {}
    cfg = M.ModelConfig(**{"architecture": "Qwen2ForCausalLM", "vocab_size": tok.vocab_size, "hidden_size": 128,
                           "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 256,
                           "eos_token_id": tok.eos_token_ids[0], **moe})
    model = M.Transformer(cfg).init_weights(seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    # Addition is learned in a sudden jump after a plateau whose length varies with the seed and even with
    # floating-point rounding (another CPU or torch build), so a fixed step count lands before or after the
    # jump on another machine. Instead: stop as soon as a cheap probe on train problems sees the jump.
    for step in range(1, args.max_steps + 1):
        model.train()
        ids, targets, mask = sft_batch(tok, sft_rows[(step - 1) * args.batch_size:step * args.batch_size])
        for g in opt.param_groups:  # linear warmup over 20 steps, then constant
            g["lr"] = args.lr * min(1.0, step / 20)
        logp, _ = model(ids, target_ids=targets)
        loss = -(logp * mask).sum() / mask.sum()  # mean over response tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            probe = evaluate(model, tok, probe_rows, n=4, seed=step)
            done = probe["sampled"] >= args.target_acc
            if step % 50 == 0 or done:
                print(f"step {step:4d} | loss {loss.item():.4f} | probe greedy {probe['greedy']:.2f} "
                      f"sampled {probe['sampled']:.2f} | {time.time() - t0:.0f}s")
            if done:
                break

    hf.save_pretrained(model, model_dir)  # fp32, next to the tokenizer files
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    print(f"saved {model_dir} after {step} steps: {cfg.num_params():,} params, {size / 2**20:.2f} MiB")
    stats = evaluate(model, tok, val_rows, seed=args.seed)
    print("val: " + " | ".join(f"{k} {v:.3f}" for k, v in stats.items()) + f" | wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
