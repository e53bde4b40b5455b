"""vLLM's development endpoints of a running `vllm serve` (`/collective_rpc`, `/pause`, `/resume`,
the weight-transfer calls), served only with `SERVER_ENV` in the server's environment."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def admin(url: str, path: str, body: dict | None = None, method: str = "POST",
          timeout_s: float = 300.0, **params: Any) -> Any:
    """One call to a development endpoint, `params` as its query string; its JSON answer."""
    query = "?" + urllib.parse.urlencode(params) if params else ""
    data = json.dumps(body).encode() if body is not None else b"" if method == "POST" else None
    request = urllib.request.Request(url.rstrip("/") + path + query, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return json.loads(r.read() or b"null")
    except TimeoutError as err:
        raise AssertionError(f"{method} {path}{query} did not answer in {timeout_s:.0f} s") \
            from err


def collective_rpc(url: str, method: str, timeout_s: float = 60.0, **kwargs: Any) -> list:
    """`method(**kwargs)` of the worker extension on every rank of every engine (DP included);
    what one engine's ranks returned (vLLM answers with one engine's results)."""
    body = {"method": method, "kwargs": kwargs}
    return admin(url, "/collective_rpc", body, timeout_s=timeout_s)["results"]
