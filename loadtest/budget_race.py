"""A key's budget under a race, measured: the ``budget`` scenario of ``make loadtest``.

``llmgate serve`` (one worker, the embedded model, eager) and a second lone
gateway in front of the same worker, both counting limits in one Redis
(Debian's ``redis-server``, started here). Each run gives a fresh key a
daily token budget and sends ``--race-requests`` (64) greedy completions
at once, half through each gateway, each reserving its prompt and
``--race-tokens`` (16) tokens; the budgets grow from run to run, so the
race is cut at different points. Reports per run the settled spend against
the budget (past it: how far, against one request's reservation), how many
requests were refused, and whether the spend equals the tokens the engine
reported for the answers given; writes ``summary.json`` and ``summary.csv``.

    make loadtest ARGS="--scenario budget"
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.tenants.costs import prompt_bound
from loadtest.procs import await_ready, healthy_workers, launched, start_redis
from loadtest.report import ROOT, markdown_table, write_csv, write_json
from shared import api_keys
from shared.ports import free_port, free_port_range

STARTUP_TIMEOUT_S = 600.0
SETTLE_WAIT_S = 30.0
PROMPT = "Budget race: count to ten."


@dataclass
class Run:
    run: int
    budget: int
    spent: int
    overshoot: int
    largest_reservation: int
    within_one_reservation: bool
    admitted: int
    refused: int
    engine_tokens: int
    counted_once: bool


async def _race(urls: list[str], key: str, body: dict[str, Any], n: int) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {key}"}
    clients = [httpx.AsyncClient(base_url=u, headers=headers, timeout=600) for u in urls]
    try:
        return await asyncio.gather(
            *(clients[i % len(clients)].post("/v1/completions", json=body) for i in range(n))
        )
    finally:
        for client in clients:
            await client.aclose()


def _budget(url: str, operator: str, name: str) -> dict[str, Any]:
    usage = httpx.get(
        f"{url}/v1/usage",
        params={"key": name},
        headers={"Authorization": f"Bearer {operator}"},
        timeout=60,
    ).json()
    (row,) = [b for b in usage["budgets"] if b["key"] == name]
    return dict(row)


def one_run(index: int, urls: list[str], keys: dict[str, str], budget: int, args: Any) -> Run:
    body = {
        "model": args.model,
        "prompt": PROMPT,
        "max_tokens": args.race_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    name = f"racer-{index}"
    answers = asyncio.run(_race(urls, keys[name], body, args.race_requests))
    bad = [a for a in answers if a.status_code not in (200, 429)]
    if bad:
        sys.exit(f"run {index}: {bad[0].status_code} {bad[0].text}")
    given = [a for a in answers if a.status_code == 200]
    engine_tokens = sum(a.json()["usage"]["total_tokens"] for a in given)
    # Each request's settlement reaches Redis just after its answer: the spend
    # is read once it equals the engine's tokens, or after SETTLE_WAIT_S (the
    # report then says they differ).
    row = _budget(urls[0], keys["operator"], name)
    deadline = time.monotonic() + SETTLE_WAIT_S
    while row["spent"] != engine_tokens and time.monotonic() < deadline:
        time.sleep(0.2)
        row = _budget(urls[0], keys["operator"], name)
    reservation = prompt_bound(body) + args.race_tokens
    spent = int(row["spent"])
    return Run(
        run=index,
        budget=budget,
        spent=spent,
        overshoot=spent - budget,
        largest_reservation=reservation,
        within_one_reservation=spent - budget <= reservation,
        admitted=len(given),
        refused=len(answers) - len(given),
        engine_tokens=engine_tokens,
        counted_once=spent == engine_tokens,
    )


def run(run_dir: Path, args: Any) -> dict[str, Any]:
    budgets = [args.race_budget + 37 * i for i in range(args.race_runs)]
    keys_path = run_dir / "keys.yaml"
    keys = {"operator": api_keys.add(keys_path, "operator", admin=True)}
    for i, budget in enumerate(budgets, 1):
        keys[f"racer-{i}"] = api_keys.add(
            keys_path, f"racer-{i}", budget={"tokens_per_day": budget}
        )
    port, base, lone_port = free_port(), free_port_range(1), free_port()
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        limits = start_redis(run_dir, stack)
        common = ["--api-keys-file", str(keys_path), "--limits", limits]
        serve_argv = [
            *(sys.executable, "-m", "serve", "--port", str(port)),
            *("--worker-base-port", str(base), "--enforce-eager", *common),
        ]
        lone_argv = [
            *(sys.executable, "-m", "gateway.main", "--port", str(lone_port)),
            *("--workers", f"tcp://127.0.0.1:{base}", *common),
        ]
        urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{lone_port}"]
        serve_log, lone_log = run_dir / "serve.log", run_dir / "gateway-b.log"
        proc = stack.enter_context(launched("llmgate", serve_argv, serve_log, cwd=ROOT))
        check = healthy_workers(1)
        await_ready("llmgate", proc, serve_log, f"{urls[0]}/ready", STARTUP_TIMEOUT_S, check)
        lone = stack.enter_context(
            launched("gateway b", lone_argv, lone_log, env=dict(os.environ), cwd=ROOT)
        )
        await_ready("gateway b", lone, lone_log, f"{urls[1]}/ready", 120.0, check)
        operator = {"Authorization": f"Bearer {keys['operator']}"}
        args.model = (
            args.model
            or httpx.get(f"{urls[0]}/v1/models", headers=operator, timeout=30).json()["data"][0][
                "id"
            ]
        )
        for index, budget in enumerate(budgets, 1):
            runs.append(one_run(index, urls, keys, budget, args))
            print(f"[budget] {_line(runs[-1])}", flush=True)
    report = {
        "model": args.model,
        "requests_per_run": args.race_requests,
        "max_tokens": args.race_tokens,
        "gateways": 2,
        "runs": [asdict(r) for r in runs],
        "worst_overshoot": max(r.overshoot for r in runs),
        "all_within_one_reservation": all(r.within_one_reservation for r in runs),
        "all_counted_once": all(r.counted_once for r in runs),
    }
    write_csv(run_dir / "summary.csv", runs)
    write_json(run_dir / "summary.json", report)
    return report


def _line(r: Run) -> str:
    return (
        f"run {r.run}: budget {r.budget}, spent {r.spent} ({r.overshoot:+d}; one reservation "
        f"{r.largest_reservation}), {r.admitted} admitted, {r.refused} refused, "
        f"engine {r.engine_tokens} tokens"
    )


def format_report(report: dict[str, Any]) -> str:
    headers = ["run", "budget", "spent", "past it", "one reservation", "admitted", "refused"]
    rows = [
        [
            str(r["run"]),
            str(r["budget"]),
            str(r["spent"]),
            f"{r['overshoot']:+d}",
            str(r["largest_reservation"]),
            str(r["admitted"]),
            str(r["refused"]),
        ]
        for r in report["runs"]
    ]
    return (
        f"budget race: {report['requests_per_run']} requests at once over "
        f"{report['gateways']} gateways sharing Redis, max_tokens {report['max_tokens']}\n"
        + markdown_table(headers, rows)
        + f"\nworst: {report['worst_overshoot']:+d} tokens past the budget; every run within "
        f"one reservation: {report['all_within_one_reservation']}; spend = the engine's "
        f"tokens in every run: {report['all_counted_once']}"
    )
