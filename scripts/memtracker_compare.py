"""torch's own memory tracker beside the memory planner: could MemTracker be the planner's engine?

    python scripts/memtracker_compare.py                  # every case: a markdown table (minutes)
    python scripts/memtracker_compare.py --cases 0/4      # every 4th case from the first
    python scripts/memtracker_compare.py --cases 0/4 --json
    python scripts/memtracker_compare.py --time-7b        # LLaMA-7B under FakeTensorMode: seconds, peak

For each case of the planner's validation (`VALIDATION_CASES` of scripts/memory_plan.py) and a few cases
of the step inside backward (frugal.step_in_backward), three figures of the peak allocated memory:

- measured: the profiler's allocation events of real CPU steps (`measure_case`, the planner's
  validation harness; for the step inside backward the same events around the same loop);
- planned: `train_utils.memory_plan.plan_memory` (`plan_case`);
- tracker: `torch.distributed._tools.mem_tracker.MemTracker` (`FSDPMemTracker` for FSDP2) run under
  `torch._subclasses.fake_tensor.FakeTensorMode`: the model and optimizer are built with fake tensors
  (no memory, no arithmetic), the same steps run, and the tracker's peak snapshot is read.

Each case runs in a fresh interpreter (a case that crashes the interpreter, e.g. a segmentation fault,
is reported as such and the others go on). docs/memory_plan.md, section "MemTracker under
FakeTensorMode", has the results and the decision.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from scripts.memory_plan import VALIDATION_CASES, Case, measure_case, plan_case, two_steps, every_nth  # noqa: E402

MIB = 2.0**20


@dataclass(frozen=True)
class Run:
    """A case to compare. in_backward: FRUGAL's step inside backward (frugal.step_in_backward, one
    micro-batch per step: the mode's point), with clipping at max_norm when it is set."""
    case: Case
    in_backward: bool = False
    max_norm: float | None = None


_RHO0 = {"name": "frugal", "density": 0.0}
_RHO25 = {"name": "frugal", "density": 0.25, "update_gap": 1}
RUNS = [Run(c) for c in VALIDATION_CASES] + [
    Run(Case("llama_20m", 1000, _RHO0, 8, 128), in_backward=True),
    Run(Case("llama_20m", 1000, _RHO0, 8, 128), in_backward=True, max_norm=1.0),
    Run(Case("llama_20m", 1000, _RHO25, 8, 128), in_backward=True, max_norm=1.0),
]


def plan_run(run: Run, phase: str | None = None) -> int:
    """The planner's peak (or one phase of it), in bytes."""
    if not run.in_backward:
        return plan_case(run.case, phase)
    from train_utils.memory_plan import plan_memory

    case = run.case
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{case.model}.yaml"))
    plan = plan_memory(model, case.optimizer, micro_batch_size=case.micro, seq_len=case.seq,
                       activation_checkpointing=case.checkpointing, precision=case.precision,
                       vocab_size=case.vocab, device_type="cpu", optimizer_in_backward=True,
                       grad_clip=run.max_norm is not None, accumulation=1)
    return plan.phases[phase] if phase else plan.total


def _optimizer_hp(case: Case, fake: bool) -> tuple[str, dict]:
    hp = dict(case.optimizer)
    name = hp.pop("name")
    import frugal

    if fake and name in frugal.registry.frugal_based():
        # The compiled sign update aliases each tensor through DLPack (frugal.kernels._plain): on a fake
        # tensor that reads a storage that does not exist, and the interpreter dies (SIGSEGV) inside
        # FakeTensorMode's check of the compiled function's inputs. The eager update is the one that
        # runs under a fake mode; it adds one sign(g) temporary at a time (the largest state-free tensor).
        hp.setdefault("sign_update", "eager")
    return name, hp


