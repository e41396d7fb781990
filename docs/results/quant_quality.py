"""What the in-memory weight formats cost in quality: top-1 agreement and KL divergence against the exactly
dequantized f32 model, teacher-forced over answers from the training prompts (not Spec-Bench).

Each configuration runs the same token sequences (chat template: instruction and input as the user turn, the
reference answer as the assistant turn) in one forward; at every answer position it compares the next-token
distribution with the f32 model's. Configurations: `--quant auto` through specdec's matmul kernel (int8 activations),
the same weights through PyTorch's weight-only kernels (bf16 activations), and bf16 weights.

    python docs/results/quant_quality.py --texts 40 --json docs/results/quant-quality.json
    python docs/results/quant_quality.py -m gemma3-270m --texts 40 --json docs/results/quant-quality-gemma.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specdec import kernels
from specdec.loader import load


def texts(path: str, n: int) -> list[list[dict]]:
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            for inst in r["instances"][:1]:
                user = r["instruction"] + (f"\n\n{inst['input']}" if inst["input"] else "")
                out.append([{"role": "user", "content": user}, {"role": "assistant", "content": inst["output"]}])
            if len(out) >= n:
                break
    return out


def logprobs(lm, chats: list[list[dict]]) -> list[torch.Tensor]:
    outs = []
    with torch.inference_mode():
        for chat in chats:
            ids = lm.tokenizer.encode_chat(chat[:1])
            full = lm.tokenizer.encode_chat(chat, add_generation_prompt=False)
            logits, _ = lm.model(torch.tensor([full]), torch.arange(len(full)), lm.model.new_cache())
            outs.append(logits[0, len(ids) - 1:-1].float().log_softmax(-1))  # the answer's positions
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/train_prompts_seed_tasks.jsonl")
    ap.add_argument("--texts", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("-m", "--model", default=None, help="model (default: the embedded SmolLM2; gemma3-270m too)")
    args = ap.parse_args()
    chats = texts(args.data, args.texts)
    ref = logprobs(load(args.model, dtype="f32", quant="none"), chats)
    configs = {"auto, specdec matmul kernel (int8 activations)": ("auto", "bf16", ""),
               "auto, PyTorch weight-only kernels (bf16 activations)": ("auto", "bf16", "matmul"),
               "bf16 weights": ("none", "bf16", "")}
    table = {}
    print("| weights | top-1 agreement | KL(f32 || config) | positions |\n|---|---|---|---|")
    for name, (quant, dtype, off) in configs.items():
        os.environ["SPECDEC_NO_KERNELS"] = off
        kernels.matmul_lib.cache_clear()
        got = logprobs(load(args.model, dtype=dtype, quant=quant), chats)
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref, got, strict=True))
        kl = sum(float((a.exp() * (a - b)).sum()) for a, b in zip(ref, got, strict=True))
        n = sum(len(a) for a in ref)
        table[name] = {"top1": agree / n, "kl": kl / n, "positions": n}
        print(f"| {name} | {agree / n:.1%} | {kl / n:.4f} | {n} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "smollm2", "texts": args.texts, "data": args.data, "table": table}, f,
                      indent=1)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    main()
