"""The web page of `composer serve` at `/` (static files shipped in the package, no build step, nothing fetched
from outside) and `GET /v1/model`, what the page reads to fill its form: the model, its defaults and limits.

The page is plain HTML, CSS and JavaScript in composer/serve/static/; it talks to the server only through the
public API (POST/GET/DELETE /v1/videos, /v1/model, /health, and the WebSocket /v1/streams for causal models).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from composer.request_check import ModelLimits
from composer.serve.requests import IMAGE_FIELDS, SERVER_FIELDS, SERVER_PATHS

STATIC_DIR = Path(__file__).parent / "static"


def add_page_routes(app: FastAPI, state: Any) -> None:
    """Register `/` (the page), `/static/...` (its script and style) and `GET /v1/model` on `app`, reading the
    loaded generator and the limits from `state` (the app's ServerState)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/v1/model")
    async def model():
        """The served model: family, path, whether it is causal (streams at /v1/streams), its default request
        fields and the limits a request must keep to. 503 while it loads (`status`: loading or failed)."""
        if state.generator is None:
            failed = state.load_error is not None
            message = f"the model failed to load: {state.load_error}" if failed else "the model is loading"
            return JSONResponse({"status": "failed" if failed else "loading",
                                 "error": {"message": message, "type": "server_error", "param": None, "code": 503}},
                                503, headers={"Retry-After": "5"})
        return {"status": "ready", **model_info(state.generator, state.config.limits, state.config.loras)}


def model_info(generator: Any, limits: Any, loras: Any = ()) -> dict[str, Any]:
    """What a client needs to build a request form for `generator` under the server's `limits`, with the LoRA
    adapters it loaded at start (what `lora` may name, and the scale each runs at by default)."""
    pipeline = generator.pipeline
    model_limits = ModelLimits.from_pipeline(pipeline)
    hidden = set(SERVER_FIELDS) | set(SERVER_PATHS) | set(IMAGE_FIELDS)
    defaults = {key: value for key, value in dataclasses.asdict(generator.default_sampling).items()
                if key not in hidden and not key.startswith("_")
                and (value is None or isinstance(value, (str, int, float, bool)))}
    return {
        "model": str(generator.model_path),
        "family": generator.family,
        "causal": bool(getattr(pipeline, "can_stream", False)),
        "defaults": defaults,
        "multiples": {"spatial": model_limits.spatial_multiple, "temporal": model_limits.temporal_factor,
                      "frames_per_block": model_limits.frames_per_block},
        "fixed_steps": model_limits.fixed_steps,
        "limits": {"max_frames": limits.max_frames, "max_size": limits.max_size, "max_steps": limits.max_steps},
        "loras": [{"name": o.name, "scale": o.scale} for o in loras],
    }
