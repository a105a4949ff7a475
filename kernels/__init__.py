"""Attention and KV-cache kernels: each Triton kernel sits next to a plain-PyTorch reference of the same
function. The engine uses the Triton versions on CUDA and the references on CPU (and as the test oracle)."""
