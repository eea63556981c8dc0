"""`frugal/` is what people pip install: it must import with torch alone."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_frugal_imports_nothing_but_torch():
    # A fresh interpreter, so modules loaded by other tests cannot hide an import.
    code = (
        "import sys, frugal\n"
        "banned = ('transformers', 'hydra', 'accelerate', 'datasets', 'omegaconf', 'wandb', 'models', 'data', 'train_utils')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_pyproject_packages_only_frugal_with_torch_dependency():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["tool"]["setuptools"]["packages"] == ["frugal"]
    assert [d.split(">")[0].split("=")[0].strip() for d in meta["project"]["dependencies"]] == ["torch"]
