"""The swappable boxes of the block, one family per file, each with a plain dict registry."""

from workbench.components.registry import pick

__all__ = ["pick"]
