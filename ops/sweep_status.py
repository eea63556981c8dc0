"""Where every job of a sweep stands, one line each: done, running, stopped, queued, stalled or failed.

    python -m ops.sweep_status multirun/table15                  # a line per job, then the counts
    python -m ops.sweep_status multirun/table15 --json           # the same as one JSON object
    python -m ops.sweep_status multirun/table15 --stale-after 90 # minutes without progress = stalled

DIR is a sweep dir (`hydra.sweep.dir`) of any launcher: Hydra's basic one, `hydra/launcher=local` or
`hydra/launcher=slurm`. Each line gives the job number, the values it sweeps, its state and:

    done     final step, validation loss and perplexity (the end row of its metrics.jsonl)
    running  step/total steps, the last training loss, an ETA at the recent training step rate
    stopped  stopped by a signal after a checkpoint: a requeued SLURM job resumes by itself; otherwise
             rerun the sweep's -m command with hydra.sweep.dir=DIR
    queued   in multirun.yaml's sweep (expanded as Hydra's basic sweeper does), no run dir yet
    stalled  no write to metrics.jsonl or train.log for --stale-after minutes, by a dead or a live (hung)
             process
    failed   its last error line (train.py's `error: ...`, else submitit's exception, else "ended
             without a record") and where the full output is

A run's process is alive while it holds `<run dir>/run.lock` (train_utils/run_lock.py), looked up in
/proc/locks on its own host without taking it; on another host only the age of its last write tells.

Exit codes: 0 every job is done; 1 some job is still running, stopped or queued (none failed or
stalled); 3 some job failed or stalled; 2 DIR does not exist or is not a sweep dir (one line).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from train_utils.results import final_evaluation
# The file names train.py writes (train_utils/metrics.py, train_utils/run_lock.py); not imported from
# there, because those modules import torch: seconds per call of a status meant to take well under one.
METRICS_FILE, LOG_FILE, LOCK_FILE = "metrics.jsonl", "train.log", "run.lock"
TAIL_BYTES = 1 << 16  # metrics.jsonl grows by a row per step: only its end is read (the end row, recent steps)
RECENT_ROWS = 20  # training rows the ETA's step rate is averaged over
STATES = ("done", "running", "stopped", "queued", "stalled", "failed")
EXIT_DONE, EXIT_UNFINISHED, EXIT_NOT_A_SWEEP, EXIT_FAILED = 0, 1, 2, 3
MAX_ERROR_CHARS = 300  # of a failed job's line (its --json entry and its log keep the whole message)


class NotASweep(Exception):
    """DIR cannot be read as a sweep dir; the message is the one line printed."""


@dataclass
class Job:
    num: int
    overrides: list[str] = field(default_factory=list)  # the job's override lines (key=value)
    run_dir: Path | None = None
    job_id: str | None = None  # Hydra's hydra.job.id: submitit's job id under its launchers


# ---- the sweep: which jobs it has, and which of them have a run dir ------------------------------------
def load_sweep(sweep: Path) -> tuple[dict, list[Job], list[str], str | None]:
    """(multirun.yaml's hydra node, the jobs in order, the swept keys, why the jobs that have not
    started could not be listed or None). Raises NotASweep."""
    if not sweep.exists():
        raise NotASweep(f"{sweep}: no such directory")
    if not sweep.is_dir():
        raise NotASweep(f"{sweep}: not a directory")
    master = sweep / "multirun.yaml"  # written by the sweeper before any job starts
    if not master.is_file():
        raise NotASweep(not_a_sweep_message(sweep))
    try:
        hydra_cfg = OmegaConf.to_container(OmegaConf.load(master).hydra, resolve=False)
    except Exception as err:  # not YAML, or no hydra node
        raise NotASweep(f"{master}: not a Hydra sweep's multirun.yaml ({type(err).__name__}: {err})") from None
    expanded, unknown = expected_overrides(hydra_cfg)
    jobs = {num: Job(num, overrides) for num, overrides in enumerate(expanded or [])}
    for num, (run_dir, job_id, overrides) in find_run_dirs(sweep).items():
        job = jobs.setdefault(num, Job(num, overrides))
        job.run_dir, job.job_id = run_dir, job_id
    ordered = [jobs[num] for num in sorted(jobs)]
    return hydra_cfg, ordered, swept_keys(ordered), unknown


def not_a_sweep_message(path: Path) -> str:
    if (path / ".hydra").is_dir():
        return (f"{path} is a single run's directory, not a sweep (no multirun.yaml): its progress is in "
                f"{path / METRICS_FILE} and {path / LOG_FILE}")
    below = sorted(path.glob("*/multirun.yaml")) + sorted(path.glob("*/*/multirun.yaml"))
    hint = ""
    if below:  # multirun/ or multirun/<date>/: name the newest sweep below it
        newest = max(below, key=lambda p: p.stat().st_mtime).parent
        hint = f"; it holds {len(below)} sweep dir{'s' if len(below) > 1 else ''}, the newest {newest}"
    return (f"{path} is not a sweep dir: no multirun.yaml (Hydra writes it in hydra.sweep.dir when a -m run "
            f"starts){hint}")


def expected_overrides(hydra_cfg: dict) -> tuple[list[list[str]] | None, str | None]:
    """Every job's override lines in job-number order, the product of `hydra.sweeper.params` and the command
    line's as the sweeper makes it; None (and why) where unknown in advance (another sweeper, a glob())."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.frugal_sweeper.sweeper import CommandLineWinsSweeper

    sweeper = hydra_cfg.get("sweeper") or {}
    target = str(sweeper.get("_target_", ""))
    if not target.endswith((".BasicSweeper", ".CommandLineWinsSweeper")):
        return None, f"the sweeper {sweeper.get('_target_')} chooses its jobs as it goes"
    params = sweeper.get("params") or {}
    task = (hydra_cfg.get("overrides") or {}).get("task") or []
    lines = [f"{k}={v}" for k, v in params.items()] + [str(o) for o in task]
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
        split = BasicSweeper if target.endswith(".BasicSweeper") else CommandLineWinsSweeper
        batches = split.split_arguments(overrides, None)  # the sweeper's own product: the same job numbers
    except Exception as err:
        return None, f"its sweep could not be expanded here ({type(err).__name__}: {err})"
    return [list(job) for batch in batches for job in batch], None


