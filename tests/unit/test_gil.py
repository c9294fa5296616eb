"""``gateway.gil``: a gateway process's GIL switch interval. (Where the tokenizing thread gives
the GIL away is tested with its callers: ``test_kvindex_hashing``, ``test_prompt_segments``.)"""

from __future__ import annotations

import sys

from gateway import gil


def test_install_sets_the_switch_interval_below_cpythons_default() -> None:
    before = sys.getswitchinterval()
    try:
        gil.install()
        assert sys.getswitchinterval() == gil.SWITCH_INTERVAL_S < 0.005
    finally:
        sys.setswitchinterval(before)
