"""The repository's sweeper (configs/config.yaml: hydra.sweeper._target_): see sweeper.py. Hydra
instantiates a sweeper only from a `hydra_plugins` package, hence this one's place."""
