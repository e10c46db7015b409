"""What the tool and the reasoning parsers share: a registry of parser classes by name (`kiln serve --tool-parser
/ --reasoning-parser NAME`), whose families may be registered by module path and imported on first use, and
`held_prefix`, the text a stream holds back because it may still become a marker."""
from __future__ import annotations

import importlib
import threading

from ..errors import RequestError


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text that may still become
    the marker, so a stream holds it back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ParserRegistry:
    """Parser classes by name: `register(*names)` decorates a class, `register_lazy(names, module, class_name)`
    names one that `module` defines, imported the first time one of its names is asked for (so importing the
    registry imports no family). Either way the first name becomes `cls.name`. `get(name)` instantiates one or
    raises RequestError naming the known ones."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._classes: dict[str, type] = {}
        self._lazy: dict[str, tuple[str, str]] = {}  # name -> (module path, class name), until first use
        self._lock = threading.Lock()  # two threads asking for one lazy family import it once

    def register(self, *names: str):
        def decorator(cls: type) -> type:
            cls.name = names[0]
            for n in names:
                self._classes[n] = cls
            return cls
        return decorator

    def register_lazy(self, names: tuple[str, ...], module: str, class_name: str) -> None:
        for n in names:
            self._lazy[n] = (module, class_name)

    def names(self) -> list[str]:
        return sorted(set(self._classes) | set(self._lazy))

    def get_class(self, name: str) -> type | None:
        """The class registered as `name` (its module imported now if it was registered lazily), or None."""
        cls = self._classes.get(name)
        if cls is None and name in self._lazy:
            with self._lock:
                cls = self._classes.get(name)
                if cls is None:
                    where = self._lazy[name]
                    names = [n for n, w in self._lazy.items() if w == where]  # registration order: first is its name
                    cls = self.register(*names)(getattr(importlib.import_module(where[0]), where[1]))
                    for n in names:
                        del self._lazy[n]
        return cls

    def get(self, name: str):
        cls = self.get_class(name)
        if cls is None:
            raise RequestError(f"unknown {self.what} {name!r} (known: {', '.join(self.names())})")
        return cls()
