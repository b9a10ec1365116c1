"""The browser playground: GET / (the page) and GET /playground/{name} (its script and style sheet), read from
the package. The page is open, like /health: it holds no data, and every call it makes goes to the public API with
the key its user types, so the API's key rule is the only gate."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException, Response

router = APIRouter(tags=["playground"])
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("service").joinpath("static", name).read_bytes()


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(404, f"name: no playground file {name!r} (files: {sorted(ASSETS)})")
    return Response(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
