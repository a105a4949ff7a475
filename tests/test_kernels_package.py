"""Our top-level package `kernels` must never make transformers believe Hugging Face's `kernels` is installed.

transformers probes `is_kernels_available()` with `find_spec("kernels")` (which finds ours) and then a
version, from the metadata of a distribution named `kernels`, else of the distributions that ship a
`kernels` package (radixinfer, once installed from a wheel), else from `kernels.__version__`. It accepts
only versions in ``[KERNELS_MIN_VERSION, KERNELS_MAX_VERSION)``. Each probe runs in a fresh interpreter
because the answer is cached per process.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.metadata, importlib.util, json, sys
if sys.argv[1] == "hide-radixinfer-metadata":  # a plain checkout: no installed radixinfer to map `kernels` to
    _version = importlib.metadata.version
    def version(name):
        if name == "radixinfer":
            raise importlib.metadata.PackageNotFoundError(name)
        return _version(name)
    importlib.metadata.version = version
from transformers.utils import import_utils
print(json.dumps({
    "origin": importlib.util.find_spec("kernels").origin,
    "distributions": importlib.metadata.packages_distributions().get("kernels", []),
    "available": import_utils.is_kernels_available(),
}))
"""


def probe(pythonpath: Path, cwd: Path, mode: str) -> dict:
    env = {"PATH": "", "PYTHONPATH": str(pythonpath), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_source_tree_is_not_hugging_face_kernels():
    """No distribution metadata (hidden, in case this checkout is also pip-installed): transformers falls back
    to importing our `kernels` and finds no `__version__`."""
    result = probe(ROOT, ROOT, "hide-radixinfer-metadata")
    assert result["origin"] == str(
        ROOT / "kernels" / "__init__.py"
    )  # the probe really saw our package
    assert result["available"] is False


def test_installed_wheel_is_not_hugging_face_kernels(tmp_path):
    """What a wheel install leaves behind, reproduced without building one: our `kernels` package plus a
    `radixinfer` dist-info whose RECORD and top_level.txt list it, so `kernels` maps to radixinfer's version
    (read from pyproject.toml, so a version bump into the accepted range fails here)."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(
        1
    )
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "kernels", site / "kernels", ignore=shutil.ignore_patterns("__pycache__")
    )
    dist_info = site / f"radixinfer-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: radixinfer\nVersion: {version}\n"
    )
    (dist_info / "top_level.txt").write_text("kernels\nradixinfer\n")
    files = [p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()]
    (dist_info / "RECORD").write_text(
        "".join(f"{f},,\n" for f in files) + f"{dist_info.name}/RECORD,,\n"
    )

    result = probe(site, tmp_path, "as-installed")
    assert result["origin"] == str(site / "kernels" / "__init__.py")
    assert set(result["distributions"]) == {
        "radixinfer"
    }  # the probe really went through the metadata mapping
    assert result["available"] is False