def _steps(run: Run, model, wrapped, optimizer, loss_fn, before_forward=lambda: None, accumulation: int = 2):
    """Two optimizer steps as measure_case runs them (two accumulated micro-batches each; one micro-batch
    per step with the step inside backward), the step marked with record_function("optimizer_step")."""
    import frugal

    case = run.case
    vocab = case.vocab or OmegaConf.load(ROOT / "configs" / "model" / f"{case.model}.yaml").vocab_size
    stepper = frugal.step_in_backward(optimizer, max_norm=run.max_norm, model=model) if run.in_backward else None
    if stepper is not None:
        accumulation = 1
    two_steps(case, wrapped, optimizer, loss_fn, vocab, accumulation, before_forward)
    if stepper is not None:
        stepper.remove()


def _build(case: Case, fake: bool, mesh=None):
    """(model, wrapped, optimizer, loss_fn) as measure_case builds them. Under a fake mode, pure bf16 is
    made in bf16 (below) and FSDP2 takes a device mesh made before the fake mode (its default mesh calls
    `.tolist()` on a tensor made under it: DataDependentOutputException)."""
    import torch

    import frugal
    import models
    from frugal.grouping import transformer_blocks
    from train_utils.loop import compile_model, token_loss_sum

    cfg = OmegaConf.load(ROOT / "configs" / "model" / f"{case.model}.yaml")
    if fake and case.precision == "bf16":
        # Module.to(dtype) swaps every fake parameter (torch.utils.swap_tensors), which fails under a fake
        # mode ("_apply(): Couldn't swap Embedding.weight": "Cannot swap t1 because it has weakref
        # associated with it"), even for a lone nn.Embedding: the weights are made in bf16 instead
        # (the rotary buffer too: 256 bytes)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = models.build_model(cfg, vocab_size=case.vocab or cfg.vocab_size)
        finally:
            torch.set_default_dtype(previous)
    else:
        model = models.build_model(cfg, vocab_size=case.vocab or cfg.vocab_size)
        if case.precision == "bf16":
            model.to(torch.bfloat16)
    if case.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    wrapped = model
    loss_fn = compile_model(model) if case.compiled else token_loss_sum
    if case.wrapper.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=case.wrapper != "ddp-no-view",
                                          init_sync=False)
    elif case.wrapper == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in transformer_blocks(model):
            fully_shard(block, mp_policy=policy, mesh=mesh)
        fully_shard(model, mp_policy=policy, mesh=mesh)
    name, hp = _optimizer_hp(case, fake)
    return model, wrapped, frugal.build_optimizer(model, name, **hp), loss_fn


def measure_in_backward(run: Run) -> tuple[int, int]:
    """(peak, peak inside optimizer.step) of real CPU steps with the step inside backward, from the
    profiler's allocation events as measure_case reads them."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, wrapped, optimizer, loss_fn = _build(run.case, fake=False)
        _steps(run, model, wrapped, optimizer, loss_fn)
        del model, wrapped, optimizer
    events = []

    def walk(node, in_step: bool) -> None:
        in_step = in_step or node.name == "optimizer_step"
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated,
                           in_step))
        for child in node.children:
            walk(child, in_step)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    events.sort(key=lambda e: e[0])
    start = events[0][2] - events[0][1]
    return max(e[2] for e in events) - start, max(e[2] for e in events if e[3]) - start


def _tracker_class(fsdp: bool):
    """MemTracker (FSDPMemTracker) that also keeps the peak inside optimizer.step(): the tracker
    itself keeps one peak snapshot for the whole context (and per module)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class StepPeakTracker(base):
        step_peak = 0

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if self._in_opt:
                total = sum(snap["Total"] for snap in self._curr_mem_snap.values())
                self.step_peak = max(self.step_peak, total)

    return StepPeakTracker


