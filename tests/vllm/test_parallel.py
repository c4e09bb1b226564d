"""Tensor and expert parallelism on vLLM's CPU build: ``LLM(..., tensor_parallel_size=2)``, with and without
``enable_expert_parallel``, generates what ``load_hf_model`` generates on one device (two vLLM worker processes on
this machine, gloo between them).

The checkpoint is the act-order fixture (Qwen2-MoE g32, a stacked shared expert, its attention on our GPTQ linear
since vLLM's GPTQ method drops act-order): each tensor-parallel rank holds half of every expert's intermediate
size (gptq word order, cut on groups of 32) and half of the shared expert, its attention's q/k/v columns and
o_proj rows; each expert-parallel rank 4 of the 8 experts (pairs routed to the other rank's experts on a zero
expert) and half of the shared expert. vLLM all-reduces each block's output.
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm.test_llm_agreement import (
    NEW_TOKENS,
    RELATIVE_TOLERANCE,
    hf_generate,
    prompt_ids,
    vllm_generate,
)

CHECKPOINT = "qwen2moe-g32-actorder"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp2", "ep2"])
def test_two_ranks_generate_what_one_device_does(converted, parallel, tmp_path, monkeypatch):
    checkpoint = converted(CHECKPOINT)
    prompt = prompt_ids(CHECKPOINT)
    monkeypatch.setenv("REPACK_TEST_PARALLEL", parallel)
    result = vllm_generate(checkpoint, "float16", "vllm", "host", prompt, NEW_TOKENS, tmp_path)
    tokens, logits = hf_generate(checkpoint, torch.float16, prompt, NEW_TOKENS)
    relative = float((torch.tensor(result["logits"]) - logits).abs().max() / logits.abs().max())
    print(f"{CHECKPOINT} {parallel}: vLLM {result['tokens']} transformers {tokens}, relative {relative:.2e}")
    assert result["gptq_linears"] == ["RepackGptqLinearMethod"]  # act-order: our linear, cut per rank
    assert result["tokens"] == tokens
    assert relative <= RELATIVE_TOLERANCE, f"relative logit error {relative:.2e}"
