"""Many verify configurations in one MPI launch: what the drawn property tests run.

    mpiexec -n N python tests/mpi_programs/verify_many.py CONFIGS.json

CONFIGS.json holds a list of flag lists (`["--zero", "3", "--clip", "0", ...]`), each a
`python -m refimpl verify` command line. Each is verified with refimpl.tools.commands.verify.verify_flags, the
code `verify` and `verify --sweep` run (one comparison, refimpl/tools/compare.py). Rank 0 prints one JSON
list on the last stdout line: {"flags", "ok", "tolerance_used", "problems", "skipped_steps",
"reference_skipped_steps", "trainer", "strategy" (from the trainer's report)} per configuration, in order.
"""

import json
import sys

from refimpl.parallel.comm import get_world
from refimpl.tools.commands.verify import verify_flags
from refimpl.tools.console import emit_json
from refimpl.tools.runtime import guards

guards.install()  # a failure on one rank ends every rank, a hang is named (tools/runtime/guards.py)


def main() -> None:
    world = get_world()
    with open(sys.argv[1]) as f:
        configs = json.load(f)
    results = []
    for flags in configs:
        r = verify_flags(world, flags)
        results.append({"flags": flags, "ok": r["ok"], "tolerance_used": r.get("tolerance_used"),
                        "problems": r.get("problems"), "trainer": r.get("trainer"),
                        "strategy": r.get("trainer_report", {}).get("strategy"),
                        "skipped_steps": r.get("skipped_steps", 0),
                        "reference_skipped_steps": r.get("reference_skipped_steps", 0)})
    if world.rank == 0:
        emit_json(results)  # one JSON line; a non-finite tolerance_used becomes 1e308


if __name__ == "__main__":
    main()
