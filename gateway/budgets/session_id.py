"""One rule for what a session id may look like, used for store keys and metric labels alike.

A session id arrives from a client (``X-Session-ID``, the OpenAI ``user`` field or an API-key name)
and ends up in Redis key names, Lua-script sorted-set members and the ``session`` label of the
bounded top-K gauge. ``sanitize_session_id`` maps any string to a safe id:

* an id of at most ``SESSION_ID_MAX_LEN`` characters from ``[A-Za-z0-9._:@-]`` is kept as it is;
* any other id keeps a readable prefix (bad characters turned into ``_``) and gets ``~`` plus 16 hex
  digits of its SHA-256, so two different raw ids never share a sanitized id by accident (a plain
  replace-and-truncate would merge ``"a b"`` with ``"a_b"`` and every long id sharing a prefix);
* an empty or all-blank id is no id (``None``): the request is anonymous.

The function is idempotent (``sanitize(sanitize(x)) == sanitize(x)``), so the gateway may apply it
at the edge and the budget service may apply it again. Cost: one regex match, plus one SHA-256 only
for ids that need it.
"""

from __future__ import annotations

import hashlib
import re

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
