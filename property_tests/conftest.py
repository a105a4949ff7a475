"""Hypothesis profiles for the property suite, chosen by ``HYPOTHESIS_PROFILE``.

* ``ci``: bounded and derandomized, so CI is reproducible and the whole suite stays within ~3 minutes on
  2 cores.
* ``dev`` (default when unset): about ci's size, but random, with the example database, so local runs
  keep exploring and replay past failures first.
* ``thorough``: many more and longer runs, for before a release or after touching ``radixinfer/cache``.
"""

import os

from hypothesis import HealthCheck, settings

_common = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

settings.register_profile(
    "ci", max_examples=400, stateful_step_count=50, derandomize=True, database=None, **_common
)
settings.register_profile("dev", max_examples=300, stateful_step_count=50, **_common)
settings.register_profile("thorough", max_examples=5000, stateful_step_count=100, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
