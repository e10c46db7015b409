"""Source-located errors: every user-facing compile error prints `file:line:col`, the line, and a caret."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError  # the one root (a leaf module); re-exported here for the compile side


@dataclass(frozen=True, slots=True)
class Loc:
    """A position in a source file (1-based line and column)."""

    file: str
    line: int
    col: int
    end_col: int | None = None  # exclusive; the caret underlines [col, end_col) when known

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


_SOURCES: dict[str, str] = {}


def register_source(file: str, text: str) -> None:
    """Remembers a file's text so errors can quote the offending line (also for in-memory sources)."""
    _SOURCES[file] = text


def source_line(loc: Loc) -> str | None:
    text = _SOURCES.get(loc.file)
    if text is None:
        try:
            with open(loc.file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return None
    lines = text.splitlines()
    return lines[loc.line - 1] if 0 < loc.line <= len(lines) else None




class SourceWarning(UserWarning):
    """Something a user probably did not mean, at a place in a file; the compile goes on."""

    def __init__(self, message: str, loc: Loc | None, notes: tuple[str, ...] = ()):
        super().__init__(message)
        self.message, self.loc, self.notes = message, loc, notes

    def format(self) -> str:
        return SourceError(self.message, self.loc, self.notes).format().replace("error:", "warning:", 1)


class SourceError(KilnError):
    """An error at a place in a recipe or model file."""

    def __init__(self, message: str, loc: Loc | None, notes: tuple[str, ...] = ()):
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.notes = notes

    def format(self) -> str:
        if self.loc is None:
            head = f"error: {self.message}"
            return "\n".join([head, *(f"  note: {n}" for n in self.notes)])
        out = [f"{self.loc}: error: {self.message}"]
        line = source_line(self.loc)
        if line is not None:
            width = max(1, (self.loc.end_col or self.loc.col + 1) - self.loc.col)
            out.append(f"  {line}")
            out.append("  " + " " * (self.loc.col - 1) + "^" + "~" * (width - 1))
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.message if self.loc is None else f"{self.loc}: {self.message}"
