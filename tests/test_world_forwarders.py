"""``World`` forwards to its components (``world.membership``, ``world.transports``) only
what callers outside the library use (README, docs/, tests); the library's own machinery
calls the components (issue 32 item 5 cleanup)."""

from __future__ import annotations

import re
from pathlib import Path

import xreshard

GONE = ("routes", "cross_kind", "current_members", "confirm_joins", "abort_transports")


def test_world_has_no_forwarder_only_the_library_used():
    from xreshard.runtime.world import World
    from xreshard.runtime.world_membership import Membership
    from xreshard.runtime.world_transports import WorldTransports

    assert [n for n in GONE if hasattr(World, n)] == []
    # what they forwarded to is still there, on the components
    for owner, name in ((WorldTransports, "routes"), (WorldTransports, "abort"),
                        (Membership, "current_members"), (Membership, "confirm_joins")):
        assert callable(getattr(owner, name)), (owner, name)


def test_no_module_calls_a_removed_forwarder_on_a_world():
    called = re.compile(r"world\.(" + "|".join(GONE) + r")\b")
    root = Path(xreshard.__file__).parent
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if called.search(line)]
    assert found == []
