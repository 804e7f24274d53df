"""What every benchmark prints: the table to stdout, or with --json the table to stderr and
the figures as JSON to stdout."""
from __future__ import annotations

import json
import sys


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def emit(txt: str, res: dict, as_json: bool) -> int:
    if as_json:
        log(txt)
        print(json.dumps(res, indent=2, default=str))
    else:
        print(txt)
    return 0
