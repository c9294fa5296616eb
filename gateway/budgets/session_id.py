"""Identity is (tenant, session): the names, and one rule for what a session id may look like.

The tenant is the API key's name (``gateway.config.ApiKeySettings.name``, already restricted to
key- and label-safe characters), or ``ANONYMOUS_TENANT`` when the gateway has no keys. The session
is the client's ``X-Session-ID``, else the OpenAI ``user`` field, else ``DEFAULT_SESSION``; it is
always scoped inside its tenant (``B``'s ``alice`` is not ``A``'s ``alice``), so a client can name
any session of its own tenant and none of another's.

``DEFAULT_SESSION`` is an ordinary id: a client may send ``X-Session-ID: default`` and share the
budget of its own id-less requests, which harms no one else. A reserved, unsendable id would
only hide those requests from operators under a name they cannot type into the admin API.

A session id arrives from a client and ends up in Redis key names, Lua-script sorted-set members
and the ``session`` label of the bounded top-K gauge. ``sanitize_session_id`` maps any string to a
safe id:

* an id of at most ``SESSION_ID_MAX_LEN`` characters from ``[A-Za-z0-9._:@-]`` is kept as it is;
* any other id keeps a readable prefix (bad characters turned into ``_``) and gets ``~`` plus 16 hex
  digits of its SHA-256, so two different raw ids never share a sanitized id by accident (a plain
  replace-and-truncate would merge ``"a b"`` with ``"a_b"`` and every long id sharing a prefix);
* an empty or all-blank id is no id (``None``): the request goes to ``DEFAULT_SESSION``.

The function is idempotent (``sanitize(sanitize(x)) == sanitize(x)``), so the gateway may apply it
at the edge and the budget service may apply it again. Cost: one regex match, plus one SHA-256 only
for ids that need it.
"""

from __future__ import annotations

import hashlib
import re

ANONYMOUS_TENANT = "anonymous"
"""The one tenant of a gateway without API keys."""

DEFAULT_SESSION = "default"
"""The session of a tenant's requests that name none."""

SESSION_ID_MAX_LEN = 128
_SAFE = re.compile(r"[A-Za-z0-9._:@-]+")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._:@-]")
_HASHED = re.compile(r"[A-Za-z0-9._:@-]*~[0-9a-f]{16}")
_DIGEST_HEX = 16


def sanitize_session_id(raw: str | None) -> str | None:
    """Return a key- and label-safe session id for ``raw``, or ``None`` for no id."""
    if raw is None:
        return None
    stripped = raw.strip()
    if not stripped:
        return None
    if len(stripped) <= SESSION_ID_MAX_LEN and (
        _SAFE.fullmatch(stripped) or _HASHED.fullmatch(stripped)
    ):
        return stripped
    digest = hashlib.sha256(stripped.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_HEX]
    prefix = _UNSAFE_CHAR.sub("_", stripped)[: SESSION_ID_MAX_LEN - _DIGEST_HEX - 1]
    return f"{prefix}~{digest}"
