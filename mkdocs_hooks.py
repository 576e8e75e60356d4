"""MkDocs hook: drop the ``skip-example: REASON`` marker from fence info strings.

tests/test_docs_examples.py runs every ```python/```console/```bash/```sh block of the docs
and reports a block as skipped with REASON when its opening fence reads
```` ```bash skip-example: REASON ````. Python-Markdown would not recognise such a fence,
so the marker is removed before the page is rendered (GitHub ignores it by itself).
"""

import re

_MARKER = re.compile(r"^(\s*`{3,}\s*[\w+-]+)[ \t]+skip-example:.*$", re.M)


def on_page_markdown(markdown, **kwargs):
    return _MARKER.sub(r"\1", markdown)
