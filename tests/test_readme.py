"""Every command block of README.md and of the docs/*.md pages runs, at toy scale, so the documentation
cannot drift from the code. A block is tested where it lives: moving a section from the README to a page
of docs/ keeps its blocks under test, with ids naming the file and line (`README.md:35`,
`docs/benchmarks.md:28`).

The convention (README and docs authors: this is all there is to it):

- A command block is a code block (indented or fenced) whose first line starts with `python`,
  `torchrun`, `accelerate`, `sbatch` or `pip`; `\\` continues a line, `#` starts a comment, `&&` chains.
  Other blocks (the layout tree) are text. A fenced ```python block is executed as Python with `model`
  bound to a tiny LLaMA (the library example's "your model"), in a directory where `multirun/table15`
  holds three jobs of the README's toy sweep (made up: docs/results.md's own table reads them); a sketch
  that cannot run on its own (it names a `cfg` it never builds) is fenced without a language, as text.
- Every command block runs, its commands in order, in a fresh working directory (so relative outputs
  such as `multirun/table15` are the block's own), with `train.py`, `eval.py` and the programs of
  `scripts/`, `ops/` and `bench/` (`python -m scripts.make_tables`) taken from the repository and the Hub,
  wandb and the network off. Each `python script.py` or `python -m scripts.NAME` command is its own
  process, forked from an interpreter that has already imported torch, transformers and train.py
  (tests/_forkserver.py: the same exit code, output and files as a fresh process, ~4.5 s sooner), and so
  are the `python train.py` runs such a program starts with subprocess.run (the mini reproduction's,
  bench.train_step's, ops.fault_inject's plain runs: the fork server's nested runs).
- A block that cannot run here says why on the line before it: `<!-- readme-test: skip hub -->`
  (needs the Hugging Face Hub), `gpu` (needs GPUs) or `slurm` (needs a SLURM cluster). Nothing else may
  be skipped. `pip install` (the tests run in the installed environment) and `python -m pytest` (this
  suite) are never run.
- Toy scale: `debug=toy` (configs/debug/toy.yaml, the README's own switch) is added to every train.py
  command that does not name it, then `TOY` shortens it further for the suite (Hydra: the last value of a
  key wins): a command keeps its own preset, optimizer and swept keys, and trains a 4-layer model of its
  family for 2 steps, on the synthetic corpus unless it names its data (`data=...`; a `data.path` alone
  is an error here: debug=toy would replace the preset's data); the scripts get `SCRIPT_ARGS`
  (argparse: the last value wins), which cut the benchmarks, the fault injection and the mini
  reproduction to one small case each (their documented figures come from the full commands).
- Example paths: `EXAMPLE_PATHS` maps the README's placeholder paths to data built by the test (a C4-
  format corpus and a T5-style tokenizer from tests/conftest.py); a runnable command with any other
  absolute path fails here, until it is mapped.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from _forkserver import REPO_PACKAGES, run_python

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # every page whose blocks run
PROGRAMS = ("python", "torchrun", "accelerate", "sbatch", "pip")
SKIP_REASONS = {"hub": "needs the Hugging Face Hub", "gpu": "needs GPUs", "slurm": "needs a SLURM cluster"}
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s+(\w+)\s*-->")
DEBUG = "debug=toy"
TOY = ["train.steps=2", "schedule.warmup_steps=1", "train.batch_size=4", "train.eval_tokens=64", "data.seq_len=32",
       "train.plot=false", "train.progress_bar=false"]
SMALL_CORPUS = ROOT / "tests" / "assets" / "tinyshakespeare_slice.txt"  # stands in for the documented corpus
FAULT_KINDS = ("kills", "signals", "damage", "disk-full", "early", "writers", "forged", "resize", "dcp", "diverge",
               "late", "garbage", "badline", "stale", "fullmeta")
SCRIPT_ARGS = {  # keyed by script (train.py, eval.py) or module (python -m scripts.NAME, ops.NAME, bench.NAME)
    "scripts.pretokenize": ["--train-rows", "64", "--val-tokens", "5000", "data.seq_len=32"],
    "scripts.memory_table": ["--measure-max-params", "0"],
    "eval.py": ["train.eval_tokens=64"],
    "bench.llama7b": ["--model", "llama_tiny"],  # the 7B steps take minutes and ~17 GiB
    # --validate: one fp32 case (case 11; every case: test_memory_plan; bf16 autocast costs ~7x more on
    # a CPU without native bf16); --table: one model
    "bench.memory_plan": ["--cases", "11/1000", "--models", "llama_60m"],
    # the benchmarks: one round of one method beside AdamW, on the smallest model each takes
    "bench.optimizer": ["--models", "llama_60m", "--rounds", "1", "--steps", "1", "--only",
                        "frugal block 0.25"],
    "bench.train_step": ["--model", "llama_tiny", "--steps", "2", "--warmup", "1", "--rounds", "1",
                         "--methods", "FRUGAL 0.25", "--batch-size", "2", "--micro-batch-size", "2", "--seq-len", "32"],
    "bench.data": ["--docs", "300"],
    # the vote's byte and time tables: one case (the vote, 2 ranks, unshaped, 1 step of llama_tiny); its simulator,
    # compute and payload tables: one small case each
    "bench.comm": ["--model", "llama_tiny", "--vocab", "512", "--worlds", "2", "--modes", "vote", "--rates",
                   "unshaped", "--steps", "1", "--warmup", "1", "--elements", "2000", "--sim_worlds", "3",
                   "--noise", "1", "--compute_elements", "1000",
                   "--payload_models", "llama_tiny", "--payload_densities", "0.25"],
    "scripts.figure3_reprojection": ["--runs", "2", "--steps", "30"],
    # one trial (a damaged file) after the reference run, instead of 25 trials in ~13 minutes
    "ops.fault_inject": [*(a for kind in FAULT_KINDS for a in (f"--{kind}", "0")), "--damage", "1",
                         "--workdir", "fault_inject"],
    # a 40k-character slice of the corpus, a 2-layer model, 2 steps per run, no optional rows
    "scripts.mini_repro": ["--corpus", str(SMALL_CORPUS), "--workdir", "mini_repro", "--vocab", "300",
                           "--steps", "2", "--batch", "2", "--seq-len", "32", "--evals", "1", "--eval-tokens",
                           "256", "--lr-grid", "1e-3", "--extras", "", "--hidden", "32", "--intermediate", "64",
                           "--layers", "2", "--heads", "2", "--update-gap", "1"],
}


def blocks(text: str) -> list[dict]:
    """Code blocks of a markdown text: {"line", "lang", "lines", "skip"}."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        start = i
        if line.startswith("```"):
            lang, body = line[3:].strip(), []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            i += 1
        elif line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            lang, body = "", []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            while body and not body[-1].strip():
                body.pop()
        else:
            i += 1
            continue
        before = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = MARKER.search(before)
        out.append({"line": start + 1, "lang": lang, "lines": body, "skip": marker.group(1) if marker else None})
    return out


