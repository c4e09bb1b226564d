"""Facts about Hopper (sm_90) the CPU compile tests check kernels against (test_kernel_compile_sm90.py runs itself
as a script in a subprocess, so it keeps its own copy of the limit)."""

SM90_SHARED_LIMIT = 232448  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
