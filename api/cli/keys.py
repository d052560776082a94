"""`taper keys`: create, list and revoke API keys. An admin command: it talks to the service's Redis directly
(TAPER_REDIS_URL, or the data dir's embedded Redis, started for the command if it is not running)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from rl_service.control.settings import get_settings


def _admin_store():
    """The Store `serve` uses: TAPER_REDIS_URL, or the data dir's embedded Redis (started for this command,
    and stopped after it, if it is not running)."""
    from rl_service.control.local_services import (
        EmbeddedServiceError,
        running_embedded_redis,
        start_embedded_redis,
    )
    from rl_service.control.store import Store

    s = get_settings()
    if s.redis_url:
        return Store(s.redis_url), None
    data_dir = Path(s.data_dir)
    try:
        running = running_embedded_redis(data_dir)
    except EmbeddedServiceError as exc:
        raise typer.BadParameter(str(exc)) from None
    if running is not None:
        return Store(running.client_url), None
    server = start_embedded_redis(data_dir, binary=s.redis_server_bin, detach=False)
    return Store(server.client_url), server


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration_s(text: str) -> float:
    """Seconds in a duration like 90s, 45m, 12h, 30d or 2w."""
    number, unit = text[:-1], text[-1:].lower()
    if unit not in DURATION_UNITS or not number.isdigit() or int(number) < 1:
        raise typer.BadParameter(f"expected a positive whole number and a unit (s, m, h, d, w), e.g. 30d; got {text!r}",
                                 param_hint="--expires-in")
    return int(number) * DURATION_UNITS[unit]


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def register(app: typer.Typer, console: Console) -> None:
    """Add `taper keys` to the CLI."""
    keys_app = typer.Typer(help="API keys (admin: talks to Redis directly).", no_args_is_help=True)
    app.add_typer(keys_app, name="keys")

    @contextmanager
    def store_for_admin() -> Iterator[Any]:
        """The service's Store; a Redis that cannot be reached is a one-line error, not a traceback."""
        import redis

        store, server = _admin_store()
        try:
            yield store
        except redis.RedisError as exc:
            console.print(f"[red]error[/red] cannot use the Redis at {store.url}: {escape(str(exc))}")
            raise typer.Exit(2) from None
        finally:
            store.close()
            if server is not None:
                server.stop()

    @keys_app.command("create")
    def keys_create(
        tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
        name: Annotated[str, typer.Option(help="A label for the key.")] = "",
        expires_in: Annotated[str | None, typer.Option(help="Lifetime, e.g. 12h, 30d, 2w (default: no expiry).")] = None,
        admin: Annotated[bool, typer.Option(help="An admin key (may manage API keys and tenant quotas).")] = False,
    ) -> None:
        """Create an API key; it is printed once and only its hash is stored."""
        from rl_service.control.service import ServiceError, validate_tenant

        try:
            validate_tenant(tenant)
        except ServiceError as exc:
            raise typer.BadParameter(exc.message, param_hint="--tenant") from None
        expires_at = None if expires_in is None else time.time() + _duration_s(expires_in)
        with store_for_admin() as store:
            key = store.create_api_key(tenant, name=name, admin=admin, expires_at=expires_at)
        until = "" if expires_at is None else f", valid until {_when(expires_at)}"
        console.print(f"{'admin ' if admin else ''}API key for tenant [bold]{tenant}[/bold]{until} (shown once):")
        print(key)

    @keys_app.command("list")
    def keys_list(tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None) -> None:
        """API keys by id (the keys themselves are not stored)."""
        with store_for_admin() as store:
            keys = store.list_api_keys(tenant)
        table = Table(Column("id", no_wrap=True), "tenant", "name", "admin", "created", "expires")
        now = time.time()
        for k in keys:
            expired = k["expires_at"] is not None and k["expires_at"] <= now
            table.add_row(k["id"], k["tenant"], k["name"], "yes" if k["admin"] else "", _when(k["created_at"]),
                          _when(k["expires_at"]) + (" (expired)" if expired else ""))
        console.print(table)
        console.print(f"{len(keys)} key(s)")

    @keys_app.command("revoke")
    def keys_revoke(key_id: Annotated[str, typer.Argument(help="The key's id, as `taper keys list` shows it.")]) -> None:
        """Revoke a key: requests with it get 401 (within a few seconds: the API caches keys briefly)."""
        with store_for_admin() as store:
            info = store.revoke_api_key_id(key_id)
        if info is None:
            console.print(f"[red]error[/red] no API key with id {key_id!r} (see `taper keys list`)")
            raise typer.Exit(1)
        console.print(f"revoked {key_id} ({info['tenant']}{', ' + info['name'] if info['name'] else ''})")
