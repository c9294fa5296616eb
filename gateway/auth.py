"""Client API keys and the admin token; a request's tenant.

Client keys are configured as SHA-256 digests; a request's key is hashed and looked up, so the
gateway never holds a key in memory or config. A key's name is its tenant, the outer half of the
identity (tenant, session) every budget, throttle and metric uses; without keys every request is
the one ``anonymous`` tenant's. The admin token is compared in constant time.
Errors are OpenAI-shaped: 401 for a missing or unknown credential, 403 for a known one that may
not do this (or an admin API that is switched off).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from pydantic import SecretStr
from starlette.requests import Request

from gateway.budgets.session_id import ANONYMOUS_TENANT
from gateway.config import AdminSettings, AuthSettings
from gateway.errors import GatewayError


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class ApiKeys:
    def __init__(self, settings: AuthSettings, aliases: Mapping[str, str] | None = None) -> None:
        self._by_digest = {k.sha256: k.name for k in settings.api_keys}
        # each key's models (``ApiKeySettings.models``) as served names: an alias resolved
        self._models = {k.name: frozenset((aliases or {}).get(m, m) for m in k.models)
                        for k in settings.api_keys if k.models is not None}

    def may_use(self, tenant: str, model: str) -> bool:
        """Whether ``tenant``'s key may use ``model`` (a served name: aliases resolved)."""
        allowed = self._models.get(tenant)
        return allowed is None or model in allowed

    @property
    def required(self) -> bool:
        return bool(self._by_digest)

    @property
    def tenants(self) -> tuple[str, ...]:
        """Every tenant a request can have: the keys' names, or the anonymous one."""
        return tuple(self._by_digest.values()) or (ANONYMOUS_TENANT,)

    def identify(self, request: Request) -> str:
        """The request's tenant: the calling key's name, or ``anonymous`` when keys are not in
        use. Raises 401."""
        if not self._by_digest:
            return ANONYMOUS_TENANT
        key = bearer(request)
        if key is None:
            raise GatewayError(401, "an API key is required: `Authorization: Bearer KEY`",
                               code="missing_api_key")
        name = self.name_of(key)
        if name is None:
            raise GatewayError(401, "invalid API key", code="invalid_api_key")
        return name

    def name_of(self, key: str) -> str | None:
        return self._by_digest.get(hashlib.sha256(key.encode()).hexdigest())


def _matches(token: str, secret: SecretStr | None) -> bool:
    return secret is not None and hmac.compare_digest(
        token.encode(), secret.get_secret_value().encode())


def require_metrics_reader(request: Request, settings: AdminSettings) -> None:
    """With ``admin.metrics_token`` set, 401 unless the caller sends it or the admin token."""
    if settings.metrics_token is None:
        return
    token = bearer(request)
    if token is None:
        raise GatewayError(401, "the metrics token is required: `Authorization: Bearer TOKEN`",
                           code="missing_metrics_token")
    if not (_matches(token, settings.metrics_token) or _matches(token, settings.token)):
        raise GatewayError(401, "invalid metrics token", code="invalid_metrics_token")


def require_admin(request: Request, settings: AdminSettings, api_keys: ApiKeys) -> None:
    """401 without a valid admin token; 403 for a client key or when the admin API is off."""
    if settings.token is None:
        raise GatewayError(403, "the admin API is disabled: set admin.token",
                           code="admin_disabled")
    token = bearer(request)
    if token is None:
        raise GatewayError(401, "the admin token is required: `Authorization: Bearer TOKEN`",
                           code="missing_admin_token")
    if _matches(token, settings.token):
        return
    if api_keys.name_of(token) is not None:
        raise GatewayError(403, "a client API key cannot use the admin API",
                           code="not_an_admin_token")
    raise GatewayError(401, "invalid admin token", code="invalid_admin_token")
