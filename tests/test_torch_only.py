"""The concurrent-method modules belong to the pip-installable library: torch only, small."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("factored", "subspace", "fira", "adaptive")


@pytest.mark.slow
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


def test_frugal_has_no_import_circle():
    """No module of frugal/ imports one that imports it back, not even lazily inside a function
    (hparams read FRUGAL's signature through such a late import once)."""
    import ast

    graph = {}
    for path in (ROOT / "frugal").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[path.stem] = deps - {"__init__"}

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, (*seen, d))) for d in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []
