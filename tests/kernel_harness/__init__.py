"""The CPU execution harness: the exact CUDA kernel source, compiled with g++ and run on the CPU
with real barriers, checked warp collectives, NaN-filled shared memory and guarded buffers.

`build.py` compiles the source (inline asm mapped to emulations), `runtime.cpp` schedules each
block's threads as user-space threads, `cuda_emulation.h` is the CUDA language on the host, and
`executor.py` plugs it under the backend's own launchers (`AttentionKernels(HarnessExecutor())`).
"""
