"""Numbers read from environment variables, with errors that name the variable."""

from __future__ import annotations


def env_number(name: str, default: float, env: dict[str, str]) -> float:
    """``env[name]`` as a number >= 0, ``default`` when unset or empty; ValueError otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number (got {raw!r})") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (got {raw!r})")
    return value
