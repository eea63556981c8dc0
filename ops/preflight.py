"""Preflight: does this node run this code right? The first command on a new cluster or node.

    python -m ops.preflight                                   # every check this machine can run
    python -m ops.preflight --preset table2 --model llama_350m
    python -m ops.preflight --fast                            # tiny eager runs only (CPU CI)

A few minutes on one node: the real paths for a few steps (train.py on llama_tiny and on a preset's
model under DDP and FSDP2, compiled and eager; activation checkpointing; the compiled sign update; a
bitwise checkpoint resume; NCCL all-reduce bandwidth; LLaMA-7B held to 24 GiB of one GPU), what each
check measures: docs/launching.md, "The preflight". It prints one table (check | result |
pass/FAIL/skip) and exits 1 if any check failed, so it can gate a sweep (`python -m ops.preflight &&
sbatch ...`). Without a GPU it runs what the CPU can (gloo, 2 processes) and says why it skips the rest.
The training runs use the synthetic corpus: no data or tokenizer needed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 2 ** 30
# A tiny job: synthetic rows of 64 tokens, no evaluation to speak of, nothing written but metrics.
TINY = ["model=llama_tiny", "data=synthetic", "data.seq_len=64", "train.eval_tokens=512", "train.eval_every=0",
        "train.progress_bar=false", "train.plot=false", "wandb.mode=disabled", "checkpoint.every=0"]


class Table:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, check: str, result: str, status: str) -> None:
        self.rows.append((check, result, status))
        print(f"  {status:4s}  {check}: {result}", file=sys.stderr, flush=True)

    def print(self) -> None:
        width = max(len(c) for c, _, _ in self.rows)
        print(f"{'check':{width}s} | {'status':6s} | result")
        print(f"{'-' * width}-+--------+-{'-' * 40}")
        for check, result, status in self.rows:
            print(f"{check:{width}s} | {status:6s} | {result}")
        counts = {s: sum(r[2] == s for r in self.rows) for s in ("pass", "FAIL", "skip")}
        print(f"\n{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped")

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for _, _, status in self.rows)


def guarded(table: Table, check: str):
    """Run a check; an exception is that check's failure, not the end of the preflight."""
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 (the table reports it)
                table.add(check, f"{type(err).__name__}: "
                                 f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}",
                          "FAIL")
        return run
    return wrap


# ---- the node
def check_environment(table: Table, gpus: int) -> None:
    table.add("torch", f"{torch.__version__} (python {platform.python_version()})", "pass")
    if not gpus:
        table.add("device", f"CPU ({os.cpu_count()} cores): no CUDA device visible", "pass")
        for check in ("driver / CUDA / NCCL", "bf16 (GPU)", "TF32"):
            table.add(check, "no GPU on this machine", "skip")
        return
    from train_utils.measure import device_peak

    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    peak = device_peak(names[0])
    free, total = torch.cuda.mem_get_info(0)
    table.add("device", f"{gpus} x {names[0]}, {total / GIB:.0f} GiB"
              + (f", peak {peak[1] / 1e12:.0f} TFLOP/s bf16 ({peak[0]})" if peak else
                 ", not in the MFU table: pass train.peak_flops")
              + ("" if len(set(names)) == 1 else f"; MIXED: {names}"),
              "pass" if len(set(names)) == 1 else "FAIL")
    driver = "?"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    table.add("driver / CUDA / NCCL", f"driver {driver}, CUDA {torch.version.cuda}, NCCL {nccl}", "pass")
    bf16 = torch.cuda.is_bf16_supported()
    table.add("bf16 (GPU)", "supported" if bf16 else "NOT supported: the presets compute in bf16",
              "pass" if bf16 else "FAIL")
    major, minor = torch.cuda.get_device_capability(0)
    table.add("TF32", f"available (compute capability {major}.{minor})" if major >= 8 else
              f"not available (compute capability {major}.{minor} < 8.0): fp32 matmuls stay fp32", "pass")


