"""The kernel wing: one module per kernel family, shared jit helpers, routing, alignment, the GPTQ linear."""