def commands(body: list[str]) -> list[str] | None:
    """The commands of a command block (None for a text block)."""
    if not body or not body[0].startswith(PROGRAMS):
        return None
    joined, buf = [], ""
    for line in body:
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        joined.append(buf)
        buf = ""
    out = []
    for line in joined:
        tokens = shlex.split(line, comments=True)
        if not tokens:
            continue
        assert tokens[0] in PROGRAMS, f"not a command in a command block: {line!r}"
        out += [" ".join(map(shlex.quote, part)) for part in _split_and(tokens)]
    return out


def _split_and(tokens: list[str]) -> list[list[str]]:
    parts, cur = [], []
    for t in tokens:
        if t == "&&":
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    return parts + [cur]


def page_blocks(pages: list[Path]) -> list[dict]:
    """The blocks of every page, each with "where": the page (relative to the repository) and line."""
    return [{**b, "where": f"{page.relative_to(ROOT).as_posix()}:{b['line']}"}
            for page in pages for b in blocks(page.read_text())]


ALL_BLOCKS = page_blocks(PAGES)
COMMAND_BLOCKS = [b for b in ALL_BLOCKS if b["lang"] != "python" and commands(b["lines"])]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b["lang"] == "python"]


def test_readme_has_command_blocks_and_every_skip_has_a_known_reason():
    """README.md and docs/*.md: the README keeps command blocks of its own, and docs/ has more."""
    readme = [b for b in COMMAND_BLOCKS if b["where"].startswith("README.md:")]
    assert len(readme) >= 5 and len(COMMAND_BLOCKS) > len(readme) and PYTHON_BLOCKS
    for b in ALL_BLOCKS:
        assert b["skip"] in (None, *SKIP_REASONS), f"{b['where']}: unknown skip reason {b['skip']!r}"
        if b["skip"]:
            assert b in COMMAND_BLOCKS, f"{b['where']}: a skip marker on a block that is not a command block"