def check_bf16_cpu(table: Table) -> None:
    a = torch.randn(64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = a @ a
    ok = out.dtype == torch.bfloat16 and torch.allclose(out.float(), a @ a, rtol=0.05, atol=0.5)
    table.add("bf16 autocast (CPU)", "matmul in bf16, close to fp32" if ok else f"got {out.dtype}",
              "pass" if ok else "FAIL")


# ---- train.py runs
EXIT_GRACE_S = 60  # a run that wrote its end row but has not exited this much later is stopped


def run_train(run_dir: str, overrides: list[str], nproc: int, timeout: float) -> tuple[int, list[dict], str]:
    """train.py (under torchrun for several processes): (exit code, metrics rows, stderr). A run that logged
    its end but hangs tearing down its process group (gloo, loaded CPU) is stopped, its stderr says so."""
    import signal

    launcher = [sys.executable, "train.py"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
               WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    path = os.path.join(run_dir, "metrics.jsonl")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "preflight.stderr"), "w+") as err:
        proc = subprocess.Popen([*launcher, *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        started, ended, note = time.monotonic(), None, ""
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.25)
            if ended is None and os.path.exists(path) and '"event": "end"' in open(path).read():
                ended = time.monotonic()
            late = ended is not None and time.monotonic() - ended > EXIT_GRACE_S
            if late or time.monotonic() - started > timeout:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
                proc.wait()
                note = (f"\nhung at exit: the end row was written, the processes had not exited {EXIT_GRACE_S} s later"
                        if late else f"\nerror: no exit after {timeout:.0f} s")
                break
        err.seek(0)
        stderr = err.read() + note
    rows = [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []
    code = proc.returncode if not note or "hung at exit" not in note else 0
    return code, rows, stderr


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no output"])[-1][:200]


def run_dir_of(work: str, label: str) -> str:
    return os.path.join(work, label.replace(" ", "_").replace(",", ""))


def check_training(table: Table, label: str, overrides: list[str], nproc: int, work: str, timeout: float,
                   gpu: bool) -> list[dict] | None:
    run_dir = run_dir_of(work, label)
    started = time.perf_counter()
    code, rows, stderr = run_train(run_dir, overrides, nproc, timeout)
    steps = [r for r in rows if "loss" in r and "step" in r]
    start = rows[0] if rows else {}
    if code != 0 or not steps or not all(math.isfinite(r["loss"]) for r in steps):
        table.add(f"train {label}", f"exit {code}: {_error_line(stderr)}", "FAIL")
        return None
    last = steps[-1]
    mfu = f", MFU {last['mfu']:.0%}" if last.get("mfu") is not None else ""
    hung = "; HUNG AT EXIT (stopped)" if "hung at exit" in stderr else ""
    table.add(f"train {label}", f"{len(steps)} steps, loss {steps[0]['loss']:.3f} -> {last['loss']:.3f}, "
              f"{last['step_time_s'] * 1e3:.0f} ms/step{mfu} "
              f"({time.perf_counter() - started:.0f} s with start-up){hung}",
              "pass")
    if "train.activation_checkpointing=true" in overrides and not start.get("activation_checkpointing"):
        table.add(f"  checkpointing {label}", "requested, but the start row says the blocks run without it", "FAIL")
    planned, measured = start.get("memory_planned_bytes"), max(r.get("peak_memory_bytes", 0) for r in steps)
    if not gpu:
        table.add(f"  memory {label}", f"peak RSS {measured / GIB:.2f} GiB (the plan is for device memory; "
                  f"not comparable on CPU)", "skip")
    elif planned:
        ok = measured <= planned
        table.add(f"  memory {label}", f"measured peak {measured / GIB:.2f} GiB, planned {planned / GIB:.2f} GiB"
                  + ("" if ok else ": the planner UNDERESTIMATES this run"), "pass" if ok else "FAIL")
    else:
        table.add(f"  memory {label}", f"measured peak {measured / GIB:.2f} GiB; no plan ({start.get('memory_check')})",
                  "skip")
    return rows


def check_resume(table: Table, nproc: int, work: str, timeout: float,
                 straight: tuple[str, list[dict], list[str]] | None, parallelism: str) -> None:
    """A run resumed from the step-2 checkpoint of the eager llama_tiny run (`straight`: its run dir, rows and
    overrides; under FSDP2 the sharded format) must log the later steps bitwise equal."""
    check = f"checkpoint + resume ({parallelism})"
    if straight is None:
        table.add(check, "the uninterrupted run (train llama_tiny ... eager) failed", "FAIL")
        return
    run_dir, rows, overrides = straight
    first = os.path.join(run_dir, "checkpoints", "step_00000002")
    code, resumed_rows, stderr = run_train(os.path.join(work, f"resume_resumed_{parallelism}"),
                                           [*overrides, f"train.resume={first}"], nproc, timeout)
    if code != 0:
        table.add(check, f"resuming {first} failed: {_error_line(stderr)}", "FAIL")
        return
    want = {r["step"]: r["loss"] for r in rows if "loss" in r and r["step"] > 2}
    got = {r["step"]: r["loss"] for r in resumed_rows if "loss" in r}
    ok = want and got == want
    later = f"steps 3-{max(want)}" if want else "the later steps"
    table.add(check, f"{later} resumed from step 2 {'equal' if ok else 'DIFFER from'} the "
              f"uninterrupted run bitwise ({got} vs {want})" if not ok else
              f"written at step 2, resumed: {later} bitwise equal to the uninterrupted run", "pass" if ok else "FAIL")


# ---- in-process checks
def _one_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def _model(name: str, device: torch.device, vocab: int):
    from omegaconf import OmegaConf

    import models

    torch.manual_seed(0)
    return models.build_model(OmegaConf.load(os.path.join(REPO, "configs", "model", f"{name}.yaml")),
                              vocab_size=vocab).to(device)


def check_activation_checkpointing(table: Table, device: torch.device, model_name: str, compiled: bool,
                                   parallelism: str, seq: int, batch: int) -> None:
    from frugal.grouping import transformer_blocks
    from train_utils.loop import (activation_checkpointing_on, compile_model, enable_activation_checkpointing,
                                  saved_tensor_bytes, token_loss_sum)

    label = f"checkpointing {model_name}, {'compiled' if compiled else 'eager'}, {parallelism}"
    vocab = 512 if model_name == "llama_tiny" else None
    ids = torch.randint(0, 512, (batch, seq), device=device)
    saved, on = {}, None
    for checkpointing in (False, True):
        model = _model(model_name, device, vocab)
        if checkpointing:
            enable_activation_checkpointing(model)
        if compiled:
            compile_model(model)
        if parallelism == "ddp":  # the wrapper's forward around the (compiled) blocks' checkpointing
            _one_process_group(device)
            ids_ = [device] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids_)
        elif parallelism == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            _one_process_group(device)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in transformer_blocks(model):
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)

        def run(m=model):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return token_loss_sum(m(input_ids=ids, use_cache=False).logits, ids)

        saved[checkpointing] = saved_tensor_bytes(run)
        run().backward()
        if checkpointing:
            on = activation_checkpointing_on(getattr(model, "module", model))
        del model, run
    ratio = saved[True] / saved[False]
    ok = ratio < 0.5 and on
    table.add(label, f"saved for backward: {saved[True] / 2 ** 20:.1f} MiB with, {saved[False] / 2 ** 20:.1f} MiB "
              f"without ({ratio:.0%}); blocks report {'checkpointed' if on else 'NOT checkpointed'}",
              "pass" if ok else "FAIL")


