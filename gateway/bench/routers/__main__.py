"""``python -m gateway.bench.routers``."""

from gateway.bench.routers.cli import main

raise SystemExit(main())
