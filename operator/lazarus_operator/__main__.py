"""Run the Lazarus operator: ``python -m lazarus_operator [--all-namespaces | --namespace NS]``."""
from __future__ import annotations

import argparse
import logging
import random

import kopf
from prometheus_client import start_http_server

from lazarus_core.malloc import keep_plan_heap, limit_malloc_arenas

from . import handlers  # noqa: F401  (registers the kopf handlers)
from .builders import COORDINATOR_PORT


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lazarus-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch LazarusJobs in every namespace")
    scope.add_argument("-n", "--namespace", action="append",
                       help="watch this namespace (repeatable)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=None,
                         help="kopf peering object: replicas sharing it run one at a time")
    peering.add_argument("--standalone", action="store_true",
                         help="no peering (a single replica, or tests)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; the highest acts, the others stand by. kopf "
                             "freezes every replica when priorities tie, so the default is "
                             "a random one")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="serve Prometheus metrics on this port (0: off)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                        help="kopf liveness endpoint URL")
    parser.add_argument("--start-grace-seconds", type=float, default=10.0,
                        help="before a job's first plan, wait this long for its target nodes")
    parser.add_argument("--stall-seconds", type=float, default=600.0,
                        help="publish a job's nodes again when it made no step for this long "
                             "with every worker alive, once it made its first (0: never)")
    parser.add_argument("--coordinator-port", type=int, default=COORDINATOR_PORT,
                        help="port of each job's coordinator (the workers' rendezvous store)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    limit_malloc_arenas()  # before any thread starts
    keep_plan_heap()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # One line per handler call is noise at a thousand nodes; failures still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority if args.priority is not None else random.randrange(1, 2**31),
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(start_grace_s=args.start_grace_seconds, stall_s=args.stall_seconds,
                       coordinator_port=args.coordinator_port),
    )


if __name__ == "__main__":
    main()