def check_sign_update(table: Table, device: torch.device) -> None:
    """FRUGAL's compiled sign update on DDP bucket views (small buckets: views at many offsets),
    switching its state-full block every step."""
    import warnings

    import frugal
    from frugal import kernels

    _one_process_group(device)
    model = _model("llama_tiny", device, 512)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=1)
    opt = frugal.build_optimizer(model, "frugal", lr=1e-3, density=0.25, update_gap=1, sign_update="compiled")
    calls, real = [], kernels._kernel
    kernels._kernel = lambda *key: (calls.append(key), real(*key))[1]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ids = torch.randint(0, 512, (2, 64), device=device)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    logits = ddp(input_ids=ids, use_cache=False).logits
                from train_utils.loop import token_loss_sum

                token_loss_sum(logits, ids).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
    finally:
        kernels._kernel = real
    fell_back = (device.type in kernels._unavailable
                 or any("sign update is unavailable" in str(w.message) for w in caught))
    ok = bool(calls) and not fell_back
    table.add("compiled sign update (DDP bucket views)",
              f"{len(calls)} compiled calls in 3 steps, no fallback" if ok else
              f"{len(calls)} compiled calls; fell back to eager: {kernels._unavailable.get(device.type)}",
              "pass" if ok else "FAIL")


ALLREDUCE_WORKER = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.ones(256 * 2 ** 20 // 4, device="cuda")  # 256 MiB of fp32
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
t = time.perf_counter()
n = 10
for _ in range(n):
    dist.all_reduce(x)
torch.cuda.synchronize()
seconds = (time.perf_counter() - t) / n
busbw = x.numel() * 4 * 2 * (world - 1) / world / seconds  # the nccl-tests bus bandwidth
if rank == 0:
    print(f"BUSBW {busbw / 1e9:.1f}")
dist.destroy_process_group()
"""


def check_allreduce(table: Table, gpus: int, timeout: float) -> None:
    if gpus < 2:
        table.add("NCCL all-reduce", "needs 2 GPUs or more" if gpus else "no GPU on this machine", "skip")
        return
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(ALLREDUCE_WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                           f.name], capture_output=True, text=True, timeout=timeout)
    os.unlink(f.name)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BUSBW")]
    if proc.returncode or not found:
        table.add("NCCL all-reduce", f"exit {proc.returncode}: {_error_line(proc.stderr)}", "FAIL")
        return
    table.add("NCCL all-reduce", f"{found[0].split()[1]} GB/s bus bandwidth over {gpus} GPUs (256 MiB fp32)", "pass")


def check_7b_single_gpu(table: Table, gpus: int, timeout: float) -> None:
    """Two LLaMA-7B steps of bench/llama7b.py on the first GPU, held to 24 GiB."""
    check = "llama_7b on one 24 GB GPU (step in backward)"
    if not gpus:
        table.add(check, "needs a GPU (the CPU proof: python -m bench.llama7b)", "skip")
        return
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    if total < 24:
        table.add(check, f"the GPU has {total:.1f} GiB, under the 24 GiB the check holds it to", "skip")
        return
    cmd = [sys.executable, "-m", "bench.llama7b", "--device", "cuda", "--cap-gib", "24",
           "--seq-len", "256"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")
                                   .split(",")[0]))
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        table.add(check, f"exit {proc.returncode}: {_error_line(proc.stderr)}", "FAIL")
        return
    out = json.loads(lines[-1])
    result = (f"allocated {out['max_allocated_gib']} / reserved {out['max_reserved_gib']} GiB of 24 "
              f"(planned {out['planned_gib']} with the CUDA allowance), steps {out['step_s']} s")
    table.add(check, result, "pass" if out["weights_changed"] else "FAIL")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="table2", help="experiment preset whose settings the real-model runs use")
    parser.add_argument("--model", default="llama_130m", help="the preset's model to run (configs/model/)")
    parser.add_argument("--steps", type=int, default=3,
                        help="steps of each training run (the eager llama_tiny runs take at least 4: their "
                             "checkpoint at step 2 is what the resume checks resume)")
    parser.add_argument("--fast", action="store_true",
                        help="tiny eager runs and checks only: no compiling, no preset model (CPU CI)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a training run counts as hung")
    parser.add_argument("--workdir", default=None,
                        help="where the runs write (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    nproc = gpus if gpus else 2  # every GPU of the node; on CPU 2 gloo processes
    table = Table()
    # --fast: no compiling anywhere (on a GPU node too: a quick eager pass before the full check)
    compile_ok = not args.fast and (bool(gpus) or bool(shutil.which("g++") or shutil.which("c++")))
    no_compile = ("--fast: no compiling" if args.fast else "no C++ compiler for torch.compile on CPU") \
        if not compile_ok else None
    work = args.workdir or tempfile.mkdtemp(prefix="preflight-")
    os.makedirs(work, exist_ok=True)
    print(f"preflight: {gpus or 'no'} GPU(s); runs in {work}", file=sys.stderr)
    try:
        guarded(table, "environment")(check_environment)(table, gpus)
        if not gpus:
            guarded(table, "bf16 autocast (CPU)")(check_bf16_cpu)(table)

        # train.py on llama_tiny, each parallelism, eager and compiled; the eager run (a checkpoint at step 2,
        # a schedule independent of the step count) is the uninterrupted run of the resume check below
        batch = ["train.micro_batch_size=2", f"train.batch_size={2 * nproc}"]
        resumable = [f"train.steps={max(args.steps, 4)}", "schedule=cosine_restarts", "schedule.cycle_length=8",
                     "checkpoint.every=2"]
        straight = {}
        for parallelism in ("ddp", "fsdp"):
            for compiled in (False, True):
                label = f"llama_tiny {parallelism} {'compiled' if compiled else 'eager'} x{nproc}"
                if compiled and no_compile:
                    table.add(f"train {label}", no_compile, "skip")
                    continue
                overrides = [*TINY, *batch, *([f"train.steps={args.steps}"] if compiled else resumable),
                             f"train.parallelism={parallelism}", f"train.compile={str(compiled).lower()}",
                             "train.activation_checkpointing=true"]
                rows = guarded(table, f"train {label}")(check_training)(table, label, overrides, nproc, work,
                                                                        args.timeout, bool(gpus))
                if not compiled:
                    straight[parallelism] = (run_dir_of(work, label), rows, overrides) if rows else None

        # the preset's model with the preset's settings (a few steps, no evaluation)
        for parallelism in ("ddp", "fsdp"):
            for compiled in (False, True):
                label = f"{args.preset} {args.model} {parallelism} {'compiled' if compiled else 'eager'} x{nproc}"
                if not gpus or args.fast:
                    table.add(f"train {label}", "--fast" if args.fast else "a real model's run needs a GPU", "skip")
                    continue
                overrides = [f"experiment={args.preset}", f"model={args.model}", "data=synthetic",
                             f"data.vocab_size={32000}", f"train.steps={args.steps}", "train.eval_every=0",
                             "train.eval_tokens=4096", "train.require_eval_tokens=false", "checkpoint.every=0",
                             "train.progress_bar=false", "train.plot=false", "wandb.mode=disabled",
                             f"train.parallelism={parallelism}", f"train.compile={str(compiled).lower()}"]
                guarded(table, f"train {label}")(check_training)(table, label, overrides, nproc, work, args.timeout,
                                                                 True)

        for parallelism in ("ddp", "fsdp"):
            guarded(table, f"checkpoint + resume ({parallelism})")(check_resume)(
                table, nproc, work, args.timeout, straight.get(parallelism), parallelism)

        # activation checkpointing measured, every combination; the compiled sign update
        models_ac = ["llama_tiny"] + ([args.model] if gpus and not args.fast else [])
        for name in models_ac:
            for compiled in (False, True):
                for parallelism in ("none", "ddp", "fsdp"):
                    label = f"checkpointing {name}, {'compiled' if compiled else 'eager'}, {parallelism}"
                    if compiled and no_compile:
                        table.add(label, no_compile, "skip")
                        continue
                    guarded(table, label)(check_activation_checkpointing)(
                        table, device, name, compiled, parallelism, seq=64 if name == "llama_tiny" else 256, batch=2)
        if no_compile:
            table.add("compiled sign update (DDP bucket views)", no_compile, "skip")
        else:
            guarded(table, "compiled sign update (DDP bucket views)")(check_sign_update)(table, device)
        guarded(table, "NCCL all-reduce")(check_allreduce)(table, gpus, args.timeout)
        if args.fast:
            table.add("llama_7b on one 24 GB GPU (step in backward)", "--fast", "skip")
        else:
            guarded(table, "llama_7b on one 24 GB GPU")(check_7b_single_gpu)(table, gpus, args.timeout)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print()
    table.print()
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
