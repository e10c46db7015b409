"""Fixtures: the stand-in artifact, a shared live server, and a factory for servers with other settings."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from live_server import MODEL, LiveServer
from standin_artifact import write_artifact


@pytest.fixture(scope="session")
def standin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifact(tmp_path_factory.mktemp("server-art") / MODEL)


@pytest.fixture(scope="session")
def live_server(standin_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(standin_dir, {"num_kv_blocks": 512})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def make_server(standin_dir: Path) -> Iterator[Callable[..., LiveServer]]:
    """Factory for servers with their own settings (API key, tiny queue, ...); stopped at session end."""
    started: list[LiveServer] = []

    def make(engine_kwargs: dict | None = None, **app_kwargs: Any) -> LiveServer:
        server = LiveServer(standin_dir, engine_kwargs, **app_kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def client(live_server: LiveServer) -> Any:
    import openai
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
