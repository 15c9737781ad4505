"""Registry lookup shared by every component family: one clear error for an unknown key."""

from typing import Any, Mapping


def pick(registry: Mapping[str, Any], key: str, family: str) -> Any:
    """Return ``registry[key]``, or raise a ValueError that lists the valid keys."""
    try:
        return registry[key]
    except KeyError:
        raise ValueError(f"unknown {family} {key!r}; valid choices are {sorted(registry)}") from None
