"""Keeps load balancers' health checks out of uvicorn's access log.

Behind vllm-router (`kvserve cluster`) each replica is asked GET /health and GET /get_load every
second: left in, those lines are most of the log and bury the requests that matter."""
from __future__ import annotations

import logging

QUIET_PATHS = frozenset({"/health", "/get_load"})


class HealthCheckFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, http version, status)
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 3 and args[1] == "GET" and str(args[2]).split("?", 1)[0] in QUIET_PATHS:
            return False
        return True


def quiet_health_checks() -> None:
    """Call after uvicorn.Config is built: it configures its loggers then, and a filter set before could
    be lost with them."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, HealthCheckFilter) for f in logger.filters):
        logger.addFilter(HealthCheckFilter())
