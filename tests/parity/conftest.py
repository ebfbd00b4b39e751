"""Fixtures of the parity suite: leased projects (see :mod:`tests.parity.support`)."""

from __future__ import annotations