def track(run: Run, fake: bool = True) -> dict:
    """The tracker's peak and peak inside the step (bytes) over the same steps, and the seconds taken
    (building the model included), with the model built under FakeTensorMode (fake=False: real tensors)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    gc.collect()
    start = time.perf_counter()
    fsdp = run.case.wrapper == "fsdp"
    mesh = None
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if fake and run.case.optimizer.get("state_precision") == "8bit":
        # bitsandbytes' dynamic maps are made on first use by data-dependent Python (`.item()` on a fake
        # tensor: DataDependentOutputException); made here, before the fake mode, as real tensors
        from frugal import state_precision

        for signed in (True, False):
            state_precision._code(signed, torch.device("cpu"))
    # allow_non_fake_inputs: bitsandbytes' dynamic maps (frugal.state_precision's 8-bit codes) are real
    # tensors made once at import; without it the 8-bit cases stop at their first dequantize.
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        model, wrapped, optimizer, loss_fn = _build(run.case, fake, mesh)
        tracker = _tracker_class(fsdp)(model, optimizer) if fsdp else _tracker_class(False)()
        tracker.track_external(model, optimizer)  # a no-op for FSDPMemTracker (it reads the FSDP state)
        with tracker:
            # MemTracker refuses a second forward of the root module unless its module statistics are reset
            _steps(run, model, wrapped, optimizer, loss_fn, before_forward=tracker.reset_mod_stats)
    peak = tracker.get_tracker_snapshot("peak")
    return {"tracker": sum(snap["Total"] for snap in peak.values()), "tracker_step": tracker.step_peak,
            "tracker_seconds": time.perf_counter() - start,
            "tracker_parts": {str(getattr(k, "value", k)): v for snap in peak.values() for k, v in snap.items() if v}}


def _where(err: BaseException) -> str:
    """The innermost frame of this project's code (not this script) and the innermost frame of all."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and not f.filename.endswith("memtracker_compare.py")]

    def show(f) -> str:
        path = Path(f.filename)
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(*path.parts[-3:])
        return f"{name}:{f.lineno} {f.name}: {f.line}"

    return " <- ".join(show(f) for f in ([frames[-1]] + ours[-1:] if ours else frames[-1:]))