def find_run_dirs(sweep: Path) -> dict[int, tuple[Path, str | None, list[str]]]:
    """{job number: (run dir, hydra.job.id, override lines)}: every directory below the sweep dir holding
    Hydra's .hydra/hydra.yaml (whatever hydra.sweep.subdir is); the newest per job number."""
    found: dict[int, tuple[Path, str | None, list[str]]] = {}
    for root, dirs, _ in os.walk(sweep):
        if ".hydra" in dirs:
            dirs[:] = []  # a run dir holds no other run dir (and its checkpoints are not walked)
            run_dir, job = Path(root), read_job(Path(root))
            if job is not None and (job[0] not in found or run_dir.stat().st_mtime > found[job[0]][0].stat().st_mtime):
                found[job[0]] = (run_dir, job[1], job[2])
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # .submitit/
    return found


def read_job(run_dir: Path) -> tuple[int, str | None, list[str]] | None:
    """(hydra.job.num, hydra.job.id, override lines) from .hydra/hydra.yaml; None while Hydra writes it."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # plain YAML: ${...} stays text
    try:
        hydra_cfg = yaml.load((run_dir / ".hydra" / "hydra.yaml").read_text(), Loader=loader)["hydra"]
        num, job_id = int(hydra_cfg["job"]["num"]), hydra_cfg["job"].get("id")
        overrides = [str(o) for o in hydra_cfg["overrides"]["task"] or []]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None
    return num, None if job_id is None else str(job_id), overrides


def swept_keys(jobs: list[Job]) -> list[str]:
    """The keys whose value differs between the jobs (what the sweep varies), in command-line order."""
    values: dict[str, list[str]] = {}
    for job in jobs:
        for key, value in split_overrides(job.overrides).items():
            values.setdefault(key, []).append(value)
    return [key for key, seen in values.items() if len(set(seen)) > 1 or len(seen) < len(jobs)]


def split_overrides(lines: list[str]) -> dict[str, str]:
    """{key: value} of override lines; `+`/`++` (add, force-add) are not part of the key."""
    pairs = (line.split("=", 1) if "=" in line else (line, "") for line in lines)
    return {key.lstrip("+"): value for key, value in pairs}


# ---- one run dir: what it wrote, and whether its process is alive ---------------------------------------
def tail_lines(path: Path) -> list[str]:
    """The lines of a file's last TAIL_BYTES; a first line read from its middle is dropped."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().decode(errors="replace").split("\n")
    except OSError:
        return []
    return lines[1:] if size > TAIL_BYTES else lines


