"""Operations: the preflight of a node, fault injection, where a sweep stands, and the SLURM helpers (ops/*.sh).
Run from the repository root: `python -m ops.NAME ...`."""
