"""The GPU image's Python dependencies resolve, and the Dockerfile pins what pyproject.toml pins.

The image (Dockerfile) starts from SGLang's, adds TransformerEngine, then `pip install -e
".[gpu,ray]"`. No GPU is needed to know whether that can resolve: uv resolves the same set from
PyPI's metadata for the image's Python and platform, without downloading a CUDA wheel. A pin that
cannot resolve (sglang 0.5.23 pins xgrammar==0.2.7) fails here rather than in a cluster's build.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from uv import find_uv_bin

ROOT = Path(__file__).resolve().parent.parent
# SGLang's CUDA 13 images: Python 3.12 on glibc >= 2.35 (sglang 0.5.23's wheel is manylinux_2_34).
PYTHON, PLATFORM = "3.12", "x86_64-manylinux_2_35"

pytestmark = pytest.mark.network  # resolves against pypi.org


def dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return {name: value.strip('"') for name, value in re.findall(r"^ARG (\w+)=(\S+)", text, re.M)}


def te_requirement() -> Requirement:
    """The TransformerEngine requirement the Dockerfile installs, its version filled in."""
    text = (ROOT / "Dockerfile").read_text()
    found = re.search(r'"(transformer[-_]engine\[[^\]]*\])==\$\{TE_VERSION\}"', text)
    assert found, "Dockerfile: no `transformer_engine[...]==${TE_VERSION}` requirement"
    return Requirement(f"{found.group(1)}=={dockerfile_args()['TE_VERSION']}")


def sglang_version(tag: str) -> str:
    found = re.fullmatch(r"v(\d+\.\d+\.\d+(?:\.post\d+)?)", tag)
    assert found, (
        f"Dockerfile: SGLANG_TAG={tag!r} is not a release tag vX.Y.Z (SGLang's CUDA 13 images; CUDA 12 ones stopped at v0.5.19-cu129)"
    )
    return found.group(1)


def pyproject_pins() -> dict[str, set[str]]:
    """The versions pinned (`==`) in the gpu, ray and dev extras, by package name."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins: dict[str, set[str]] = {}
    for line in (line for extra in ("gpu", "ray", "dev") for line in extras[extra]):
        requirement = Requirement(line)
        pins.setdefault(requirement.name, set()).update(s.version for s in requirement.specifier if s.operator == "==")
    return pins


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`.[gpu,ray]` with the image's sglang and TransformerEngine, resolved: version by name."""
    tmp = tmp_path_factory.mktemp("gpu-deps")
    (tmp / "image.in").write_text(f"sglang=={sglang_version(dockerfile_args()['SGLANG_TAG'])}\n{te_requirement()}\n")
    # TE's torch extension is an sdist whose published metadata names the CUDA 12 core; the image
    # builds it against its own torch (--no-build-isolation), which then names the CUDA 13 core
    # (its setup.py: transformer_engine_cu{torch.version.cuda major}).
    (tmp / "excludes.txt").write_text("transformer-engine-cu12\n")
    argv = [
        find_uv_bin(),
        "pip",
        "compile",
        str(ROOT / "pyproject.toml"),
        str(tmp / "image.in"),
        "--extra",
        "gpu",
        "--extra",
        "ray",
        "--python-version",
        PYTHON,
        "--python-platform",
        PLATFORM,
        "--index-url",
        "https://pypi.org/simple",
        "--excludes",
        str(tmp / "excludes.txt"),
        "--no-config",
        "--no-header",
        "--no-annotate",
        "--quiet",
        "--cache-dir",
        str(tmp / "uv-cache"),
    ]
    env = {
        **os.environ,
        "UV_PYTHON_INSTALL_DIR": str(tmp / "uv-python"),
        "UV_PYTHON_DOWNLOADS": "never",
    }  # nothing kept outside tmp
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp, env=env)
    assert done.returncode == 0, f"the GPU image's dependencies do not resolve:\n{done.stderr}"
    pins = [
        Requirement(line.split(";")[0])
        for line in done.stdout.splitlines()
        if "==" in line and not line.startswith("#")
    ]
    return {r.name: next(iter(r.specifier)).version for r in pins}


def test_dockerfile_pins_are_the_resolved_versions(resolved):
    args = dockerfile_args()
    assert resolved["sglang"] == sglang_version(args["SGLANG_TAG"])
    assert resolved["megatron-core"] == args["MEGATRON_CORE_VERSION"]
    assert resolved["ray"] == args["RAY_VERSION"]
    # TransformerEngine's core for CUDA 13, as the image's torch: sglang 0.5.23 pins 2.14.1, a CUDA 13 build.
    assert resolved["transformer-engine"] == resolved.get("transformer-engine-cu13") == args["TE_VERSION"]
    assert resolved["torch"] == "2.14.1"
    assert resolved["xgrammar"] == "0.2.7"  # sglang 0.5.23's pin, which the built-in engine must work with too


def test_pins_agree_across_dockerfile_pyproject_and_megatron():
    args, pins = dockerfile_args(), pyproject_pins()
    assert pins["megatron-core"] == {args["MEGATRON_CORE_VERSION"], importlib.metadata.version("megatron-core")}
    assert pins["ray"] == {args["RAY_VERSION"]}
    # megatron-core's own TransformerEngine requirement (its `dev` extra): the version range and
    # the CUDA 13 core.
    te = te_requirement()
    wanted = next(
        Requirement(r)
        for r in importlib.metadata.requires("megatron-core")
        if Requirement(r).name == "transformer-engine"
    )
    assert wanted.specifier.contains(args["TE_VERSION"], prereleases=True), (str(te), str(wanted))
    assert {e.replace("-", "_") for e in wanted.extras} <= {e.replace("-", "_") for e in te.extras}, (
        str(te),
        str(wanted),
    )


def test_dockerfile_refers_to_nothing_outside_the_repository():
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"\.\./|/wor[k]/|note[s]/", text)  # bracketed, so that no grep for those paths finds this line
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"Dockerfile: COPY {path}: no such file in the repository"