def tail_rows(path: Path) -> list[dict]:
    """The rows at the end of a metrics.jsonl; a line being appended (a live run) or cut short is skipped."""
    rows = []
    for line in tail_lines(path):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_record(run_dir: Path) -> tuple[str, str] | None:
    """("error" | "stopped", the line) of train.log's last `error: ...` or `stopped by <signal> ...`, if no
    later attempt started after it (a rerun's start block begins with `run dir ...`)."""
    lines = [line.split("] ", 1)[-1] for line in tail_lines(run_dir / LOG_FILE)]  # without the time stamp
    kinds = {"error: ": "error", "interrupted (": "error", "stopped by ": "stopped"}
    last = None
    for text in lines:
        if text.startswith("run dir "):
            last = None
        kind = next((k for prefix, k in kinds.items() if text.startswith(prefix)), None)
        if kind is not None:
            last = (kind, text)
    return last


def lock_state(run_dir: Path) -> tuple[str, dict]:
    """('held' | 'free' | 'unknown' (another host, or no name written yet) | 'none' (no lock yet), the
    holder's record {pid, host, started}) of the run's lock."""
    try:
        text = (run_dir / LOCK_FILE).read_text()
    except FileNotFoundError:
        return "none", {}
    except OSError:
        return "unknown", {}
    try:
        holder = json.loads(text)
        pid, host = int(holder["pid"]), str(holder["host"])
    except (ValueError, KeyError, TypeError):
        return "unknown", {}
    if host != socket.gethostname():
        return "unknown", holder
    if not pid_alive(pid):
        return "free", holder
    held = flock_held(run_dir / LOCK_FILE, pid)
    return ("held" if held in (True, None) else "free"), holder  # None: no /proc/locks, a live pid is all we know


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def flock_held(path: Path, pid: int) -> bool | None:
    """Whether process `pid` holds an flock on `path` (/proc/locks; None where it cannot be read). A live pid
    is not enough: the basic launcher runs every job in one process, and a pid may be reused."""
    try:
        inode = path.stat().st_ino
        with open("/proc/locks") as f:
            table = f.read().splitlines()
    except OSError:
        return None
    for line in table:  # "1: FLOCK  ADVISORY  WRITE 12578 fe:00:2213179 0 EOF"; waiters have "->"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields:
            if fields[4] == str(pid) and fields[5].rsplit(":", 1)[-1] == str(inode):
                return True
    return False


def last_write(run_dir: Path) -> float:
    """When the run last wrote anything this tool reads (its start: the run dir and .hydra/)."""
    paths = [run_dir, run_dir / ".hydra", run_dir / METRICS_FILE, run_dir / LOG_FILE, run_dir / LOCK_FILE]
    return max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)


def submitit_paths(hydra_cfg: dict, sweep: Path, job_id: str | None) -> tuple[Path, Path] | None:
    """(result pickle, log of stderr) of the job's first task (rank 0) in submitit's folder, if it has one."""
    if job_id is None:
        return None
    folder = str((hydra_cfg.get("launcher") or {}).get("submitit_folder") or "${hydra.sweep.dir}/.submitit/%j")
    folder = Path(folder.replace("${hydra.sweep.dir}", str(sweep)).replace("%j", job_id))
    if not folder.is_dir():
        return None
    return folder / f"{job_id}_0_result.pkl", folder / f"{job_id}_0_log.err"


def submitit_error(result: Path) -> str | None:
    """Why a submitit job failed, from the result its first task wrote (where a traceback Hydra's job
    runner caught is kept); None without a result or for a success."""
    if not result.is_file():
        return None
    try:
        with open(result, "rb") as f:  # the sweep's own file, as submitit and the launcher read it
            outcome, value = pickle.load(f)
    except Exception as err:
        return f"its result could not be read ({type(err).__name__}: {err})"
    if outcome != "success":  # died outside Hydra's job runner: submitit keeps the traceback's text
        lines = str(value).strip().splitlines()
        return lines[-1] if lines else "failed"
    status = getattr(getattr(value, "status", None), "name", None)
    if status != "FAILED":
        return None
    err = getattr(value, "_return_value", None)  # the job's exception (return_value would raise it)
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if text.startswith("error:") else f"{type(err).__name__}: {text}".rstrip(": ")


