"""``loadtest.profiles``: py-spy's collapsed stacks summed per frame, file and component."""

from __future__ import annotations

from loadtest import profiles

COLLAPSED = """\
main (a.py:1);run (uvicorn/server.py:10);handle (gateway/api/openai_routes.py:5) 6
main (a.py:1);run (uvicorn/server.py:10);encode (gateway/dialects/sse.py:3) 3
main (a.py:1);select (selectors.py:9) 1
"""


def test_top_frames_counts_self_time_at_the_leaf() -> None:
    frames, samples = profiles.top_frames(COLLAPSED)
    assert samples == 10
    assert frames[0] == ("handle (gateway/api/openai_routes.py:5)", 0.6)
    assert frames[1] == ("encode (gateway/dialects/sse.py:3)", 0.3)


def test_self_by_component_splits_all_time_between_our_files_and_packages() -> None:
    shares = dict(profiles.self_by_component(COLLAPSED))
    assert shares == {
        "gateway/api/openai_routes.py": 0.6,
        "gateway/dialects/sse.py": 0.3,
        "selectors": 0.1,
    }


def test_inclusive_by_file_counts_each_stack_once() -> None:
    shares = dict(profiles.inclusive_by_file(COLLAPSED))
    assert shares["a.py"] == 1.0
    assert shares["uvicorn/server.py"] == 0.9
    assert shares["gateway/dialects/sse.py"] == 0.3
