"""Where the gateway's and the fake worker's time goes: py-spy samples both
during one extra run per scenario (not counted), and its raw (collapsed-stack)
output is summed per frame, per source file and per component."""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loadtest.pinning import CorePlan, pinned
from loadtest.wrk import Scenario, Target, run_wrk


def _stacks(collapsed: str) -> Iterator[tuple[str, int]]:
    """(stack, samples) of each well-formed line of py-spy's raw output."""
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack, int(count)


def top_frames(collapsed: str, limit: int = 15) -> tuple[list[tuple[str, float]], int]:
    """Self time per frame from py-spy's raw (collapsed-stack) output: (frame, share), samples.

    Each line is ``frame;frame;...;leaf COUNT``; the leaf holds the sample.
    """
    self_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for stack, samples in _stacks(collapsed):
        total += samples
        self_counts[stack.rsplit(";", 1)[-1]] += samples
    return [(frame, n / total) for frame, n in self_counts.most_common(limit)], total


def inclusive_by_file(collapsed: str, limit: int = 15) -> list[tuple[str, float]]:
    """Share of samples whose stack passes through each source file (counted once a stack)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for stack, samples in _stacks(collapsed):
        total += samples
        for source in {_frame_file(frame) for frame in stack.split(";")}:
            counts[source] += samples
    return [(source, n / total) for source, n in counts.most_common(limit)] if total else []


def self_by_component(collapsed: str) -> list[tuple[str, float]]:
    """Self time summed per component: our files one by one, other code per package.

    Shares add up to 1, so this says where a core's time goes. A frame that
    calls into C (a socket send, uvloop's loop) holds the time spent there.
    """
    counts: collections.Counter[str] = collections.Counter()
    for frame, share in top_frames(collapsed, limit=1_000_000)[0]:
        counts[_component(_frame_file(frame))] += share  # type: ignore[assignment]
    return sorted(counts.items(), key=lambda kv: -kv[1])


def _component(path: str) -> str:
    if path.startswith(("gateway/", "shared/", "worker/")):
        return path
    if path == "asyncio/runners.py":
        return "event loop (uvloop, in C)"
    head = path.split("/", 1)[0]
    return head.removesuffix(".py").removeprefix("<frozen ").removesuffix(">")


def _frame_file(frame: str) -> str:
    # py-spy frames read "function (path/to/file.py:line)".
    inside = frame.rpartition("(")[2].rstrip(")")
    path = inside.rsplit(":", 1)[0]
    marker = "site-packages/"
    return path.split(marker, 1)[1] if marker in path else path


def profile_gateway(
    target: Target,
    chosen: Sequence[Scenario],
    args: argparse.Namespace,
    plan: CorePlan,
    out_dir: Path,
) -> dict[str, Any]:
    """One extra run per loaded scenario with py-spy sampling the gateway and
    the worker around the fake engine at once (not counted)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy not found (`.venv/bin/pip install py-spy`): no profile", flush=True)
        return {}
    assert target.proxy_pid is not None
    sampled = {"gateway": target.proxy_pid, "worker": target.backend_pid}
    profiles: dict[str, Any] = {}
    for scenario in chosen:
        raws = {who: out_dir / f"profile-{who}-{scenario.name}.txt" for who in sampled}
        spies = [
            subprocess.Popen(
                pinned(
                    plan.loadgen,
                    [
                        *(py_spy, "record", "--pid", str(pid), "--rate", "250"),
                        *("--duration", str(args.duration), "--nonblocking"),
                        *("--format", "raw", "--output", str(raws[who])),
                    ],
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for who, pid in sampled.items()
        ]
        try:
            time.sleep(0.5)  # py-spy attaches
            script = out_dir / f"wrk-{scenario.name}.lua"
            run = run_wrk(target, scenario, args.duration, plan, script, 0)
        finally:
            for spy in spies:
                spy.wait(timeout=args.duration + 30)
        for who, raw in raws.items():
            if not raw.exists():
                continue
            collapsed = raw.read_text()
            frames, samples = top_frames(collapsed)
            files = inclusive_by_file(collapsed)
            components = self_by_component(collapsed)
            # The gateway's profiles keep their old keys (the scenario's name).
            key = scenario.name if who == "gateway" else f"{who}-{scenario.name}"
            profiles[key] = {
                "file": raw.name,
                "samples": samples,
                "requests_per_s_while_sampled": run.requests_per_s,
                "self": frames,
                "self_by_component": components,
                "inclusive_by_file": files,
            }
            print(f"\n{who} profile, {scenario.name} ({samples} samples, {raw.name}):")
            print("  self time:")
            for frame, share in frames[:12]:
                print(f"    {share:6.1%}  {frame}")
            print("  self time by component:")
            for component, share in components[:14]:
                print(f"    {share:6.1%}  {component}")
    return profiles
