"""Greedy generation through vLLM's ``LLM`` on a converted checkpoint, run as its own process.

Usage: ``python vllm_generate.py CHECKPOINT DTYPE PROMPT_IDS(comma-separated) NEW_TOKENS OUT.json``. Writes the
generated token ids and, for every generated position, the raw logits over the whole vocabulary (vLLM's
``logprobs_mode="raw_logits"``). A process of its own because vLLM's engine (distributed state, the CPU KV
cache) is set up once per process; the engine runs in this process (no engine-core subprocess) with a small KV
cache, the kernels in Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

KV_CACHE_BYTES = 64 << 20


def generate(checkpoint: str, dtype: str, prompt: list[int], new_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    with open(os.path.join(checkpoint, "config.json")) as handle:
        vocab = json.load(handle)["vocab_size"]
    llm = LLM(
        model=checkpoint,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        gpu_memory_utilization=0.1,
        logprobs_mode="raw_logits",
        max_logprobs=vocab,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=vocab, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    logits = []
    for step in output.logprobs:
        row = [0.0] * vocab
        for token, entry in step.items():
            row[token] = entry.logprob
        logits.append(row)
    return {"tokens": list(output.token_ids), "logits": logits}


if __name__ == "__main__":
    checkpoint, dtype, prompt, new_tokens, out = sys.argv[1:6]
    result = generate(checkpoint, dtype, [int(t) for t in prompt.split(",")], int(new_tokens))
    with open(out, "w") as handle:
        json.dump(result, handle)
