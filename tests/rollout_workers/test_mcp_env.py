"""kind `mcp`: registration lists the server's tools under the target rules; episodes open their own
session; isError is a tool error for the model, a dead server an infrastructure failure."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from rollout_workers.environments.base import ToolError
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.environments.registry import make_env_factory, validate_registration

from .mcp_helpers import free_port, start_weather_server, stop

LOCAL = EnvironmentPolicy(http_allow=("127.0.0.1",))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[object, str]]:
    proc, url = start_weather_server()
    yield proc, url
    stop(proc)


def test_registration_stores_the_servers_tool_schemas(server: tuple[object, str]) -> None:
    _, url = server
    reg = validate_registration({"kind": "mcp", "name": "weather", "base_url": url}, LOCAL)
    tools = {t["name"]: t for t in reg.tools or []}
    assert set(tools) == {"get_temperature", "list_cities"}
    assert tools["get_temperature"]["parameters"]["required"] == ["city"]
    only = validate_registration({"kind": "mcp", "name": "w2", "base_url": url, "tools": [{"name": "list_cities"}]}, LOCAL)
    assert [t["name"] for t in only.tools or []] == ["list_cities"]
    with pytest.raises(ValueError, match="tools: the MCP server has no tool 'forecast'"):
        validate_registration({"kind": "mcp", "name": "w3", "base_url": url, "tools": [{"name": "forecast"}]}, LOCAL)


def test_registration_refuses_targets_outside_the_allow_list_and_silent_servers(server: tuple[object, str]) -> None:
    _, url = server
    with pytest.raises(ValueError, match="base_url: .*loopback"):
        validate_registration({"kind": "mcp", "name": "weather", "base_url": url}, EnvironmentPolicy())
    with pytest.raises(ValueError, match="base_url: the MCP server did not answer"):
        validate_registration({"kind": "mcp", "name": "weather", "timeout_s": 3,
                               "base_url": f"http://127.0.0.1:{free_port()}/mcp"}, LOCAL)
    with pytest.raises(ValueError, match="import_path: only for kind 'python'"):
        validate_registration({"kind": "mcp", "name": "x", "base_url": url, "import_path": "a:B"}, LOCAL)


def test_episode_calls_tools_and_shows_is_error_to_the_model(server: tuple[object, str]) -> None:
    _, url = server
    reg = validate_registration({"kind": "mcp", "name": "weather", "base_url": url, "retries": 0}, LOCAL)

    async def episode() -> tuple[list, str, str]:
        env = make_env_factory(reg, policy=LOCAL)()
        messages = await env.reset({"id": "t1", "question": "How warm is Oslo?"})
        try:
            result = await env.call("get_temperature", {"city": "Oslo"})
            cities = await env.call("list_cities", {})
            with pytest.raises(ToolError, match="get_temperature"):
                await env.call("get_temperature", {"city": "Atlantis"})
        finally:
            await env.close()
        return messages, result, cities

    messages, result, cities = asyncio.run(episode())
    assert messages == [{"role": "user", "content": "How warm is Oslo?"}]
    assert result == "4"
    assert "oslo" in cities.split(", ")


def test_a_dead_server_mid_episode_is_an_infrastructure_failure() -> None:
    proc, url = start_weather_server()
    reg = validate_registration({"kind": "mcp", "name": "weather", "base_url": url, "retries": 1,
                                 "backoff_s": 0.05, "timeout_s": 5}, LOCAL)

    async def episode() -> BaseException | None:
        env = make_env_factory(reg, policy=LOCAL)()
        await env.reset({"id": "t1", "messages": [{"role": "user", "content": "Oslo?"}]})
        assert await env.call("get_temperature", {"city": "oslo"}) == "4"
        stop(proc)
        try:
            await env.call("get_temperature", {"city": "oslo"})
        except ToolError as e:  # must not be shown to the model as its own mistake
            return e
        except Exception as e:
            return e
        finally:
            await env.close()
        return None

    error = asyncio.run(episode())
    assert error is not None and not isinstance(error, ToolError), error


def test_every_connection_is_checked_not_only_the_registration(server: tuple[object, str]) -> None:
    _, url = server
    reg = validate_registration({"kind": "mcp", "name": "weather", "base_url": url, "timeout_s": 5}, LOCAL)

    async def episode() -> None:
        env = make_env_factory(reg, policy=EnvironmentPolicy())()  # the operator no longer admits loopback
        try:
            await env.reset({"id": "t1", "question": "Oslo?"})
        finally:
            await env.close()

    with pytest.raises(RuntimeError, match="loopback"):
        asyncio.run(episode())


def test_a_server_with_many_tools_in_pages_registers_the_ones_named() -> None:
    """150 tools listed 50 a page: every page is read (nextCursor), and the 128-tool limit applies to what the
    environment exposes, after the `tools` filter."""
    from .mcp_helpers import SHOP_SERVER

    proc, url = start_weather_server(script=SHOP_SERVER)
    try:
        reg = validate_registration({"kind": "mcp", "name": "shop", "base_url": url,
                                     "tools": [{"name": "stock"}, {"name": "aisle_147"}]}, LOCAL)
        assert [t["name"] for t in reg.tools or []] == ["stock", "aisle_147"]  # aisle_147 is on the third page
        with pytest.raises(ValueError, match="lists 150 tools, more than the 128 an environment may expose; name the"):
            validate_registration({"kind": "mcp", "name": "shop", "base_url": url}, LOCAL)
    finally:
        stop(proc)


def test_registrations_that_are_not_mcp_say_what_is_wrong() -> None:
    """A plain HTTP service at base_url is "not an MCP endpoint" (not a JSON-RPC parse dump); a stdio server's
    config says why it cannot run and what to do."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Plain(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "16")
            self.end_headers()
            self.wfile.write(b'{"result": "ok"}')

        def log_message(self, *args: object) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError) as exc:
            validate_registration({"kind": "mcp", "name": "plain", "timeout_s": 5,
                                   "base_url": f"http://127.0.0.1:{httpd.server_port}/"}, LOCAL)
    finally:
        httpd.shutdown()
    assert str(exc.value).startswith("base_url: ") and "not an MCP endpoint" in str(exc.value)
    assert "validation error" not in str(exc.value) and "kind 'http'" in str(exc.value)
    with pytest.raises(ValueError, match="command: a stdio MCP server .command/args. is never run on the cluster.*"
                                         "streamable HTTP"):
        validate_registration({"kind": "mcp", "name": "local", "command": "python", "args": ["server.py"]}, LOCAL)
