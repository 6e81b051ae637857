"""`merge`: join the part files of a sharded batch run (one per process under accelerate launch)
into its output, in task order."""

from __future__ import annotations

NAME = "merge"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME, help="join the part files of a sharded batch run (accelerate launch) in task order"
    )
    p.add_argument(
        "output", help="the OUTPUT given to batch; OUTPUT.part0, OUTPUT.part1, ... are joined into it"
    )


def run(args) -> int:
    from feedback.serve.batch import merge

    res = merge(args.output)
    if not res["parts"]:
        print(f"no part files: {res['output']} already holds all {res['records']} results")
        return 0
    print(
        f"merged {res['parts']} part files into {res['output']}: {res['records']} results"
        + (f" ({res['duplicates']} duplicates dropped)" if res["duplicates"] else "")
    )
    return 0
