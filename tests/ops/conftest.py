"""Fixtures the op tests share: ``kernel`` pins each native kernel path in turn (zoo.kernels)."""

from zoo.kernels import kernel  # noqa: F401 (a fixture, found by pytest here)
