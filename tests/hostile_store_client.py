"""A hostile client of a job's store: it knows the channel's key layout (the code is public)
but not the job's key. Round after round it writes a stop, forges commits, reports,
checkpoints and directives (its own, and real signed ones replayed under other keys),
points the workers at a generation of its making, bumps the counters and deletes what the
coordinator wrote. It prints the number of each round it completes.

    python tests/hostile_store_client.py HOST:PORT

Run by tests/runtime/test_hostile_store_client.py against a local job, and as a pod next to
a job on the cluster by tests/operator/test_full_stack.py.
"""
import datetime
import sys
import time

import torch.distributed as dist

FORGED_MAC = "0" * 64  # where the signature goes: any guess is as good as this one


def attack_round(store: dist.Store) -> None:
    store.set("lazarus/stop", "1")
    store.set("lazarus/stop", FORGED_MAC + "1")
    store.set("lazarus/latest", "99")
    store.set("lazarus/directive/99", FORGED_MAC + '{"plan": {}, "start_step": 1}')
    store.set("lazarus/checkpoint", FORGED_MAC + "1000")
    store.set("lazarus/hello/intruder", "1")
    # Replays: the real, signed directive of generation 1 as generation 2's, and the
    # commits of steps already made as those of the steps to come.
    if store.check(["lazarus/directive/1"]):
        store.set("lazarus/directive/2", store.get("lazarus/directive/1"))
        store.set("lazarus/latest", "2")
    for generation in (1, 2):
        store.set(f"lazarus/adopted/{generation + 1}", "1")
        store.add(f"lazarus/fetched/{generation + 1}", 10)
        for step in range(1, 40):
            key = f"lazarus/commit/{generation}/{step}"
            if store.check([key]):
                store.set(f"lazarus/commit/{generation}/{step + 1}", store.get(key))
            else:
                store.set(key, str(generation + 1))
            store.add(f"lazarus/prepared/{generation}/{step}", 10)
            store.set(f"lazarus/report/{generation}/{step}/0",
                      '{"loss": 0, "sample_ids": [], "loads": null}')
    # The workers' names are in their hello keys: forged hellos (a worker that claims to
    # hold everything, fresh from a new incarnation) and forged failure reports from each of
    # them (a peer failure would make the coordinator re-plan within a second).
    for key in store.list_keys():
        if key.startswith("lazarus/hello/") and key != "lazarus/hello/intruder":
            node = key.rsplit("/", 1)[1]
            store.set(key, FORGED_MAC + '{"incarnation": "x", "committed": 999999}')
            for generation in (1, 2, 3):
                store.set(f"lazarus/failed/{generation}/{node}", FORGED_MAC + "1")
                store.add(f"lazarus/failed/{generation}", 1)
    store.set("lazarus/beat/intruder", FORGED_MAC + '{"count": 1, "busy_s": 0}')
    # What the coordinator wrote, deleted: it writes it back.
    store.delete_key("lazarus/latest")
    store.delete_key("lazarus/adopted/1")


def main() -> int:
    host, port = sys.argv[1].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    rounds = 0
    while True:
        attack_round(store)
        rounds += 1
        print(rounds, flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
