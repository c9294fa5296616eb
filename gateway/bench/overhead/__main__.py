"""``python -m gateway.bench.overhead``."""

from gateway.bench.overhead.cli import main

raise SystemExit(main())
