"""The status page, ``GET /ui``: one HTML document (``ui.html`` beside this module) with its
CSS and JavaScript inline, no external asset and no build step.

The page itself holds no data, so it is served to anyone; it polls the daemon's own API
(``/v1/stats``, ``/v1/nodes``, ``/v1/transfers/recent``) on this origin, which checks the
bearer token as for any other client. With authentication on, the page asks for the admin
token once, keeps it in the tab's ``sessionStorage`` (gone when the tab closes; never in a
URL or a cookie, so nothing else sends it) and sends it as ``Authorization: Bearer``.

Its Content-Security-Policy allows nothing but the document's own inline script and style,
named by their SHA-256 hashes (the document is static: no nonce to make per request), and
fetches to this origin: no external load, no inline event handler, no style attribute, no
framing, no form submission.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from fastapi.responses import HTMLResponse

DOCUMENT = "ui.html"


def _source_hash(tag: str, document: str) -> str:
    """The CSP source for the one ``<tag>`` block of ``document`` (its exact text)."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", document, flags=re.DOTALL)
    if len(blocks) != 1:  # a second block would be refused by the browser: fail here instead
        raise ValueError(f"{DOCUMENT} must have exactly one <{tag}> block, not {len(blocks)}")
    digest = hashlib.sha256(blocks[0].encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


def content_security_policy(document: str) -> str:
    return "; ".join(
        (
            "default-src 'none'",
            f"script-src {_source_hash('script', document)}",
            f"style-src {_source_hash('style', document)}",
            "connect-src 'self'",
            "img-src 'self'",  # the browser's own favicon request
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


@cache
def _page() -> tuple[bytes, dict[str, str]]:
    document = resources.files("kvfabric.api").joinpath(DOCUMENT).read_text("utf-8")
    headers = {
        "Content-Security-Policy": content_security_policy(document),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cache-Control": "no-store",  # a new daemon version's page, never a stale one
    }
    return document.encode(), headers


def page_response() -> HTMLResponse:
    body, headers = _page()
    return HTMLResponse(body, headers=headers)
