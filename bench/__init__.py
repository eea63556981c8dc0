"""Benchmarks and studies: optimizer, training-step, data-pipeline and communication timings, LLaMA-7B on one
GPU, the memory planner's command line, the CPU budget study. Run from the repository root: `python -m bench.NAME`."""
