"""The concurrent-method modules belong to the pip-installable library: torch only, small."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("factored", "subspace", "fira", "adaptive")


def test_concurrent_modules_import_nothing_but_torch():
    code = (
        "import sys\n"
        + "".join(f"import frugal.{m}\n" for m in MODULES)
        + "banned = ('transformers', 'hydra', 'accelerate', 'datasets', 'omegaconf', 'wandb',"
        " 'models', 'data', 'train_utils', 'fira', 'scipy')  # fira: the reference package\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
