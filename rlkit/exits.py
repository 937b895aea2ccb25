"""The exit codes of rlkit's commands, in a module of their own so that `rlkit-study` reads them
without importing torch."""

EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_DECISION, EXIT_STORAGE, EXIT_PREEMPTED = (
    2,
    3,
    4,
    74,
    75,
)  # 4: a study's plan foreseeably cannot decide, a decision is asked for; 74: EX_IOERR; 75: EX_TEMPFAIL, "try again"
