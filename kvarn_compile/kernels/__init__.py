"""Triton kernels of kvarn_compile (tested on CPU through ``TRITON_INTERPRET=1``)."""
