#!/usr/bin/env python3
# Every code block of a guide that follows a line ending "From [PATH](...):" must appear verbatim
# in that file, so the page shows the code the tests build and run.
#   check.py GUIDE REPOSITORY_ROOT
import re
import sys
from pathlib import Path

guide, root = Path(sys.argv[1]), Path(sys.argv[2])
quotes = re.findall(r"From\s+\[([^\]]+)\]\([^)]*\):\n+```[a-z+]*\n(.*?)```", guide.read_text(), re.S)
stale = [path for path, block in quotes if block not in (root / path).read_text()]
for path in stale:
    print(f"{guide.name}: a block quoted from {path} is no longer in that file")
print(f"{len(quotes)} quoted blocks, {len(stale)} stale")
sys.exit(1 if stale or not quotes else 0)
