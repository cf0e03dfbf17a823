"""Shared fixtures: short temp dirs (unix socket paths must stay under 108 bytes), fake NVML,
the real plugin process, the stand-in API server and an API client for it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from deviceplugin.kube.client import Api, Timeouts, load_api
from deviceplugin.simulate.apiserver import FakeApiServer
from deviceplugin.simulate.nvml import FakeNvml
from deviceplugin.simulate.specs import load_spec
from tests.plugin_proc import PluginProcess

# Every stand-in API server the tests start, so each test can be checked for 403s it did not
# expect: the agent always runs with the shipped RBAC, and a permission it needs and lacks is
# a defect of the manifests even where the plugin carries on without it.
_SERVERS: list[FakeApiServer] = []
_server_init = FakeApiServer.__init__


def _tracked_init(self: FakeApiServer, *args: Any, **kwargs: Any) -> None:
    _server_init(self, *args, **kwargs)
    _SERVERS.append(self)


FakeApiServer.__init__ = _tracked_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _no_unexpected_403() -> Iterator[None]:
    """A test that meets a 403 fails unless it cleared it from the server's `denied`."""
    seen = {id(s): len(s.denied) for s in _SERVERS}
    yield
    denied = [m for s in _SERVERS for m in s.denied[seen.get(id(s), 0) :]]
    _SERVERS[:] = [s for s in _SERVERS if not s.down]
    assert not denied, denied


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gf-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


MakeFake = Callable[..., FakeNvml]


@pytest.fixture
def make_fake() -> Iterator[MakeFake]:
    """Install fake NVML libraries for one test and restore pynvml's library afterwards."""
    fakes: list[FakeNvml] = []
    before = pynvml.nvmlLib

    def make(spec: Any = "h200x2", **kw: Any) -> FakeNvml:
        sim = load_spec(spec) if isinstance(spec, str) else spec
        fake = FakeNvml(sim, **kw)
        fake.install()
        fakes.append(fake)
        return fake

    yield make
    for fake in reversed(fakes):
        fake.uninstall()
    assert pynvml.nvmlLib is before


MakePlugin = Callable[..., PluginProcess]


@pytest.fixture
def make_plugin(short_tmp: Path) -> Iterator[MakePlugin]:
    """The real plugin process (not yet started) in `short_tmp`; cleaned up after the test."""
    made: list[PluginProcess] = []

    def make(config: str | None = None, preset: str = "h200x2") -> PluginProcess:
        plugin = PluginProcess(short_tmp, preset=preset, config=config)
        made.append(plugin)
        return plugin

    yield make
    for plugin in made:
        plugin.cleanup()


API_NODE = "node-1"  # the Node the `fake` API server holds


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    """The stand-in API server, serving one Node, enforcing the shipped RBAC."""
    server = FakeApiServer().start()
    server.add_node(API_NODE)
    yield server
    server.stop()


@pytest.fixture
def api(fake: FakeApiServer, short_tmp: Path) -> Api:
    """The plugin's own API client, pointed at `fake` through a kubeconfig."""
    environ = {"KUBECONFIG": str(fake.write_kubeconfig(short_tmp / "kubeconfig"))}
    made = load_api(environ, str(short_tmp / "no-sa"), Timeouts(watch=5))
    assert made is not None
    return made