@pytest.fixture
def example_paths(c4_dir, t5_tokenizer_dir, tmp_path):
    return {"/data/c4_t5": str(tmp_path / "c4_t5"), "/data/c4": str(c4_dir), "/models/t5-base": str(t5_tokenizer_dir)}


def _map_paths(token: str, paths: dict) -> str:
    for example in sorted(paths, key=len, reverse=True):
        token = re.sub(re.escape(example) + r"(?![\w.-])", paths[example], token)
    return token


def toy_command(command: str, paths: dict) -> list[str]:
    """The argv that runs `command` here at toy scale (see the module docstring)."""
    tokens = [_map_paths(t, paths) for t in shlex.split(command)]
    mapped = set(paths.values())
    for t in tokens:
        value = t.split("=", 1)[-1]
        assert not value.startswith("/") or any(value.startswith(m) for m in mapped), \
            f"{command!r}: example path {value!r} is not in EXAMPLE_PATHS (tests/test_readme.py)"
    program, args = tokens[0], tokens[1:]
    if program == "torchrun":
        program, args = sys.executable, ["-m", "torch.distributed.run", *args]
    elif program == "python":
        program = sys.executable
    else:
        raise AssertionError(f"{command!r}: `{program}` cannot run here; mark the block with a skip reason")
    script_at = _program_at(args)
    script = args[script_at]
    if script.endswith(".py"):  # a module runs from the repository on PYTHONPATH, as `python -m` finds it
        args[script_at] = str(ROOT / script)
    if script == "train.py":
        names_path, names_data = (any(a.startswith(p) for a in args) for p in ("data.path=", "data="))
        assert names_data or not names_path, \
            f"{command!r}: name the data option with its path (data=c4 data.path=...): debug=toy would replace it"
        args += ([] if DEBUG in args else [DEBUG]) + TOY
    cut = args.index("--") if "--" in args[script_at:] else len(args)  # the script's own options end at --
    args[cut:cut] = SCRIPT_ARGS.get(script, [])
    return [program, *args]


def _program_at(args: list[str]) -> int:
    """Where the program a command runs is in its arguments: its script (`train.py`) or the repository's module
    after `-m` (`python -m scripts.make_tables`; torchrun's own `-m torch.distributed.run` is not it)."""
    return next(i for i, a in enumerate(args)
                if a.endswith(".py") or (i and args[i - 1] == "-m" and a.split(".")[0] in REPO_PACKAGES))


def _never_run(command: str) -> bool:
    tokens = shlex.split(command)
    return tokens[0] == "pip" or tokens[:3] == ["python", "-m", "pytest"]


@pytest.mark.slow
@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=[b["where"] for b in COMMAND_BLOCKS])
def test_readme_command_block_runs(block, example_paths, tmp_path):
    if block["skip"]:
        pytest.skip(f"{block['where']}: {SKIP_REASONS[block['skip']]}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    for command in commands(block["lines"]):
        if _never_run(command):
            continue
        argv = toy_command(command, example_paths)
        proc = run_python(argv, cwd=workdir, env=env, timeout=900, nested=True)  # forked from a warm interpreter
        assert proc.returncode == 0, (f"{block['where']}: {command}\nran as: {' '.join(argv)}\n"
                                      f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b["where"] for b in PYTHON_BLOCKS])
def test_readme_python_block_runs(block, tmp_path, monkeypatch):
    """Run in a fresh working directory (the HF Trainer block writes its output_dir there)."""
    monkeypatch.chdir(tmp_path)
    import torch
    import yaml
    from test_sweep_view import write_run

    import models

    for job, gap in enumerate((10, 50, 200)):  # python train.py -m experiment=table15_update_gap debug=toy ...
        write_run(tmp_path / "multirun" / "table15", str(job), ["experiment=table15_update_gap",
                  f"optimizer.update_gap={gap}", "debug=toy"], ppl=30.0 - job, table="table15_update_gap",
                  optimizer={"update_gap": gap}, debug="toy")

    torch.manual_seed(0)
    cfg = yaml.safe_load((ROOT / "configs" / "model" / "llama_tiny.yaml").read_text())
    exec(compile("\n".join(block["lines"]), block["where"], "exec"),
         {"model": models.build_model(cfg, vocab_size=512)})


