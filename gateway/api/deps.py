"""The one dependency routes take: the Services built in the lifespan."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.services import Services


async def get_services(request: Request) -> Services:
    # async: FastAPI runs a sync dependency in a thread, which cost 10% of a proxied request.
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]