def total_steps(run_dir: Path) -> int | None:
    try:
        return int(OmegaConf.select(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), "train.steps"))
    except Exception:  # unreadable, or an interpolation this tool cannot resolve
        return None


# ---- one job's state --------------------------------------------------------------------------------
def job_status(job: Job, hydra_cfg: dict, sweep: Path, now: float, stale_after_s: float) -> dict:
    """The job's state and what its line says about it (see the module docstring)."""
    out = {"num": job.num, "overrides": split_overrides(job.overrides), "state": "queued",
           "run_dir": str(job.run_dir) if job.run_dir else None}
    if job.run_dir is None:
        return out
    run_dir = job.run_dir
    rows = tail_rows(run_dir / METRICS_FILE)
    end = next((r for r in reversed(rows) if r.get("event") == "end"), None)
    if end is not None:
        final = final_evaluation(rows) or end  # the final evaluation, as make_tables reads it
        return {**out, "state": "done", "step": final.get("step"), "val_loss": final.get("val_loss"),
                "val_ppl": final.get("val_ppl")}
    lock, holder = lock_state(run_dir)
    submitit = submitit_paths(hydra_cfg, sweep, job.job_id)
    out.update(progress_of(rows, total_steps(run_dir)), idle_s=max(0.0, now - last_write(run_dir)), lock=lock,
               pid=holder.get("pid"), host=holder.get("host"),
               log=str(submitit[1]) if submitit and submitit[1].is_file() else str(run_dir / LOG_FILE))
    stale = "running" if out["idle_s"] <= stale_after_s else "stalled"
    if lock == "held":  # alive on this host: running, unless it has hung
        return {**out, "state": stale}
    kind, text = last_record(run_dir) or (None, None)
    error = submitit_error(submitit[0]) if kind is None and submitit is not None else None
    kind, text = ("error", error) if error is not None else (kind, text)
    if kind == "error":
        return {**out, "state": "failed", "error": text}
    if kind == "stopped" or (rows and rows[-1].get("event") == "preempted"):
        stop = text.split(";")[0] if kind == "stopped" else f"stopped by {rows[-1].get('signal')}"
        return {**out, "state": "stopped", "stop": stop}
    if lock == "free":  # its process is gone, and left no end row, no error and no stop
        gone = "is gone" if not pid_alive(int(holder["pid"])) else "no longer holds the run"
        return {**out, "state": "failed", "error": f"ended without a record (its process {holder['pid']} {gone})"}
    return {**out, "state": stale}  # another host's process, or no lock taken yet: only the progress tells


def progress_of(rows: list[dict], steps: int | None) -> dict:
    """Step, total steps, last training loss and, from the recent training rows' step times, the ETA."""
    train = [r for r in rows if "event" not in r and r.get("loss") is not None and "step" in r]
    out: dict = {"steps": steps, "step": train[-1]["step"] if train else None,
                 "loss": train[-1]["loss"] if train else None}
    times = [r["step_time_s"] for r in train[-RECENT_ROWS:] if isinstance(r.get("step_time_s"), (int, float))]
    if times and steps is not None and out["step"] is not None:
        out["s_per_step"] = sum(times) / len(times)
        out["eta_s"] = max(0, steps - out["step"]) * out["s_per_step"]
    return out