def test_block_parser():
    text = "intro\n\n    python train.py a=1 \\\n        b=2   # note\n    pip install x && python eval.py\n\n" \
           "<!-- readme-test: skip gpu -->\n\n    torchrun --nproc_per_node 8 train.py\n\n" \
           "```\nfrugal/  the library\n```\n"
    got = blocks(text)
    assert [b["skip"] for b in got] == [None, "gpu", None]
    assert commands(got[0]["lines"]) == ["python train.py a=1 b=2", "pip install x", "python eval.py"]
    assert commands(got[2]["lines"]) is None
    paths = {"/data/c4": "/tmp/c4", "/data/c4_t5": "/tmp/t5"}
    argv = toy_command("python train.py data=c4 data.path=/data/c4 x=/data/c4_t5", paths)
    assert argv[3:5] == ["data.path=/tmp/c4", "x=/tmp/t5"] and argv[5:] == [DEBUG, *TOY]
    assert toy_command("python train.py -m experiment=table2 debug=toy", paths)[-len(TOY) - 1:] == [DEBUG, *TOY]
    with pytest.raises(AssertionError, match="name the data option"):
        toy_command("python train.py data.path=/data/c4", paths)
    with pytest.raises(AssertionError, match="not in EXAMPLE_PATHS"):
        toy_command("python train.py data=local data.path=/somewhere/else", paths)
    assert toy_command("python -m bench.data --docs 10 -- x=1", paths) == [
        sys.executable, "-m", "bench.data", "--docs", "10", *SCRIPT_ARGS["bench.data"], "--", "x=1"]
    torchrun = toy_command("torchrun --nproc_per_node 2 train.py", paths)
    assert torchrun[1:6] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "train.py")]


def test_script_args_name_programs_that_exist():
    """A key of SCRIPT_ARGS is a script of the repository or a module of its program folders: one left behind by a
    rename would silently stop cutting its command to toy scale."""
    import importlib.util

    for key in SCRIPT_ARGS:
        assert (ROOT / key).is_file() if key.endswith(".py") else importlib.util.find_spec(key), key


# ------------------------------------------------------------------ the commands as written, composed
def _world_size(program: str, launcher_args: list[str], launcher) -> int:
    """The number of processes a README command starts: torchrun's --nproc_per_node x --nnodes,
    accelerate's --num_processes, or the Hydra launcher's nodes x tasks_per_node."""
    def option(name: str, default: int) -> int:
        for i, a in enumerate(launcher_args):
            if a == name and i + 1 < len(launcher_args):
                return int(launcher_args[i + 1])
            if a.startswith(name + "="):
                return int(a.split("=", 1)[1])
        return default

    if program == "torchrun":
        return option("--nproc_per_node", 1) * option("--nnodes", 1)
    if program == "accelerate":
        return option("--num_processes", 1)
    if launcher is not None and "tasks_per_node" in launcher:
        return int(launcher.nodes) * int(launcher.tasks_per_node)
    return 1


def _sweep_values(text: str) -> list[str]:
    return [v.strip() for v in str(text).split(",")]


def _train_commands(block: dict) -> list[tuple[str, str]]:
    """(id, command) of a block's train.py commands: `page:line`, or `page:line-N` for the N-th of several."""
    found = [c for c in commands(block["lines"]) if " train.py" in f" {c}" and not _never_run(c)]
    return [(block["where"] + (f"-{i}" if len(found) > 1 else ""), c) for i, c in enumerate(found, 1)]


TRAIN_COMMANDS = [pair for b in COMMAND_BLOCKS for pair in _train_commands(b)]


@pytest.mark.parametrize("where, command", TRAIN_COMMANDS, ids=[where for where, _ in TRAIN_COMMANDS])
def test_readme_train_command_is_valid_as_written(where, command):
    """Every train.py command of the README and docs/, skipped blocks included (GPU, SLURM), composes as written
    and passes the start-up checks for the number of processes it starts, for every job of its sweep
    (the command's comma lists and the preset's own sweep): the toy-scale run above replaces the batch
    settings, so a batch that does not divide over 8 GPUs would pass there and fail here."""
    import itertools

    from _train_helpers import compose_once
    from train_utils.validation import check_loop_settings, validate_config

    tokens = shlex.split(command)
    at = tokens.index("train.py")
    program, launcher_args = tokens[0], tokens[1:at]
    overrides = [t for t in tokens[at + 1:] if t != "-m" and not t.startswith("hydra.run.dir=")]
    plain = [o for o in overrides if "," not in o.split("=", 1)[-1]]
    hydra_cfg = compose_once(*[o.split(",")[0] for o in overrides], hydra_cfg=True).hydra
    world = _world_size(program, launcher_args, hydra_cfg.launcher)
    swept = {o.split("=", 1)[0]: _sweep_values(o.split("=", 1)[1]) for o in overrides if "," in o.split("=", 1)[-1]}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    for key, values in (hydra_cfg.sweeper.params or {}).items():
        if key not in given:  # the command line wins over the preset's sweep, as in Hydra
            swept[key] = _sweep_values(values)
    jobs = [dict(zip(swept, combo)) for combo in itertools.product(*swept.values())] or [{}]
    for job in jobs:  # a job recurs (a sweep's job, and the command that runs it alone): composed once a session
        cfg = compose_once(*[o for o in plain if not o.startswith("hydra")], *[f"{k}={v}" for k, v in job.items()])
        check_loop_settings(cfg.train)
        validate_config(cfg, world)


