"""An MCP server none of the examples resemble: a shop with 150 tools (`stock`, `price` and filler) that lists
them in pages of 50 (`nextCursor`), as large real servers do. Run: python mcp_shop_server.py --port N."""

from __future__ import annotations

import argparse
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import ListToolsResult

PAGE = 50
STOCK = {"apple": 12, "pear": 0}


class PagedServer(MCPServer):
    async def _handle_list_tools(self, ctx: Any, params: Any) -> ListToolsResult:
        tools = await self.list_tools()
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + PAGE
        return ListToolsResult(tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None)


server = PagedServer("shop")


@server.tool()
def stock(item: str) -> str:
    """Units of an item in stock."""
    return str(STOCK[item])


@server.tool()
def price(item: str) -> str:
    """An item's price in cents."""
    return {"apple": "40", "pear": "55"}[item]


for i in range(148):
    server.add_tool(lambda: "nothing here", name=f"aisle_{i:03d}", description="An empty aisle.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    server.run("streamable-http", host="127.0.0.1", port=parser.parse_args().port)
