"""rlkit's Hydra config tree; importing it registers the typed schemas."""

import rlkit.config  # noqa: F401
