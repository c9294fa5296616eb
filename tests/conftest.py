"""What every test runs under.

httpx's default timeout (5 s for connect, read, write and pool; the openai client's connect is
5 s too) applies to each HTTP call a test
makes without a ``timeout`` of its own. On a loaded CI machine the test process, with the servers
it runs in threads, can stall for seconds (CI saw ~20 s); a 5 s read then fires while nothing is
wrong. Here a call without a timeout of its own waits up to ``TEST_HTTP_TIMEOUT_S``. A test whose
point is a timeout (a client that gives up, a slow worker cut off) sets that timeout explicitly,
and it is kept. Only the test process is changed: the gateway's own clients set their timeouts
from its configuration.
"""

from __future__ import annotations

import httpx._config
import openai

TEST_HTTP_TIMEOUT_S = 60.0

# httpx's functions and clients take this one ``Timeout`` object as their default argument (and
# copy it per client), so it is changed in place, before any test makes a call.
_default = httpx._config.DEFAULT_TIMEOUT_CONFIG
_default.connect = _default.read = _default.write = _default.pool = TEST_HTTP_TIMEOUT_S
openai.DEFAULT_TIMEOUT.connect = TEST_HTTP_TIMEOUT_S  # its read, write and pool are 600 s
