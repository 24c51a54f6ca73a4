"""Bounded waits. Every wait in the tests goes through ``wait_until``, so none can hang and
each timeout says what was awaited and what was last seen."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold in time. An AssertionError, so pytest reports it as a failure."""


def wait_until(
    check: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = 0.25,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call ``check`` until it returns something truthy, and return that.

    ``what`` names the awaited condition for the timeout message. ``describe`` (optional)
    reports the state that was last seen, so the failure explains itself.
    """
    __tracebackhide__ = True  # pytest shows the caller, not this loop
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - transient API errors are retried until the deadline
            last_error = e
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    message = f"timed out after {timeout:g} s waiting for {what}"
    if describe is not None:
        try:
            message += f"; last seen: {describe()}"
        except Exception as e:  # noqa: BLE001 - the describe is best effort
            message += f"; (describing the state failed: {e})"
    if last_error is not None:
        message += f"; last error: {last_error!r}"
    raise WaitTimeout(message)
