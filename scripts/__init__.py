"""The programs that reproduce the paper: its tables, figures, memory table, the CPU-scale mini reproduction,
pretokenized data and the optimizer configs. Run from the repository root: `python -m scripts.NAME ...`."""
