"""`python -m stackproof`. healthcheck runs inside its contract (act/contract.py): nothing imported before it
can crash it into a code a scheduler would read as "take this node out"."""

import sys


def _main() -> int:
    if sys.argv[1:2] != ["healthcheck"]:
        from stackproof.cli import main

        return main()
    try:
        from stackproof.act.contract import guard
    except BaseException as err:  # not even the contract imports; 0 needs no import to say
        print(f"stackproof healthcheck: BROKEN: cannot import stackproof ({type(err).__name__}: {err}); this node "
              "was not judged and stays in service; exit 0", file=sys.stderr, flush=True)
        return 0
    return guard(sys.argv[2:], _cli)


def _cli(argv: list[str]) -> int:
    from stackproof.cli import main  # inside the contract: a crash while importing it is reported, not raised

    return main(argv)


sys.exit(_main())
