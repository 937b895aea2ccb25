"""Refusals: the one error type for input rlkit cannot run (`ConfigError`, exit 2 with one line
naming the key), `require` for a condition on a value (`require_all` for a list of them, refused
together), and the plugin checks `check_class` (before a class is built) and `check` (on what was
built) against a kind of `rlkit.components`.
Every refusal of a config value, a component or a plugin raises through here. Imports nothing of
torch, so the command line can refuse before loading it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def require(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`."""
    if not ok:
        raise ConfigError(message)


def require_all(checks: list[tuple[bool, str]]) -> None:
    """Raise one `ConfigError` naming every check `(ok, message)` that failed, in order."""
    failed = [message for ok, message in checks if not ok]
    if failed:
        raise ConfigError("; ".join(failed))


def methods(kind: type) -> set[str]:
    """The methods a component kind declares (its public ones and `__call__`)."""
    return {n for n, v in vars(kind).items() if callable(v) and (not n.startswith("_") or n == "__call__")}


def check_class(cls: type, kind: type, key: str) -> None:
    """Before `cls` is built: fail naming the config key when it does not define the methods `kind`
    declares, so that a `_target_` naming some other class is never constructed (its constructor
    could do anything: open, write, connect). Attributes are checked on the built object (`check`)."""
    missing = sorted(n for n in methods(kind) if not any(n in vars(c) for c in cls.__mro__ if c is not object))
    if missing:
        raise ConfigError(
            f"{key}: {cls.__module__}.{cls.__qualname__} does not implement {kind.__name__} (it lacks "
            f"{', '.join(missing)}; see rlkit.components.{kind.__name__}); refusing to build it"
        )


def check(obj, kind: type, key: str) -> None:
    """Fail naming the config key when `obj` (a class or an instance) lacks what `kind` declares."""
    declared = set(getattr(kind, "__annotations__", {})) | methods(kind)
    missing = sorted(n for n in declared if not hasattr(obj, n))
    if missing:
        name = getattr(obj, "__qualname__", type(obj).__qualname__)
        raise ConfigError(
            f"{key}: {name} lacks {', '.join(missing)} (see rlkit.components.{kind.__name__}; "
            "subclass it to inherit the defaults)"
        )
