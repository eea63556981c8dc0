"""The paper's pre-training tables: their layout, how a run maps to a cell, and the published numbers.

One spec per experiment preset's `paper.table`, read by scripts/make_tables.py and scripts/memory_table.py:
a run's row comes from its resolved optimizer config, its column from the model size, schedule or step.
"""
from __future__ import annotations

GIB = 1024 ** 3

SIZE = {
    "llama_20m": "20M", "llama_35m": "35M", "llama_60m": "60M", "llama_130m": "130M",
    "llama_350m": "350M", "llama_1b": "1B", "llama_3b": "3B", "llama_7b": "7B", "gpt2_124m": "124M",
}

# Table 2 (and Table 8's column labels): ppl, memory of the optimizer state in GiB.
TABLE2 = {
    "AdamW": {"60M": 22.73, "130M": 18.13, "350M": 14.43, "1B": 12.02},
    "GaLore, rho=0.25": {"60M": 25.68, "130M": 21.11, "350M": 16.88, "1B": 13.69},
    "BAdam, rho=0.25": {"60M": 24.86, "130M": 20.34, "350M": 16.41, "1B": 13.75},
    "FRUGAL, rho=0.25": {"60M": 23.59, "130M": 18.60, "350M": 14.79, "1B": 12.32},
    "FRUGAL, rho=0.0": {"60M": 24.06, "130M": 18.90, "350M": 15.03, "1B": 12.63},
}
TABLE2_MEMORY_GIB = {
    "AdamW": {"60M": 0.43, "130M": 1.00, "350M": 2.74, "1B": 9.98},
    "GaLore, rho=0.25": {"60M": 0.30, "130M": 0.54, "350M": 1.10, "1B": 3.41},
    "BAdam, rho=0.25": {"60M": 0.29, "130M": 0.52, "350M": 1.05, "1B": 3.23},
    "FRUGAL, rho=0.25": {"60M": 0.29, "130M": 0.52, "350M": 1.05, "1B": 3.23},
    "FRUGAL, rho=0.0": {"60M": 0.24, "130M": 0.37, "350M": 0.49, "1B": 0.98},
}
# Iterations behind each size column of Tables 2, 8 and 17.
STEPS_BY_SIZE = {"60M": 200000, "130M": 200000, "350M": 240000, "1B": 300000, "3B": 300000, "124M": 200000}

# The configs/optimizer option behind each row of Table 2 (memory_table.py, mini_repro.py).
TABLE2_OPTIMIZERS = {
    "AdamW": "adamw", "GaLore, rho=0.25": "galore", "BAdam, rho=0.25": "badam",
    "FRUGAL, rho=0.25": "frugal", "FRUGAL, rho=0.0": "frugal_rho0",
}


def _rho(density) -> str:
    d = float(density)
    return "0.0" if d == 0 else f"{round(d, 4):g}"


# Table 9: AdaMeM beside Table 2's AdamW and FRUGAL rows (60M / 130M / 350M); Table 17: the concurrent
# methods' setting (clipping or Fira's limiter, weight decay; 130M / 350M).
TABLE9 = {
    "AdamW": {"60M": 22.73, "130M": 18.13, "350M": 14.43},
    "AdaMeM, rho=0.25": {"60M": 23.81, "130M": 18.99, "350M": 15.10},
    "FRUGAL, rho=0.25": {"60M": 23.59, "130M": 18.60, "350M": 14.79},
    "FRUGAL, rho=0.0": {"60M": 24.06, "130M": 18.90, "350M": 15.03},
}
TABLE17 = {
    "AdamW": {"130M": 17.52, "350M": 13.81}, "Fira, rho=0.25": {"130M": 17.58, "350M": 13.74},
    "LDAdam, rho=0.25": {"130M": 17.54, "350M": 13.54}, "FRUGAL, rho=0.25": {"130M": 17.58, "350M": 13.99},
}
# The configs/optimizer option behind each row (the memory estimate of cells no run fills; mini_repro.py).
TABLE9_OPTIMIZERS = {"AdamW": "adamw", "AdaMeM, rho=0.25": "adamem", "FRUGAL, rho=0.25": "frugal",
                     "FRUGAL, rho=0.0": "frugal_rho0"}
