"""The import graph between packages points one way (tools/check_layering.py)."""

import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_checker():
    path = ROOT / "tools" / "check_layering.py"
    spec = importlib.util.spec_from_file_location("check_layering", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checker = _load_checker()


def test_layering_holds_on_this_checkout():
    assert checker.check_repo(ROOT) == []


def _planted_repo(tmp_path: Path, package: str, source: str) -> Path:
    for name in ("mt-data", "mt-ops", "mt-models"):
        (tmp_path / "packages" / name / "src" / name.replace("-", "_")).mkdir(parents=True)
    target = tmp_path / "packages" / package / "src" / package.replace("-", "_") / "planted.py"
    target.write_text(source)
    return tmp_path


def test_layering_fails_on_a_planted_reverse_import(tmp_path):
    root = _planted_repo(tmp_path, "mt-ops", "import os\nfrom mt_models import build_model\n")
    problems = checker.check_repo(root)
    assert len(problems) == 1
    assert "packages/mt-ops/src/mt_ops/planted.py:2" in problems[0]
    assert checker.main([str(root)]) == 1


def test_layering_fails_on_a_sibling_import(tmp_path):
    root = _planted_repo(tmp_path, "mt-data", "import mt_ops.rms_norm\n")
    assert len(checker.check_repo(root)) == 1


def test_layering_fails_on_a_private_module_of_another_package(tmp_path):
    root = _planted_repo(tmp_path, "mt-models", "from mt_ops._secret import thing\n")
    problems = checker.check_repo(root)
    assert len(problems) == 1 and "private" in problems[0]
    root2 = _planted_repo(tmp_path / "b", "mt-models", "from mt_ops import _thing\n")
    assert len(checker.check_repo(root2)) == 1


def test_layering_fails_when_mt_data_imports_torch(tmp_path):
    root = _planted_repo(tmp_path, "mt-data", "import torch.nn\n")
    assert len(checker.check_repo(root)) == 1


def test_layering_allows_downward_and_own_private_imports(tmp_path):
    root = _planted_repo(
        tmp_path, "mt-models", "from mt_ops import rms_norm\nfrom mt_models._util import x\n"
    )
    assert checker.check_repo(root) == []
    shutil.rmtree(root)