def test_ci_runs_the_readmes_setup_and_test_commands():
    """.ci/run: an explicit optional set-up step (Slurm for tests/test_slurm.py), then exactly the README's
    set-up command (its two `&&` parts as two timed phases: install, quickstart) and exactly its test
    command, the last one; `phase NAME` lines only start a phase's clock."""
    quick = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    setup, test = [c for b in blocks(quick)
                   for c in (commands(b["lines"]) and [" ".join(b["lines"]).strip()] or [])][:2]
    ci = [ln.split("#")[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    phases = [ln.split()[1] for ln in ci if ln.startswith("phase ")]
    ci = [ln for ln in ci if ln and not ln.startswith("phase ")]
    assert ci[-1] == test and " && ".join(ci[-3:-1]) == setup, ci
    assert any("slurm_localhost.sh install" in ln for ln in ci[:-3])
    assert phases == ["slurm", "set-up", "quickstart", "tests"]


# ------------------------------------------------------------------ the README as a map, the pages it links
README_MAX_LINES = 350
MAP_HEADING = "## Where to change what"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _headings(text: str) -> list[str]:
    """The markdown headings of a text, outside code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            out.append(line)
    return out


def _map_rows() -> list[list[str]]:
    section = README.read_text().split(f"\n{MAP_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    table = [ln for ln in section.splitlines() if ln.startswith("|") and not set(ln) <= set("|-: ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in table[1:]]


def test_readme_is_short_and_the_map_comes_right_after_the_quickstart():
    """The README is the door: what the project is, the quickstart, then where to change what; the rest
    is a summary per topic, its key commands and a link to the docs/ page that has the details."""
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, (f"README.md has {len(lines)} lines, the limit is {README_MAX_LINES}: "
                                           "move the details to a page of docs/ and link it")
    sections = [h for h in _headings(README.read_text()) if h.startswith("## ")]
    assert sections[0].startswith("## Quickstart") and sections[1] == MAP_HEADING, sections[:3]


def _exists(name: str) -> bool:
    """`path` (a file or directory of the repository) or `path::name` (a test, function or class in it)."""
    path, _, symbol = name.partition("::")
    if not (ROOT / path).exists():
        return False
    return not symbol or bool(re.search(rf"^\s*(?:def|class)\s+{re.escape(symbol)}\b|^{re.escape(symbol)}\s*=",
                                        (ROOT / path).read_text(), re.MULTILINE))


def test_where_to_change_what_names_files_and_tests_that_exist():
    """Each row: what to change, the files to edit (backquoted paths: `dir/`, `dir/file`, `file::name`) and
    the tests to copy (`tests/...py::test_name`); every one of them must exist."""
    rows = _map_rows()
    assert len(rows) >= 8, rows
    for row in rows:
        assert len(row) == 3, row
        what, edit, copy = row
        files = [p for p in re.findall(r"`([^`]+)`", edit) if "/" in p and " " not in p]  # paths, not commands
        tests = [p for p in re.findall(r"`([^`]+)`", copy) if "/" in p and " " not in p]
        assert files and tests, f"{what}: name the files to edit and the tests to copy"
        assert all(t.startswith("tests/") for t in tests), f"{what}: {tests}"
        missing = [name for name in files + tests if not _exists(name)]
        assert not missing, f"README, {MAP_HEADING}, row {what!r}: no such file or test: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_links_between_the_pages_resolve(page):
    """A relative link (README -> docs/, docs/ -> docs/ or back) names a file that exists, and an anchor
    a heading of that page: a section that moved leaves no dead link behind."""
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path) if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            slugs = {_slug(h) for h in _headings(dest.read_text())}
            assert anchor in slugs, f"{page.relative_to(ROOT)}: link to {target}: no such heading"