TABLE17_OPTIMIZERS = {"AdamW": "adamw", "Fira, rho=0.25": "fira", "LDAdam, rho=0.25": "ldadam",
                      "FRUGAL, rho=0.25": "frugal"}
MODEL_OF_SIZE = {size: name for name, size in SIZE.items()}
MUON_TABLE_OPTIMIZERS = {"AdamW": "adamw", "Muon": "muon", "FRUGAL-Muon, rho=0.25": "frugal_muon",
                         "FRUGAL-Muon, rho=0.0": "frugal_muon_rho0", "FRUGAL, rho=0.25": "frugal"}

# Registry entries named after a method, and the state-full rule that is part of the method itself
# (so that it is not printed as a variant: AdaMeM is Adafactor with momentum by definition).
_METHOD_NAMES = {"frugal": "FRUGAL", "galore": "GaLore", "badam": "BAdam", "fira": "Fira", "ldadam": "LDAdam",
                 "adamem": "AdaMeM", "frugal_muon": "FRUGAL-Muon"}
_OWN_RULE = {"adamem": "adafactor_momentum", "fira": "adamw_hf", "frugal_muon": "muon"}


def realised_density(opt: dict, start: dict | None) -> float | None:
    """The start row's `density_realised` (train.py logs `optimizer.density_report()`'s), None if absent."""
    value = (start or {}).get("density_realised")
    return float(value) if isinstance(value, (int, float)) else None


def _rho_label(opt: dict, start: dict | None = None) -> str:
    """The requested density, unless whole layers realised another ("0.0833 (asked 0.0625)": not the
    paper's row); the authors' tensor blocks (block_granularity=tensor) keep the paper's label."""
    asked = float(opt.get("density", 0.25))
    got = realised_density(opt, start)
    blockwise = opt.get("projection", "block") == "block" and opt.get("block_granularity", "layer") != "tensor"
    if got is not None and blockwise and abs(got - asked) > 1e-3:
        return f"{_rho(got)} (asked {_rho(asked)})"
    return _rho(asked)


def method(opt: dict, start: dict | None = None) -> str:
    """Paper-style method label from a resolved optimizer config ("FRUGAL, rho=0.25", "AdamW"...);
    `start`: the run's start row, whose realised density wins over a requested one it missed."""
    name = opt.get("name", "?")
    simple = {"adamw": "AdamW", "signsgd": "signSGD", "sgd": "SGD", "lion": "Lion", "sgdm": "SGDM",
              "apollo": "APOLLO", "adam_mini": "Adam-mini", "muon": "Muon"}
    if name in simple:
        return simple[name]
    base = _METHOD_NAMES.get(name, name)
    rule = opt.get("state_full", "adamw")
    extra = "" if rule in (None, "adamw", _OWN_RULE.get(name)) else f" (+{rule.capitalize()})"
    return f"{base}{extra}, rho={_rho_label(opt, start)}"


def size_label(cfg) -> str:
    name = cfg["model"]["name"]
    return SIZE.get(name, name)


def _projection(cfg, start=None) -> str:
    """Table 1's rows; those without a state-free update are GaLore's recipe (optimizer=galore), and a
    FRUGAL run without one is labelled as no row of the paper."""
    opt = cfg["optimizer"]
    if opt["name"] == "adamw":
        return "AdamW"
    proj = {"svd": "SVD", "random": "Random", "randk": "RandK", "block": "Blockwise"}.get(
        opt.get("projection", "block"), str(opt.get("projection")))
    free = opt.get("state_free", "signsgd")
    if opt["name"] == "galore":
        if free not in (None, "none"):
            return f"GaLore ({proj}) + state-free {free}: not a row of the paper"
        return f"{proj}, no state-free (GaLore)"
    if free in (None, "none"):
        return f"{proj}, no state-free ({_METHOD_NAMES.get(opt['name'], opt['name'])}): not a row of the paper"
    return f"{proj} + state-free"


def _modules(cfg, start=None) -> str:
    mods = set(cfg["optimizer"].get("state_free_modules") or ())
    names = {"embeddings": "Embeddings", "norms": "RMSNorms", "output": "Output layer"}  # in the paper's order
    return ", ".join(["Linear"] + [names[m] for m in names if m in mods])


