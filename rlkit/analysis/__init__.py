"""The analysis side: runs read back (`runs`), statistics (`stats`), comparison of runs
(`compare`, the `rlkit-compare` CLI) and declared studies (`study` the model, `records` what a
study keeps, `runner` its runs, `verdict` its analysis, `study_cli` the `rlkit-study` CLI)."""
