"""User-facing runtime errors: raised with a message meant for the person who ran kiln, not a traceback."""
from __future__ import annotations

from kiln.errors import KilnError


class KilnRuntimeError(KilnError):
    """Base class of the runtime's errors the CLI and server print without a traceback."""


class ArtifactError(KilnRuntimeError):
    """The artifact directory is missing, malformed, or from another schema version."""


class RequestError(KilnRuntimeError, ValueError):
    """A request cannot be served as asked: bad sampling parameters, a prompt too long, an unknown id."""
