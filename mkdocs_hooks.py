"""MkDocs hook: make the docs' fences render as on GitHub.

tests/docs/test_docs_examples.py runs every ```python/```console/```bash/```sh block of the docs
and reports a block as skipped with REASON when its opening fence reads
```` ```bash skip-example: REASON ````. Python-Markdown would not recognise such a fence,
so the marker is removed before the page is rendered (GitHub ignores it by itself).

Python-Markdown's fenced_code also does not see a fence indented inside a list item; such
a fence is rewritten as an indented code block, which Python-Markdown places in the list
item only at 4 spaces per list level plus 4 (CommonMark's 3-space item indent is not
enough there).
"""

import re

_MARKER = re.compile(r"^(\s*`{3,}\s*[\w+-]+)[ \t]+skip-example:.*$", re.M)
_INDENTED_FENCE = re.compile(r"^(?P<indent>[ \t]+)(?P<fence>`{3,})[^\n]*\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                             re.M | re.S)


def _as_indented_block(m: re.Match) -> str:
    levels = -(-len(m["indent"].expandtabs(4)) // 4)
    pad = " " * (4 * levels + 4)
    lines = m["body"].splitlines()
    return "\n".join(pad + line[len(m["indent"]):] if line.strip() else "" for line in lines)


def on_page_markdown(markdown, **kwargs):
    return _INDENTED_FENCE.sub(_as_indented_block, _MARKER.sub(r"\1", markdown))
