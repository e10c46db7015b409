"""The root of every error kiln reports to a user without a traceback (the CLI exits with status 2).

A leaf module, importing nothing: the compile side (`kiln.dsl.errors`: SourceError, and through it
CodegenError, PassError, ...) and the runtime (`kiln.runtime.errors`: ArtifactError, RequestError, ...) both
derive from it, so the CLI and a library user catch one class for everything a user can get wrong.
"""
from __future__ import annotations


class KilnError(Exception):
    """Something the user can fix: bad input, a file kiln cannot use, an option it cannot build."""

    def format(self) -> str:
        return f"error: {self}"