# ---- the report ------------------------------------------------------------------------------------------
def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def number(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


def at_step(status: dict) -> str:
    if status.get("step") is None:
        return "no step yet"
    return f"step {status['step']}" + (f"/{status['steps']}" if status.get("steps") is not None else "")


def detail(status: dict) -> str:
    """What a job's line says after its state."""
    state = status["state"]
    if state == "done":
        return (f"step {status['step']}, validation loss {number(status['val_loss'], '.4f')}, "
                f"perplexity {number(status['val_ppl'], '.3f')}")
    if state == "queued":
        return "no run output yet"
    where = at_step(status)
    if state == "running":
        if status.get("step") is None:
            return "starting: no step yet"
        eta = f", ETA {duration(status['eta_s'])} ({status['s_per_step']:.2f} s/step)" if "eta_s" in status else ""
        return f"{where}, loss {number(status['loss'], '.4f')}{eta}"
    if state == "stopped":
        of = f" (of {status['steps']})" if status.get("steps") is not None else ""
        return f"{status['stop']}{of}; continues when its job is requeued or the sweep reruns"
    if state == "stalled":
        whose = {"held": f"its process {status['pid']} is alive",
                 "unknown": f"its process on {status['host']} cannot be seen from here" if status["host"] else
                 "its process has not named itself in its lock",
                 "none": "it has not taken its run lock"}[status["lock"]]
        return f"{where}, no progress for {duration(status['idle_s'])} ({whose}); log: {status['log']}"
    error = status["error"]
    if len(error) > MAX_ERROR_CHARS:
        error = error[:MAX_ERROR_CHARS - 3] + "..."
    return (f"{where}: " if status.get("step") is not None else "") + f"{error}; full log: {status['log']}"


def report_lines(statuses: list[dict], keys: list[str]) -> list[str]:
    """A line per job: number, swept values, state, details; the columns aligned."""
    labels = [" ".join(f"{k}={s['overrides'][k]}" for k in keys if k in s["overrides"]) or "-" for s in statuses]
    nums = [f"#{s['num']}" for s in statuses]
    wn, wl = max(map(len, nums), default=0), max(map(len, labels), default=0)
    ws = max(len(state) for state in STATES)
    return [f"{n:<{wn}}  {label:<{wl}}  {s['state']:<{ws}}  {detail(s)}" for n, label, s in zip(nums, labels, statuses)]


def exit_code(counts: dict[str, int]) -> int:
    if counts["failed"] or counts["stalled"]:
        return EXIT_FAILED
    if counts["running"] or counts["stopped"] or counts["queued"] or not counts["done"]:
        return EXIT_UNFINISHED  # no job at all: another sweeper's sweep that has started none yet
    return EXIT_DONE


def orphan_note(hydra_cfg: dict, sweep: Path, jobs: list[Job], counts: dict[str, int]) -> str | None:
    """Hydra's basic launcher runs the jobs one after another in the sweep's own process (every job's
    lock names it): once that process is gone, its queued jobs never start. None otherwise."""
    launcher = str((hydra_cfg.get("launcher") or {}).get("_target_", ""))
    started = [job.run_dir for job in jobs if job.run_dir is not None]
    if not launcher.endswith(".BasicLauncher") or not counts["queued"] or counts["running"] or not started:
        return None
    _, holder = lock_state(max(started, key=last_write))
    if holder.get("host") != socket.gethostname() or pid_alive(int(holder["pid"])):
        return None
    return (f"note: the sweep's process (pid {holder['pid']}) is gone, so its queued jobs will not start: rerun "
            f"the same -m command with hydra.sweep.dir={sweep.resolve()} (finished jobs end at once)")


def summary_line(sweep: Path, counts: dict[str, int], total: int, unknown: str | None) -> str:
    parts = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    note = f" (jobs not started yet are not listed: {unknown})" if unknown else ""
    return f"{sweep}: {total} job{'s' if total != 1 else ''}: {parts or 'none started'}{note}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", metavar="DIR", help="the sweep dir (hydra.sweep.dir: holds multirun.yaml)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (jobs, counts, exit code)")
    ap.add_argument("--stale-after", type=float, default=30.0, metavar="MINUTES",
                    help="minutes without a write to metrics.jsonl or train.log after which a run is stalled "
                         "(default 30; raise it for runs whose evaluations or checkpoints take longer)")
    args = ap.parse_args(argv)
    sweep = Path(args.sweep)
    try:
        hydra_cfg, jobs, keys, unknown = load_sweep(sweep)
    except NotASweep as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NOT_A_SWEEP
    now = time.time()
    statuses = [job_status(job, hydra_cfg, sweep, now, args.stale_after * 60) for job in jobs]
    counts = {state: sum(s["state"] == state for s in statuses) for state in STATES}
    code, note = exit_code(counts), orphan_note(hydra_cfg, sweep, jobs, counts)
    if args.json:
        for status in statuses:  # the swept values apart from the job's other overrides
            status["values"] = {k: v for k, v in status["overrides"].items() if k in keys}
        print(json.dumps({"sweep": str(sweep), "swept": keys, "jobs": statuses, "counts": counts,
                          "unlisted": unknown, "note": note, "exit_code": code}, indent=1))
    else:
        summary = summary_line(sweep, counts, len(statuses), unknown)
        print("\n".join([*report_lines(statuses, keys), summary, *([note] if note else [])]))
    return code


if __name__ == "__main__":
    sys.exit(main())
