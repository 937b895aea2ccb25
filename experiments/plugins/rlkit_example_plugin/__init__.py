"""An rlkit plugin package: one advantage estimator and its config, found by Hydra."""
