"""How every benchmark reports: the JSON object as the last line of stdout (and `--out FILE`), and,
without `--json`, a readable table before it."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any


def emit(result: dict[str, Any], args: argparse.Namespace, table: bool = True) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if table and not args.json:
        width = max(len(key) for key in result)
        for key, value in result.items():
            print(f"{key:>{width}}: {value}")
    print(json.dumps(result), flush=True)


def paired_ratio(times: list[float], base: list[float]) -> float:
    """The median of each round's ratio of `times` to `base`, measured in the same rounds (load elsewhere hits both
    alike), to three places."""
    return round(statistics.median(a / b for a, b in zip(times, base, strict=True)), 3)
