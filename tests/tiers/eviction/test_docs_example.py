"""docs/architecture.md, "Adding an eviction policy", shows the shipped
``lfu`` policy as it is: its code block is the class in ``lfu.py``."""

from __future__ import annotations

import re
from pathlib import Path

import kvtier.tiers.eviction.lfu as lfu

ROOT = Path(__file__).resolve().parents[3]


def test_the_docs_example_is_the_lfu_file():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Adding an eviction policy", 1)[1].split("\n## ", 1)[0]
    shown = re.search(r"```python\n(class LFUPolicy.*?)```", section, re.S).group(1)
    source = Path(lfu.__file__).read_text()
    assert shown == source[source.index("class LFUPolicy"):]
