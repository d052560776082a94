"""A small MCP tool server for the MCP environment example: a made-up weather table behind two tools.

Run: python examples/mcp/weather_server.py --port 8765   (streamable HTTP at http://127.0.0.1:8765/mcp)
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

TEMPERATURES_C = {"oslo": 4, "paris": 12, "cairo": 31, "lima": 19, "tokyo": 15, "quito": 14}

server = MCPServer("weather")


@server.tool()
def get_temperature(city: str) -> str:
    """The current temperature in a city, in degrees Celsius."""
    key = city.strip().lower()
    if key not in TEMPERATURES_C:
        raise ValueError(f"unknown city {city!r}; known: {', '.join(sorted(TEMPERATURES_C))}")
    return str(TEMPERATURES_C[key])


@server.tool()
def list_cities() -> str:
    """The cities the weather table knows."""
    return ", ".join(sorted(TEMPERATURES_C))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    server.run("streamable-http", host=args.host, port=args.port)


if __name__ == "__main__":
    main()
