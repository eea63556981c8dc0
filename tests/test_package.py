"""`frugal/` is what people pip install: it builds with `python -m build`, the wheel holds only the
package (plus metadata and the license) and imports with torch alone."""
import email
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import frugal

ROOT = Path(__file__).resolve().parent.parent
BANNED = ("transformers", "hydra", "accelerate", "datasets", "omegaconf", "wandb", "models", "data", "train_utils")


@pytest.mark.slow
def test_frugal_imports_nothing_but_torch():
    """A fresh interpreter, so modules loaded by other tests cannot hide an import. Nor does `import
    frugal` load torch's DTensor (sympy and the DTensor op registry, ~1 s of every start-up), and
    `import train` not torch.distributed.checkpoint: each is imported where a sharded run needs it."""
    heavy = ("torch.distributed.tensor", "torch.distributed.checkpoint")
    code = (f"import sys, frugal\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {BANNED!r}))\n"
            f"print([m for m in {heavy!r} if m in sys.modules])\nimport train\n"
            f"print([m for m in {heavy[1:]!r} if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "[]", "[]"], out.stdout


def test_metadata_and_one_torch_policy():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert meta["tool"]["setuptools"]["packages"] == ["frugal"]
    assert project["dynamic"] == ["version"] and "version" not in project
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "frugal.__version__"}
    # the library: a floor, no cap; numpy only so that `import torch` (hence `import frugal`) does not warn
    assert project["dependencies"] == ["torch>=2.4", "numpy>=1.21"]
    assert all(">=" in req for reqs in project["optional-dependencies"].values() for req in reqs)
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert all(url.startswith("https://") for url in project["urls"].values())

    requirements = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    requirements = [r for r in requirements if r]
    # the research set-up: the same floor, capped at the tested version; every line has a floor
    assert "torch>=2.6,<2.14" in requirements
    assert requirements[-1] == "-e ."  # the library itself, editable (below)
    assert all(">=" in r for r in requirements[:-1])
    assert not any(r.startswith("torchdata") for r in requirements)  # never imported


@pytest.mark.slow
def test_after_the_readme_set_up_frugal_imports_from_any_directory(tmp_path):
    """requirements.txt ends with `-e .`: the set-up (pip install -r requirements.txt) installs the
    library editable, so `import frugal` works outside the checkout and is the checkout's code."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", "import frugal; print(frugal.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert found.returncode == 0, ("import frugal failed outside the checkout: run the README's set-up "
                                   "(pip install -r requirements.txt)\n" + found.stderr[-1500:])
    assert Path(found.stdout.strip()).resolve() == (ROOT / "frugal" / "__init__.py").resolve()


@pytest.mark.slow
def test_build_wheel_holds_only_frugal_and_imports_with_torch_alone(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves no egg-info or build/ in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "frugal", source / "frugal", ignore=shutil.ignore_patterns("__pycache__"))
    # --no-isolation: build with the installed setuptools, nothing is downloaded
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]  # needs `build` (requirements.txt)

    version = frugal.__version__
    sdist, = (tmp_path / "dist").glob("*.tar.gz")
    assert sdist.name == f"frugal_optim-{version}.tar.gz"
    wheel, = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == f"frugal_optim-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = f"frugal_optim-{version}.dist-info/"
        assert {n.split("/")[0] + "/" for n in names} == {"frugal/", dist_info}
        assert sorted(n for n in names if n.startswith("frugal/")) == sorted(
            f"frugal/{p.name}" for p in (ROOT / "frugal").glob("*.py"))
        assert f"{dist_info}licenses/LICENSE" in names
        metadata = email.message_from_bytes(archive.read(f"{dist_info}METADATA"))
        archive.extractall(tmp_path / "site")
    assert metadata["Version"] == version and metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("Requires-Dist")[:2] == ["torch>=2.4", "numpy>=1.21"]
    assert {"apollo", "adam-mini"} <= set(metadata.get_all("Provides-Extra"))
    assert any(url.startswith("Paper, https://arxiv.org/abs/") for url in metadata.get_all("Project-URL"))

    # The unpacked wheel, run outside the checkout: frugal comes from it, nothing but torch loads,
    # and a FRUGAL step runs on a plain torch model.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import torch, frugal\n"
        "assert frugal.__file__.startswith(sys.argv[1]), frugal.__file__\n"
        "layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])\n"
        "opt = frugal.FRUGAL(layers, density=0.25)\n"
        "layers(torch.randn(2, 8)).sum().backward(); opt.step()\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {BANNED!r}), frugal.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", version]
