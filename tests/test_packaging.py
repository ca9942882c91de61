"""Every package builds alone, and mt-data and mt-ops install alone (ARCHITECTURE.md §1).

Builds each wheel with ``uv build --package NAME --no-sources`` (so no workspace path
leaks into the metadata), then installs mt-data and mt-ops, each into a fresh virtual
environment, imports them and runs mt-data's command line. Installing mt-data must not
bring torch.
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["mt-data", "mt-ops", "mt-models", "mt-parallel", "mt-train"]

pytestmark = pytest.mark.slow


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    return uv


def _run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    dist = tmp_path_factory.mktemp("dist")
    for name in PACKAGES:
        _run(_uv(), "build", "--package", name, "--no-sources", "--wheel", "-o", dist, cwd=ROOT)
    found = {}
    for name in PACKAGES:
        matches = list(dist.glob(f"{name.replace('-', '_')}-*.whl"))
        assert len(matches) == 1, f"{name}: {matches}"
        found[name] = matches[0]
    return found


def _fresh_venv(path: Path) -> Path:
    _run(_uv(), "venv", "--quiet", "--python", sys.executable, str(path))
    return path / "bin" / "python"


def test_every_package_builds_a_wheel_alone(wheels):
    assert set(wheels) == set(PACKAGES)


def test_mt_data_installs_alone_without_torch(wheels, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    _run(_uv(), "pip", "install", "--quiet", "--python", str(python), str(wheels["mt-data"]))
    installed = _run(_uv(), "pip", "list", "--python", str(python)).stdout.lower()
    assert "mt-data" in installed
    assert "torch" not in installed, installed
    code = "import mt_data; mt_data.TokenDataset; print(mt_data.default_tokenizer_path())"
    assert "tokenizer.json" in _run(str(python), "-c", code).stdout
    cli = _run(str(python.parent / "mt-data"), "--help").stdout
    assert "build" in cli
    _run(str(python), "-m", "mt_data", "build", "--help")


def test_mt_ops_installs_alone(wheels, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    # The same torch as this environment, so the install comes from uv's cache.
    torch_pin = f"torch=={importlib.metadata.version('torch')}"
    _run(_uv(), "pip", "install", "--quiet", "--python", python, wheels["mt-ops"], torch_pin)
    installed = _run(_uv(), "pip", "list", "--python", str(python)).stdout.lower()
    assert "mt-models" not in installed and "mt-data" not in installed
    code = "import torch, mt_ops; print(mt_ops.rms_norm(torch.randn(3, 8), torch.ones(8)).shape)"
    assert "torch.Size([3, 8])" in _run(str(python), "-c", code).stdout