def _precision(cfg, start=None) -> str:
    size = {"llama_1b": "1.3B"}.get(cfg["model"]["name"], size_label(cfg))
    used = (start or {}).get("precision") or cfg["train"]["precision"]  # the start row's: auto resolved
    prec = {"bf16": "Pure bf16", "bf16-mixed": "Mixed Precision", "fp32": "fp32"}.get(used, used)
    return f"{size} {prec}"


def _state_free_rule(cfg, start=None) -> str:
    opt = cfg["optimizer"]
    if opt["name"] == "adamw":
        return "AdamW"
    return {"signsgd": "signSGD", "sgd": "SGD"}.get(opt.get("state_free"), str(opt.get("state_free")))


def _density(cfg, start=None) -> str:
    opt = cfg["optimizer"]
    if opt["name"] == "adamw":
        return "1.0 (AdamW)"
    if opt["name"] == "signsgd":
        return "signSGD only"
    if opt["name"] != "frugal":
        return f"{method(opt, start)}: not a row of the paper"
    if float(opt.get("density", 0.25)) == 1:  # the paper's rho = 1 is Adam itself (optimizer=adamw)
        return "1.0 (FRUGAL, not AdamW): not a row of the paper"
    return _rho_label(opt, start)


# Each spec: title; row(cfg, start) -> label; columns: ("model",) by model size, ("steps", [s...]) the eval
# at each step, ("final", label); paper: {row: {col: ppl}}; model: the table's one model (others flagged);
# memory: the paper's memory column (GiB); estimate: {row: optimizer option} for frugal.estimate_state_bytes.
SPECS: dict[str, dict] = {
    "table1_projection": dict(
        model="llama_130m",
        title="Table 1: projection and state-free subspace (LLaMA-130M)", row=_projection,
        columns=("steps", [4000, 40000, 200000]),
        paper={
            "SVD, no state-free (GaLore)": {"4k": 39.75, "40k": 24.38, "200k": 21.11},
            "Random, no state-free (GaLore)": {"4k": 42.31, "40k": 23.55, "200k": 20.01},
            "Random + state-free": {"4k": 37.26, "40k": 21.53, "200k": 18.64},
            "SVD + state-free": {"4k": 33.96, "40k": 21.01, "200k": 18.35},
            "RandK + state-free": {"4k": 36.38, "40k": 21.25, "200k": 18.63},
            "Blockwise + state-free": {"4k": 37.20, "40k": 21.42, "200k": 18.60},
            "AdamW": {"4k": 33.95, "40k": 20.56, "200k": 18.13},
        }),
    "table2": dict(
        title="Table 2: validation perplexity (optimizer-state memory)",
        row=lambda c, s=None: method(c["optimizer"], s),
        columns=("model",), paper=TABLE2, memory=TABLE2_MEMORY_GIB),
    "table3_precision": dict(
        title="Table 3: pure bf16 vs mixed precision (AdamW, 100k iterations). The 175M model's shape is not "
              "published, so its row has no preset and no run. Read-out: the perplexity at step 100k of the "
              "cosine schedule with restarts; 'lr/peak' is the learning rate there (350M: 60k-step cycles put "
              "100k mid-cycle, 0.37x the peak; 1.3B: the end of its 100k-step cycle, 0.1x). Memory: the paper's "
              "column (its caption: weights, gradients and optimizer states; its figures are 12 bytes per "
              "nominal parameter in mixed precision and 6 in pure bf16, i.e. weights + AdamW state) beside "
              "ours, the same sum: parameters x weight bytes + the measured optimizer state (GB = 1e9 bytes)",
        row=_precision, columns=("final", "100k"), readout_lr=True,
        paper={"175M Mixed Precision": {"100k": 17.43}, "350M Pure bf16": {"100k": 17.75},
               "350M Mixed Precision": {"100k": 15.16}, "1.3B Pure bf16": {"100k": 16.51}},
        model_memory_gb={"175M Mixed Precision": 2.0, "350M Pure bf16": 2.1, "350M Mixed Precision": 4.2,
                         "1.3B Pure bf16": 7.7}),
    "table4_state_free_modules": dict(
        model="llama_130m",
        title="Table 4: modules moved to the state-free set (FRUGAL rho=0, LLaMA-130M, 100k)",
        row=_modules, columns=("final", "100k"),
        paper={"Linear": {"100k": 20.02}, "Linear, RMSNorms": {"100k": 20.07},
               "Linear, Embeddings": {"100k": 20.48}, "Linear, Embeddings, RMSNorms": {"100k": 20.55},
               "Linear, Output layer": {"100k": 34.66}}),
    "table5_3b": dict(
        model="llama_3b",
        title="Table 5: LLaMA-3B", row=lambda c, s=None: method(c["optimizer"], s),
        columns=("steps", [100000, 200000, 300000]),
        paper={"AdamW": {"100k": 14.2, "200k": 12.25, "300k": 10.93},
               "FRUGAL, rho=0.25": {"100k": 14.33, "200k": 12.42, "300k": 11.07},
               "FRUGAL, rho=0.0": {"100k": 14.78, "200k": 12.76, "300k": 11.35}}),
    "table8_beta2": dict(
        title="Table 8: beta2 = 0.95", row=lambda c, s=None: method(c["optimizer"], s), columns=("model",),
        paper={"AdamW": {"60M": 23.51, "130M": 18.32, "350M": 14.57},
               "GaLore, rho=0.25": {"60M": 26.66, "130M": 21.03, "350M": 16.79},
               "BAdam, rho=0.25": {"60M": 25.40, "130M": 20.17, "350M": 16.54},
               "FRUGAL, rho=0.25": {"60M": 24.07, "130M": 18.79, "350M": 14.96},
               "FRUGAL, rho=0.0": {"60M": 24.54, "130M": 19.11, "350M": 15.20}}),
    "table9_adamem": dict(
        title="Table 9: AdaMeM (Table 2's setup)", row=lambda c, s=None: method(c["optimizer"], s), columns=("model",),
        paper=TABLE9, estimate=TABLE9_OPTIMIZERS),
    "table10_pure_bf16": dict(
        model="llama_130m",
        title="Table 10: pure bf16 (LLaMA-130M, 100k)", row=lambda c, s=None: method(c["optimizer"], s),
        columns=("final", "100k"),
        paper={"AdamW": {"100k": 21.88}, "GaLore, rho=0.25": {"100k": 24.19},
               "BAdam, rho=0.25": {"100k": 25.03}, "FRUGAL, rho=0.25": {"100k": 23.17},
               "FRUGAL, rho=0.0": {"100k": 22.64}}),
    "table11_state_free_rule": dict(
        model="llama_130m",
        title="Table 11: state-free rule (FRUGAL rho=0.25, LLaMA-130M, 200k)", row=_state_free_rule,
        columns=("final", "200k"),
        paper={"signSGD": {"200k": 18.60}, "SGD": {"200k": 19.11}, "AdamW": {"200k": 18.13}}),
    "table12_lion": dict(
        model="llama_130m",
        title="Table 12: Lion as the state-full rule (LLaMA-130M, 200k)",
        row=lambda c, s=None: method(c["optimizer"], s),
        columns=("final", "200k"),
        paper={"AdamW": {"200k": 18.13}, "Lion": {"200k": 18.55},
               "GaLore (+Lion), rho=0.25": {"200k": 21.65}, "FRUGAL (+Lion), rho=0.25": {"200k": 18.89}}),
    "table13_gpt2": dict(
        model="gpt2_124m",
        title="Table 13: GPT-2 124M (200k)", row=lambda c, s=None: method(c["optimizer"], s), columns=("final", "200k"),
        paper={"AdamW": {"200k": 21.94}, "GaLore, rho=0.25": {"200k": 25.84},
               "BAdam, rho=0.25": {"200k": 25.43}, "FRUGAL, rho=0.25": {"200k": 23.23},
               "FRUGAL, rho=0.0": {"200k": 25.04}}),
    "table14_block_order": dict(
        model="llama_130m",
        title="Table 14: block order (FRUGAL rho=1/3, LLaMA-130M, 200k)",
        row=lambda c, s=None: str(c["optimizer"].get("block_order")), columns=("final", "200k"),
        paper={"random": {"200k": 18.50}, "ascending": {"200k": 18.54}, "descending": {"200k": 18.50}}),
    "table15_update_gap": dict(
        model="llama_130m",
        title="Table 15: update gap T (FRUGAL rho=0.25, LLaMA-130M, 200k)",
        row=lambda c, s=None: f"T={c['optimizer'].get('update_gap')}", columns=("final", "200k"),
        paper={f"T={t}": {"200k": v} for t, v in
               [(10, 18.82), (20, 18.73), (50, 18.69), (100, 18.65), (200, 18.60), (500, 18.60), (1000, 18.61)]}),
    "tables6_7_schedules": dict(
        model="llama_130m",
        title="Tables 6 and 7: constant and one-cycle cosine schedules (LLaMA-130M)",
        row=lambda c, s=None: method(c["optimizer"], s), columns=("schedule_steps", [100000, 200000]),
        paper={"AdamW": {"constant 100k": 19.51, "constant 200k": 18.51, "cosine 100k": 19.38, "cosine 200k": 17.95},
               "GaLore, rho=0.25": {"constant 100k": 22.63, "constant 200k": 21.03,
                                    "cosine 100k": 22.30, "cosine 200k": 20.60},
               "BAdam, rho=0.25": {"constant 100k": 22.31, "constant 200k": 20.66,
                                   "cosine 100k": 22.35, "cosine 200k": 20.07},
               "FRUGAL, rho=0.25": {"constant 100k": 19.97, "constant 200k": 18.85,
                                    "cosine 100k": 19.62, "cosine 200k": 18.16},
               "FRUGAL, rho=0.0": {"constant 100k": 20.33, "constant 200k": 19.14,
                                   "cosine 100k": 19.83, "cosine 200k": 18.34}}),
    "table16_density": dict(
        model="llama_130m",
        title="Table 16: density rho (LLaMA-130M, 200k)", row=_density, columns=("final", "200k"),
        paper={"1.0 (AdamW)": {"200k": 18.13}, "0.5": {"200k": 18.40}, "0.3333": {"200k": 18.50},
               "0.25": {"200k": 18.63}, "0.125": {"200k": 18.71},
               "0.0625": {"200k": 18.80}, "0.0": {"200k": 18.90}, "signSGD only": {"200k": 33.22}}),
    "table17_concurrent": dict(
        title="Table 17: Fira and LDAdam, with clipping (Fira: its norm-growth limiter) and weight decay; "
              "approximate slowdown vs AdamW (the paper, from the methods' papers): Fira 10%, LDAdam 15%, "
              "FRUGAL 0%",
        row=lambda c, s=None: method(c["optimizer"], s), columns=("model",), paper=TABLE17,
        estimate=TABLE17_OPTIMIZERS),
    "lr_grid_adamw": dict(
        title="Appendix A.1: AdamW's learning-rate grid {1e-4, 3e-4, 1e-3, 3e-3} (the best rate, 1e-3, is "
              "every method's in the paper's tables); the paper prints no numbers for it",
        row=lambda c, s=None: f"AdamW, lr={c['optimizer'].get('lr'):g}", columns=("model",), paper={}),
    "lr_galore": dict(
        title="Appendix A.1: GaLore at its own learning rate (0.01) and at AdamW's (1e-3, the one its rows "
              "of the paper's tables use); the paper prints no numbers for the 0.01 runs",
        row=lambda c, s=None: f"{method(c['optimizer'], s)}, lr={c['optimizer'].get('lr'):g}", columns=("model",),
        paper={"GaLore, rho=0.25, lr=0.001": {k: v for k, v in TABLE2["GaLore, rho=0.25"].items()}}),
    # Beyond the paper (configs/experiment/muon_table2like.yaml, docs/muon.md): rows listed for the estimates.
    "muon_table2like": dict(
        title="Beyond the paper: Muon as FRUGAL's state-full rule, Table 2's setting (no paper numbers)",
        row=lambda c, s=None: method(c["optimizer"], s), columns=("model",),
        paper={row: {size: None for size in ("60M", "130M", "350M")} for row in MUON_TABLE_OPTIMIZERS},
        estimate=MUON_TABLE_OPTIMIZERS),
}