def one(index: int, fake: bool = True, measure: bool = True) -> dict:
    """Every figure of RUNS[index], in this interpreter (inside a one-process gloo group)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    run = RUNS[index]
    out = {"index": index, "planned": plan_run(run), "planned_step": plan_run(run, "optimizer step")}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            if measure:
                start = time.perf_counter()
                out["measured"], out["measured_step"] = (measure_in_backward(run) if run.in_backward
                                                         else measure_case(run.case))
                out["measured_seconds"] = time.perf_counter() - start
            try:
                out.update(track(run, fake))
            except Exception as err:  # recorded, not raised: what fails is a result of the comparison
                out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
                out["where"] = _where(err)
        finally:
            dist.destroy_process_group()
    return out


def run_cases(indices: list[int], fake: bool = True, measure: bool = True, timeout: int = 600) -> list[dict]:
    """Each case in a fresh interpreter: a crash (signal) is a result, not the end of the comparison."""
    results = []
    for i in indices:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(i)] + \
              ([] if fake else ["--real"]) + ([] if measure else ["--no-measure"])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            results.append(json.loads(lines[-1]))
        else:
            why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
            results.append({"index": i, "planned": plan_run(RUNS[i]),
                            "planned_step": plan_run(RUNS[i], "optimizer step"),
                            "error": f"the interpreter died ({why}): {tail}"})
    return results


def describe(run: Run) -> str:
    case = run.case
    opt = ", ".join(f"{k}={v}" for k, v in case.optimizer.items() if k != "name")
    mode = [case.wrapper if case.wrapper != "none" else "", "AC" if case.checkpointing else "",
            case.precision if case.precision != "bf16-mixed" else "", "compiled" if case.compiled else "",
            ("in-backward" + (f" clip {run.max_norm}" if run.max_norm else "")) if run.in_backward else ""]
    return (f"{case.model} ({case.vocab or 32000}) {case.optimizer['name']} {opt} {case.micro}x{case.seq} "
            + " ".join(m for m in mode if m)).replace("  ", " ").strip()


def table(results: list[dict]) -> str:
    lines = ["| # | case | measured MiB | planned MiB | tracker MiB | planned / measured | tracker / measured "
             "| step: measured | step: planned | step: tracker | tracker s |", "|---" * 11 + "|"]

    def mib(r, key):
        return f"{r[key] / MIB:.1f}" if r.get(key) is not None else "-"

    def ratio(r, key):
        return f"{r[key] / r['measured']:.3f}" if r.get(key) is not None and r.get("measured") else "-"

    for r in results:
        tracker = mib(r, "tracker") if "error" not in r else "fails (below)"
        seconds = f"{r['tracker_seconds']:.1f}" if "tracker_seconds" in r else "-"
        lines.append(f"| {r['index']} | {describe(RUNS[r['index']])} | {mib(r, 'measured')} | {mib(r, 'planned')} | "
                     f"{tracker} | {ratio(r, 'planned')} | {ratio(r, 'tracker')} | {mib(r, 'measured_step')} | "
                     f"{mib(r, 'planned_step')} | {mib(r, 'tracker_step')} | {seconds} |")
    failures = [f"- case {r['index']}: {r['error']}" for r in results if "error" in r]
    return "\n".join(lines + ([""] + failures if failures else []))


def time_7b(micro: int, seq: int, entry: str) -> dict:
    """LLaMA-7B under FakeTensorMode: one step of one micro-batch with MemTracker, and the planner, timed."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import frugal
    import models
    from train_utils.loop import token_loss_sum
    from train_utils.memory_plan import plan_memory

    torch.set_num_threads(1)
    cfg = OmegaConf.load(ROOT / "configs" / "model" / "llama_7b.yaml")
    from scripts.memory_plan import compose

    hp = OmegaConf.to_container(compose([f"optimizer={entry}"]).optimizer, resolve=True)
    name = hp.pop("name")
    if name in frugal.registry.frugal_based():
        hp["sign_update"] = "eager"
    start = time.perf_counter()
    plan = plan_memory(cfg, {"name": name, **hp}, micro_batch_size=micro, seq_len=seq, device_type="cpu")
    planner_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with FakeTensorMode():
        model = models.build_model(cfg)
        optimizer = frugal.build_optimizer(model, name, **hp)
        built = time.perf_counter() - start
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            ids = torch.randint(1, cfg.vocab_size, (micro, seq))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids, use_cache=False).logits
            (token_loss_sum(logits, ids) / ids.numel()).backward()
            del logits
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return {"model": "llama_7b", "optimizer": entry, "micro": micro, "seq": seq, "planner_seconds": planner_seconds,
            "planned_gib": plan.total / 2**30, "tracker_build_seconds": built,
            "tracker_seconds": time.perf_counter() - start, "tracker_gib": peak / 2**30}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, metavar="K/N", help="only every N-th case from the K-th (0-based)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--real", action="store_true", help="run the tracker on real tensors (no FakeTensorMode)")
    ap.add_argument("--no-measure", action="store_true", help="skip the real measurement (tracker and plan only)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # one case, in this interpreter
    ap.add_argument("--time-7b", action="store_true", help="time LLaMA-7B under FakeTensorMode (one step)")
    ap.add_argument("--micro-batch", type=int, default=1, help="with --time-7b")
    ap.add_argument("--seq-len", type=int, default=256, help="with --time-7b")
    ap.add_argument("--optimizer", default="frugal_rho0", help="with --time-7b: a configs/optimizer entry")
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, fake=not args.real, measure=not args.no_measure)))
        return 0
    if args.time_7b:
        print(json.dumps(time_7b(args.micro_batch, args.seq_len, args.optimizer)))
        return 0
    indices = every_nth(list(range(len(RUNS))), args.cases, ap)
    results = run_cases(indices, fake=not args.real, measure=not args.no_measure)
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
