"""loadtest/spillover.py: the no-spill config differs from the example in spill_after alone."""

from __future__ import annotations

import msgspec

from loadtest import spillover
from shared import config


def test_the_no_spill_config_is_the_example_without_spill_after() -> None:
    example = config.load(spillover.EXAMPLE)
    assert example.pools[0].spill_after == 0  # the example spills
    off = config.parse(config.to_yaml(spillover.without_spill(example)))
    assert all(p.spill_after is None for p in off.pools)
    pools = [msgspec.structs.replace(p, spill_after=None) for p in example.pools]
    assert off == msgspec.structs.replace(example, pools=pools)
