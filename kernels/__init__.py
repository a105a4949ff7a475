"""Attention and KV-cache kernels: each Triton kernel sits next to a plain-PyTorch reference of the same
function. The engine uses the Triton versions on CUDA and the references on CPU (and as the test oracle).

Name clash guard: Hugging Face ships a distribution also imported as ``kernels``, and transformers probes
for it (``is_kernels_available``): ``find_spec("kernels")`` finds this package, then the version is taken
from the distribution that ships it (radixinfer, e.g. 0.1.0, when installed), or, with no metadata (a
plain checkout), from ``kernels.__version__`` after importing this file. transformers accepts only versions
in its own window (0.18.2 <= v < 0.19 in transformers 5.23), so this package must:

- define no ``__version__`` (the fallback then reads "N/A" and the probe answers False), and
- import nothing here (transformers imports this file inside ``import transformers``-time checks).

radixinfer's own version must stay outside that window too; tests/test_kernels_package.py checks both cases
in a fresh interpreter. The two packages still cannot be installed side by side: they own the same
top-level directory.
"""
