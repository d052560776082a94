"""The web dashboard served by the API at `/ui`: static pages whose JavaScript calls the same REST API
with the user's API key (kept in sessionStorage, sent as a Bearer header, never in a URL)."""

from api.ui.routes import router

__all__ = ["router"]
