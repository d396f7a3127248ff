"""Generate ``docs/report-schema.md`` from the typed ``--json`` report model.

``tracedump/compare/report_schema.py`` holds the model; ``tests/test_report_schema.py`` fails when
the committed page differs from what this renders. A developer tool, not part of the package:

    python tools/report_schema_gen.py            # rewrite docs/report-schema.md
    python tools/report_schema_gen.py --check    # exit 1 (and say so) when it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: document this checkout's tracedump
    sys.path.insert(0, str(ROOT))

from tracedump.compare.report_schema import schema_markdown  # noqa: E402

DOC = ROOT / "docs" / "report-schema.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = parser.parse_args()
    text = schema_markdown()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python tools/report_schema_gen.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
