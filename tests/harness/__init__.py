"""The test harness: what the suite runs on, not what it tests.

Starting the real components (``redis_server``, ``postgres_server``) and
the systems of later modules ahead of time (``prestart``); watching for
stalls of the test process, its event loops and the machine's cores, and
telling them in a failed test's report (``stall_watch``,
``cpu_heartbeats``); waiting on an event with a hang guard (``waiting``);
starting several calls at the same instant (``at_once``).
"""
